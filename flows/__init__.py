"""Prefect flows: one per user-facing job, each a short function of phase tasks."""

from flows.settings import apply_env_defaults

# before any flow runs: Prefect's temporary server reads these when it starts (flows/settings.py)
apply_env_defaults()
