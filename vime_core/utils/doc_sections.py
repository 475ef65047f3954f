"""Generated sections of the documentation: the part of a file between two markers, replaced by
what the code says now (docs/configuration.md's table, docs/lineage.md's schema). A leaf, so the
packages that generate a section share it without importing each other."""

from __future__ import annotations


def replace_section(text: str, start: str, end: str, body: str) -> str:
    """`text` with the part between the `start` and `end` markers replaced by `body` (generated
    documentation sections: docs/configuration.md's table, docs/lineage.md's schema)."""
    if start not in text or end not in text:
        raise ValueError(f"markers {start!r} / {end!r} not found")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"
