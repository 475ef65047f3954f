"""Small helpers shared across vime_core (no heavy imports)."""
