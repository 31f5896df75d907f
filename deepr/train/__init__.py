"""Training: the tiny offline model builder, and (from other modules) SFT / GRPO stages."""
