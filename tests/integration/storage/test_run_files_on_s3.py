"""A whole train flow (real Ray head, vLLM CPU engine, Megatron actor, Prefect) with its storage on
the real S3 server: what the run writes besides its batches lands in the bucket too. After one
iteration the bucket holds the run's config.json (the configuration its batch was made under),
metrics.jsonl, the reward curve, summary.json and the HF export, a folder that
`<run>/manifest.json` names, which loads in transformers from a local download."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "files-on-s3"


def _download(folder_uri: str, dest) -> None:
    from vime_core.storage.fs import open_location

    folder = open_location(folder_uri)
    for key in folder.list_keys(""):
        (dest / key).parent.mkdir(parents=True, exist_ok=True)
        (dest / key).write_bytes(folder.get(key))


def test_a_run_on_s3_writes_its_configuration_reports_and_export_there(s3_env, ray_head, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from vime_core.config import config_hash
    from tests.integration.small_run import small_run_config
    from vime_core.config.loader import read_run_config
    from vime_core.report.records import read_records, report_location, run_dir
    from vime_core.storage import BatchStore
    from vime_core.storage.folders import published_folder
    from vime_core.storage.fs import open_location

    uri = s3_env.storage_uri("run-files")
    cfg = small_run_config(
        run_name=RUN,
        storage_uri=uri,
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,  # its workers hold the credentials, the configuration the endpoint
        storage_endpoint_url=s3_env.endpoint,
        num_rollout=1,
    )
    try:
        summary = train(cfg)
    finally:
        teardown(cfg.run_name)

    reports = report_location(uri, RUN)
    assert sorted(reports.list_keys("")) == ["config.json", "metrics.jsonl", "reward_curve.png", "summary.json"]
    _, lineage = BatchStore(uri).read(RUN, 0)
    assert config_hash(read_run_config(uri, RUN)) == lineage["config_hash"]  # the configuration of the run's batch
    assert [r["rollout_id"] for r in read_records(uri, RUN)] == [0]
    assert reports.get("reward_curve.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(reports.get("summary.json"))["iterations"] == 1

    exports = open_location(run_dir(uri, RUN, "exports").rsplit("/", 1)[0])
    assert summary["hf_export"].startswith(f"{uri}/exports/{RUN}/v")
    assert published_folder(exports, RUN) == summary["hf_export"]
    local = tmp_path / "export"
    _download(summary["hf_export"], local)
    model = AutoModelForCausalLM.from_pretrained(local)
    assert torch.isfinite(model(torch.tensor([[6, 13, 7, 15]])).logits).all()
    trained, initial = load_file(str(local / "model.safetensors")), load_file(str(tiny_model_dir / "model.safetensors"))
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # the trained weights, not the source's
