"""Synthetic tasks with rule-based rewards that a tiny fresh model can learn by RL alone."""
