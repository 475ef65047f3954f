"""The embedded demo's settings (the table: vime_core/config/demo_settings.py) and `demo_config`,
a configuration of given fields over them.

The table lives in the configuration package because the configuration reads it (the demo's
settings apply to a configuration that names no model): this module makes configurations, so it
imports the configuration and the configuration must not import it.
"""

from __future__ import annotations

from typing import Any

from vime_core.config.demo_settings import DEMO_SETTINGS, demo_values, with_demo_settings
from vime_core.config.loader import make_config

__all__ = ["DEMO_SETTINGS", "demo_config", "demo_values", "with_demo_settings"]


def demo_config(**fields: Any):
    """A VimeConfig of `fields` over the demo's settings (demo_values)."""
    return make_config(demo_values(fields))
