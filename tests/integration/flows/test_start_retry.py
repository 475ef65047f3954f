"""An engine that crashes before it serves, at a run's start, takes its RolloutManager with it:
bootstrap's second try creates both again and the run trains. On a GPU the crash can be a
trainer growing while vLLM profiles its memory; here the engine's interpreter exits 1 on its
first server start (a wrapper around the real one), then starts the real vLLM CPU server."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e]

FLAKY_PYTHON = """#!/usr/bin/env bash
case "$*" in
  *api_server*)
    echo start >> "{starts}"
    if [ ! -e "{crashed}" ]; then touch "{crashed}"; echo "flaky: the first server start exits 1" >&2; exit 1; fi ;;
esac
exec "{python}" "$@"
"""


def test_an_engine_that_crashes_at_start_is_started_again_by_bootstrap(tmp_path, ray_head, tiny_model_dir, vllm_python):
    from flows.train import train
    from tests.integration.small_run import small_run_config
    from vime_core.cluster.run_actors import teardown
    from vime_core.report.records import read_records

    starts, crashed = tmp_path / "starts", tmp_path / "crashed"
    script = tmp_path / "flaky_python.sh"
    script.write_text(FLAKY_PYTHON.format(starts=starts, crashed=crashed, python=vllm_python))
    script.chmod(0o755)
    cfg = small_run_config(
        run_name="e2e-start-retry",
        storage_uri=str(tmp_path / "store"),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=1,
        vllm_python=str(script),
    )
    try:
        summary = train(cfg)
    finally:
        teardown(cfg.run_name)
    assert crashed.exists(), "the wrapper never started a server"
    assert starts.read_text().split() == ["start", "start"]  # the crashed start, then bootstrap's second try
    assert summary["iterations"] == 1
    assert [r["rollout_id"] for r in read_records(cfg.storage_uri, cfg.run_name)] == [0]
