"""The learning experiment behind `make learn` (docs/learning.md): does SFT, then GRPO, make a
model better on questions from topics that training never saw? Every step runs a ``deepr``
command; this package prepares their data, scores their held-out runs and reports intervals."""
