"""`demo_config`: a configuration of given fields over the embedded demo's settings (the table is
vime_core/config/demo_settings.py, because the configuration reads it and must not import this module)."""

from __future__ import annotations

from typing import Any

from vime_core.config.demo_settings import DEMO_SETTINGS, demo_values, with_demo_settings
from vime_core.config.loader import make_config

__all__ = ["DEMO_SETTINGS", "demo_config", "demo_values", "with_demo_settings"]


def demo_config(**fields: Any):
    """A VimeConfig of `fields` over the demo's settings (demo_values)."""
    return make_config(demo_values(fields))
