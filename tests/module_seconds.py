"""Seconds per test module of the last `bash infra/test.sh` (its --junitxml file), slowest first:
where the suite's time goes, module by module (a module's shared fixtures count once, in the
test that first asked for them).

    .venv/bin/python tests/module_seconds.py [.cache/tests/last-run.xml] [--top N]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / ".cache" / "tests" / "last-run.xml"


def module_seconds(junit_xml: Path) -> dict[str, tuple[float, int]]:
    """{module: (seconds, tests)} from a pytest junit file (classname "tests.x.test_y[.Class]")."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = ".".join(parts[: next((i + 1 for i, p in enumerate(parts) if p.startswith("test_")), len(parts))])
        totals[module][0] += float(case.get("time", 0.0))
        totals[module][1] += 1
    return {m: (s, n) for m, (s, n) in totals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit_xml", nargs="?", type=Path, default=DEFAULT)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    rows = sorted(module_seconds(a.junit_xml).items(), key=lambda kv: -kv[1][0])
    total = sum(s for s, _ in dict(rows).values())
    for module, (seconds, tests) in rows[: a.top]:
        print(f"{seconds:8.1f} s {100 * seconds / total:5.1f} % {tests:5d} tests  {module}")
    print(f"{total:8.1f} s in all, {len(rows)} modules")


if __name__ == "__main__":
    main()
