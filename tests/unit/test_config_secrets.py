"""Credentials put in configuration fields never reach what a configuration becomes outside the
live process (config_dict: config.json, the startup log, W&B/TensorBoard, a batch's lineage;
vime_core/utils/secrets.py): canaries in each place a user may put one are searched for in all
of them; the run's non-secret settings survive the round trip through config.json."""

from __future__ import annotations

import json

from vime_core.config import config_hash, load_config, make_config
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


# An AWS secret access key holds "/" about half the time; a token may stand alone before "@"; some
# services take their key as ?code= (Azure Functions), ?pwd= or ?jwt=.
SLASHED = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
URL_FORMS = {
    f"s3://AKIAIOSFODNN7EXAMPLE:{SLASHED}@bucket/prefix": SLASHED,
    "https://hf_tokencanary@reward.example.com/score": "hf_tokencanary",
    "https://rm.azurewebsites.net/api/score?code=Zm9vYmFyY2FuYXJ5&n=1": "Zm9vYmFyY2FuYXJ5",
    "https://rm.example/s?pwd=pwdcanary": "pwdcanary",
    "https://rm.example/s?jwt=jwtcanary": "jwtcanary",
}


def test_every_url_form_of_a_credential_is_redacted_and_refused_where_stored():
    from vime_core.utils.secrets import carries_userinfo, redact_url

    for url, secret in URL_FORMS.items():
        once = redact_text(url, secrets=[])
        assert secret not in once and secret not in redact_url(url) and redact_text(once, secrets=[]) == once, url
    assert carries_userinfo(next(iter(URL_FORMS)))  # urlsplit ends the host at the secret's first "/"
    assert carries_userinfo("https://hf_tokencanary@reward.example.com/score")
    for plain in ("s3://bucket/key@v1", "s3://bucket/a:b@c", "http://127.0.0.1:8333/x"):
        assert not carries_userinfo(plain) and redact_text(plain, secrets=[]) == plain, plain


def test_a_storage_uri_or_endpoint_with_a_slashed_secret_is_refused_without_echoing_it(monkeypatch):
    import pytest

    from vime_core.storage.endpoint import EndpointCredentialsError, resolve_endpoint_url
    from vime_core.storage.fs import open_location

    with pytest.raises(ValueError, match="carries credentials") as err:
        open_location(f"s3://AKIAIOSFODNN7EXAMPLE:{SLASHED}@bucket/prefix")
    assert SLASHED not in str(err.value) and "K7MDENG" not in str(err.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://admin:{SLASHED}@127.0.0.1:8333")
    with pytest.raises(EndpointCredentialsError, match="carries credentials") as err:
        resolve_endpoint_url()
    assert "K7MDENG" not in str(err.value)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    with pytest.raises(ValueError, match="vllm_cache_uri carries credentials") as err:
        make_config({"vllm_cache_uri": f"s3://AKIAIOSFODNN7EXAMPLE:{SLASHED}@bucket/cache"})
    assert "K7MDENG" not in str(err.value)


def test_engine_urls_are_http_urls_given_once():
    import pytest

    attached = {"colocate": False, "offload_rollout": False}
    with pytest.raises(ValueError, match=r"engine_urls\[0\]='' is not an http\(s\)://host:port URL"):
        make_config({**attached, "engine_urls": [""]})  # an unset $URL: vime's own open engines
    with pytest.raises(ValueError, match=r"engine_urls\[1\]='127.0.0.1:8000' is not an http"):
        make_config({**attached, "engine_urls": ["http://127.0.0.1:8001", "127.0.0.1:8000"]})
    with pytest.raises(ValueError, match=r"engine_urls\[1\] is engine_urls\[0\] again"):
        make_config({**attached, "engine_urls": ["http://127.0.0.1:8000", "http://127.0.0.1:8000/"]})
    assert make_config({**attached, "engine_urls": ["http://127.0.0.1:8000", "https://e1:443"]}).engine_urls


def test_remote_reward_settings_without_the_remote_model_are_named_unused_without_their_values():
    """rm_url given to a run whose rewards come from elsewhere is warned about at the run's start,
    one line per field, never with the URL (it may carry a credential)."""
    from vime_core.config.derive import unused_settings

    url = f"https://bob:{CANARIES[0]}@rm.example/score"
    lines = unused_settings(make_config({"rm_url": url, "rm_timeout_s": 5.0}))
    assert [line.split(" ", 1)[0] for line in lines] == ["rm_url", "rm_timeout_s"]
    assert "rewards come from rm_type='arith'" in lines[0] and not any(CANARIES[0] in line for line in lines)
    custom = unused_settings(make_config({"rm_url": url, "custom_rm_path": "vime_core.demo.task:reward"}))
    assert "custom_rm_path='vime_core.demo.task:reward'" in custom[0]
    assert unused_settings(make_config({"rm_type": "remote_rm", "rm_url": url, "rm_timeout_s": 5.0})) == []
    assert unused_settings(make_config({})) == []


def test_settings_read_only_beside_another_are_named_unused_when_it_is_off():
    """A KL estimator with no KL term, guard_retries without rollback, eval settings without
    eval_interval, W&B settings without use_wandb: one line each at the run's start; none when the
    setting that reads them is on."""
    from vime_core.config.derive import unused_settings

    off = {
        "kl_loss_type": "k1",
        "guard_retries": 5,
        "n_samples_per_eval_prompt": 4,
        "eval_temperature": 0.7,
        "wandb_project": "mine",
        "wandb_mode": "offline",
    }
    lines = unused_settings(make_config(off))
    assert [line.split(" ", 1)[0] for line in lines] == list(off)
    assert "kl_loss_type is set but unused: it is read only with a KL term" in lines[0]
    assert "read only with eval_interval" in lines[2] and "read only with use_wandb=true" in lines[4]
    on = {**off, "use_kl_loss": True, "guard_action": "rollback", "eval_interval": 2, "use_wandb": True}
    assert unused_settings(make_config(on)) == []
