"""Prefect tasks: one per phase of the step. Each calls the run's long-lived Ray actors and
returns small values (metrics, versions, object references), never the batch itself."""
