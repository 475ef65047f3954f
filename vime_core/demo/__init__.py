"""The embedded demo, run when a configuration names no model: single-digit addition
(task.py: the dataset and its reward), the tiny Qwen3-style model that learns it (model.py, also
the tests' tiny checkpoints), and the settings it trains with (settings.py)."""
