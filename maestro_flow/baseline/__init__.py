"""Baselines to compare section mode against (the monolithic, Megatron-style trainer)."""
