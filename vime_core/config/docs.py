"""The configuration reference, generated from `VimeConfig` (README section between the
`config:start` / `config:end` markers). `python -m vime_core.config.docs --write README.md`
refreshes it; a unit test fails when it is stale."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from vime_core.config.schema import VimeConfig

START, END = "<!-- config:start -->", "<!-- config:end -->"


def _default(field) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    return "`" + json.dumps(value) + "`"


def config_table() -> str:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, field in VimeConfig.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `--{name.replace('_', '-')}` | {_default(field)} | {desc} |")
    return "\n".join(rows)


def render_into(text: str) -> str:
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {START} ... {END} section to fill")
    return pattern.sub(lambda _: f"{START}\n{config_table()}\n{END}", text)


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
