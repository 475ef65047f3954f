"""Megatron's fallback warnings stay off the console once vime_core.trainer is imported; the same
text from another module is still shown (vime_core/utils/quiet.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _warnings_of(code: str) -> str:
    run = subprocess.run(
        [sys.executable, "-W", "always", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


def test_megatron_import_is_quiet_after_the_trainer_package():
    loud = _warnings_of("import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs")
    assert "Apex is not installed" in loud  # the noise exists: otherwise this test shows nothing
    quiet = _warnings_of("import vime_core.trainer, megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs")
    assert "not installed" not in quiet, quiet[-2000:]


def test_the_same_text_from_another_module_is_shown():
    code = "import vime_core.trainer, warnings\nwarnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
    assert "Apex is not installed" in _warnings_of(code)


def test_ray_daemons_metrics_exporter_lines_are_dropped_and_nothing_else():
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from vime_core.utils.quiet import quiet_ray_daemons

    printed: list[dict] = []
    dispatcher.add_handler("ray_print_logs", printed.append)  # as ray.init(log_to_driver=True) does
    try:
        assert quiet_ray_daemons() and quiet_ray_daemons()  # idempotent
        noise = (
            "[2026-12-02 03:00:25,546 E 1245 1245] (raylet) main.cc:1108: Failed to establish connection to "
            "the metrics exporter agent. Metrics will not be exported."
        )
        gcs = "(gcs_server) gcs_server.cc:1361: Failed to establish connection to the event+metrics exporter agent."
        dispatcher.emit({"pid": "raylet", "lines": [noise], "is_err": True})
        dispatcher.emit({"pid": "gcs_server", "lines": [gcs, "raylet died"], "is_err": True})
        dispatcher.emit({"pid": 4242, "lines": [noise], "is_err": True})  # an actor saying it: kept
        assert [d["lines"] for d in printed] == [["raylet died"], [noise]]
    finally:
        dispatcher.remove_handler("ray_print_logs")
