"""Prefect flows: one per user-facing job, each a short function of phase tasks."""
