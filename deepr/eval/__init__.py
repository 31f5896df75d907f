"""`deepr eval`: metrics over reports, plans and answers (see :mod:`deepr.eval.evaluate`)."""
