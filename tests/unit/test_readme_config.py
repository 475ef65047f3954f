"""The configuration reference (docs/configuration.md) is generated from the model and must not go stale."""

from pathlib import Path

from vime_core.config.docs import config_table, render_into
from vime_core.config import VimeConfig

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    text = REFERENCE.read_text()
    assert render_into(text) == text, "run: python -m vime_core.config.docs --write docs/configuration.md"


def test_every_field_is_documented():
    table = config_table()
    for name, field in VimeConfig.model_fields.items():
        assert field.description, f"{name} has no description"
        assert f"`--{name.replace('_', '-')}`" in table
