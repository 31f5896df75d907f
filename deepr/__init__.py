"""deepr: build deep-research agents end to end on your own corpus, models and GPUs.

    import deepr
    report = deepr.run("How did the printing press change science?", corpus="my_docs/")
    print(report.markdown)

``run``, ``build_trees`` and ``evaluate`` are what ``deepr run``, ``deepr build-trees`` and
``deepr eval`` call (deepr/api.py); importing deepr loads none of their dependencies.
"""

from deepr._version import __version__
from deepr.api import build_trees, evaluate, run

__all__ = ["__version__", "build_trees", "evaluate", "run"]
