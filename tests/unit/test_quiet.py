"""Megatron's fallback warnings stay off the console once vime_core.trainer is imported; the same
text from another module is still shown (vime_core/utils/quiet.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _warnings_of(code: str) -> str:
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


def test_megatron_import_is_quiet_after_the_trainer_package():
    loud = _warnings_of("import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs")
    assert "Apex is not installed" in loud  # the noise exists: otherwise this test shows nothing
    quiet = _warnings_of("import vime_core.trainer, megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs")
    assert "not installed" not in quiet, quiet[-2000:]


def test_the_same_text_from_another_module_is_shown():
    code = (
        "import vime_core.trainer, warnings\n"
        "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
    )
    assert "Apex is not installed" in _warnings_of(code)
