"""deepr: build deep-research agents end to end on your own corpus, models and GPUs."""

__version__ = "0.1.0"
