"""A real `vime train` with on-policy distillation: the embedded demo as the student, a sharpened
copy of it as the teacher (--use-opd --opd-type megatron --opd-teacher-load), 4 iterations on a
local Ray head of its own (tests/e2e/check_distillation_run.sh). The learning itself is measured in
tests/integration/trainer/test_distillation_learning.py; this is the whole path (the driver's
resolution of the teacher, the Ray trainer actor loading it, opd_reverse_kl in metrics.jsonl),
so it runs only when asked:

    VIME_E2E=1 .venv/bin/python -m pytest tests/e2e/test_distillation_run.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("VIME_E2E") != "1", reason="a real run (~5 min on 2 cores): set VIME_E2E=1")
def test_a_distillation_run_reports_a_falling_reverse_kl():
    proc = subprocess.run(
        ["bash", "tests/e2e/check_distillation_run.sh"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result
