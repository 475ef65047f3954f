"""Credentials put in configuration fields never reach what a configuration becomes outside the
live process (config_dict: config.json, the startup log, W&B/TensorBoard, a batch's lineage;
vime_core/utils/secrets.py): canaries in each place a user may put one are searched for in all
of them; the run's non-secret settings survive the round trip through config.json."""

from __future__ import annotations

import json

from vime_core.config import config_hash, load_config
from vime_core.config.loader import config_dict, describe, dump_config, read_run_config, run_config_uri
from vime_core.storage.schema import batch_to_table, lineage_of
from vime_core.storage.synthetic import synthetic_batch
from vime_core.utils.secrets import REDACTED, redact_secrets, redact_text

CANARIES = ("hunter2-canary", "sk-live-canary-123", "sk-engine-canary-456", "hf-canary-789", "sig-canary-000")


def _secret_cfg(tmp_path):
    return load_config(
        overrides={
            "storage_uri": str(tmp_path / "runs"),
            "run_name": "canary",
            "rm_type": "remote_rm",
            "rm_url": f"https://bob:{CANARIES[0]}@rm.example:8443/score?api_key={CANARIES[1]}&model=m1&X-Amz-Signature={CANARIES[4]}",
            "vllm_extra_args": ["--api-key", CANARIES[2], f"--hf-token={CANARIES[3]}", "--max-num-seqs", "8"],
        }
    )


def _no_canary(text: str) -> None:
    for canary in CANARIES:
        assert canary not in text, f"{canary} leaked"


def test_config_json_the_startup_log_and_the_hash_hold_no_credential(tmp_path):
    cfg = _secret_cfg(tmp_path)
    uri = run_config_uri(cfg.storage_uri, cfg.run_name)
    dump_config(cfg, uri)
    stored = (tmp_path / "runs" / "reports" / "canary" / "config.json").read_text()
    _no_canary(stored)
    _no_canary(describe(cfg))
    _no_canary(json.dumps(config_dict(cfg)))  # what W&B and TensorBoard are given
    values = json.loads(stored)
    assert (
        values["rm_url"]
        == f"https://bob:{REDACTED}@rm.example:8443/score?api_key={REDACTED}&model=m1&X-Amz-Signature={REDACTED}"
    )
    assert values["vllm_extra_args"] == ["--api-key", REDACTED, f"--hf-token={REDACTED}", "--max-num-seqs", "8"]
    assert values["rm_api_key_env"] == "VIME_RM_API_KEY"  # where the token is kept is not the token
    # the stored configuration reads back, and hashes as the live one does
    assert config_hash(read_run_config(cfg.storage_uri, cfg.run_name)) == config_hash(cfg)
    assert cfg.vllm_extra_args[1] == CANARIES[2]  # the live configuration keeps what the engines need


def test_a_batch_lineage_holds_no_credential(tmp_path):
    """The lineage of a stored batch carries the configuration as the trainer hands it over (the
    raw values: the schema redacts them itself) and as config_dict gives it."""
    cfg = _secret_cfg(tmp_path)
    for config in (cfg.model_dump(mode="json"), config_dict(cfg)):
        table = batch_to_table(
            synthetic_batch(),
            {"run": "canary", "rollout_id": 0, "config_hash": config_hash(cfg), "config": config, "flow_run_id": "f-1"},
        )
        blob = b"".join(k + v for k, v in table.schema.metadata.items()).decode()
        _no_canary(blob)
        assert json.loads(lineage_of(table)["config"])["vllm_extra_args"][2] == "--hf-token=" + REDACTED


def test_redaction_is_idempotent_and_spares_settings():
    once = redact_secrets(
        {
            "rm_url": "https://h/s?token=abc&n=1",
            "max_tokens_per_gpu": 4096,
            "use_tis": True,
            "args": ["--api-key=k1", "--password", "p", "--port", "80"],
        },
        secrets=[],
    )
    assert redact_secrets(once, secrets=[]) == once
    assert once == {
        "rm_url": f"https://h/s?token={REDACTED}&n=1",
        "max_tokens_per_gpu": 4096,
        "use_tis": True,
        "args": [f"--api-key={REDACTED}", "--password", REDACTED, "--port", "80"],
    }
    assert (
        redact_text("no secret here: s3://bucket/key/a?versionId=3", secrets=[])
        == "no secret here: s3://bucket/key/a?versionId=3"
    )


def test_the_json_form_prefect_records_holds_no_credential_and_the_live_one_keeps_them(tmp_path):
    """Prefect stores a flow run's parameters as FastAPI's jsonable_encoder makes them (its UI and
    database): that is VimeConfig's JSON form, redacted; Python-mode dumps and pickles (how the
    configuration reaches the run's actors) keep the values the run needs."""
    import pickle

    from fastapi.encoders import jsonable_encoder

    cfg = _secret_cfg(tmp_path)
    _no_canary(json.dumps(jsonable_encoder({"config": cfg})))
    _no_canary(cfg.model_dump_json())
    assert (
        CANARIES[1] in cfg.model_dump()["rm_url"] and pickle.loads(pickle.dumps(cfg)).vllm_extra_args[1] == CANARIES[2]
    )
