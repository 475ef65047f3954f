"""The configuration reference, generated from `VimeConfig` (docs/configuration.md, between the
`config:start` / `config:end` markers). `python -m vime_core.config.docs --write docs/configuration.md`
refreshes it; a unit test fails when it is stale."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vime_core.config.schema import ConfigFields
from vime_core.config.demo_settings import DEMO_SETTINGS
from vime_core.utils.doc_sections import replace_section

START, END = "<!-- config:start -->", "<!-- config:end -->"


def _default(name: str, field) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    text = "`" + json.dumps(value) + "`"
    if name in DEMO_SETTINGS:
        text += " (demo `" + json.dumps(DEMO_SETTINGS[name]) + "`)"
    return text


def config_table() -> str:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, field in ConfigFields.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `--{name.replace('_', '-')}` | {_default(name, field)} | {desc} |")
    return "\n".join(rows)


def render_into(text: str) -> str:
    return replace_section(text, START, END, config_table())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--write", type=Path, help="file whose config section is refreshed in place")
    args = p.parse_args()
    if args.write:
        args.write.write_text(render_into(args.write.read_text()))
    else:
        print(config_table())


if __name__ == "__main__":
    main()
