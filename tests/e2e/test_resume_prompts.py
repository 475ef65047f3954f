"""A run killed and resumed with new actors trains on the same prompts as an uninterrupted one:
two real 6-iteration runs of the default job on a local Ray head (tests/e2e/check_resume_prompts.sh).
The data source's position is unit-tested in
tests/unit/test_data_source_resume.py; this is the whole path, so it runs only when asked:

    VIME_E2E=1 .venv/bin/python -m pytest tests/e2e -q
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.environ.get("VIME_E2E") != "1", reason="two real runs (~4 min on 2 cores): set VIME_E2E=1")
def test_a_resumed_run_trains_on_the_same_prompts():
    proc = subprocess.run(
        ["bash", "tests/e2e/check_resume_prompts.sh"], cwd=REPO, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result
