"""Model checkpoints: a hub id resolved to a local folder (hub.py)."""
