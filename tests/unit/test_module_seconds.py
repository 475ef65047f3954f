"""tests/module_seconds.py sums a junit file's test seconds per module (classes folded in)."""

from __future__ import annotations

import pytest

from tests.module_seconds import module_seconds

CASES = [  # (classname, name, seconds)
    ("tests.integration.flows.test_faults", "test_a", 36.5),
    ("tests.integration.flows.test_faults", "test_b[x]", 0.25),
    ("tests.unit.test_losses.TestClip", "test_c", 1.5),
    ("tests.unit.test_losses", "test_d", 0.125),
]


def test_seconds_and_tests_are_summed_per_module(tmp_path):
    cases = "".join(f'<testcase classname="{c}" name="{n}" time="{s}"/>' for c, n, s in CASES)
    junit = tmp_path / "run.xml"
    junit.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    expected: dict[str, list] = {}
    for classname, _, seconds in CASES:
        module = classname.removesuffix(".TestClip")
        expected.setdefault(module, [0.0, 0])
        expected[module][0] += seconds
        expected[module][1] += 1
    got = module_seconds(junit)
    assert got.keys() == expected.keys()
    for module, (seconds, tests) in expected.items():
        assert got[module] == (pytest.approx(seconds), tests)
