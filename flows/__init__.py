"""Prefect flows: one per user-facing job, each a short function of phase tasks.

Importing this package changes nothing in the process: the entry points apply the Prefect
server defaults themselves (`flows.settings.apply_env_defaults`, called by `vime`'s main).
"""
