"""Re-scoring stored samples (vime_core/rescore.py, vime_core/storage/rescored.py): batches made by
the real rollout loop (engine stubbed, tests/unit/test_rollout_loop.py's fake) and stored in a
local store with the run's config.json, then scored again by a reward function changed on purpose
for known samples: the blast radius lists exactly those, with the advantages their groups' new
statistics give (computed here with the run's estimator), and replay's batch carries them."""

from __future__ import annotations

import pytest

from tests.unit.test_rollout_loop import FakeGenerator, make_state, run_loop
from vime_core.algo.advantages import postprocess_rewards

pytestmark = pytest.mark.timeout(120)
THIS = __file__
RUN = "rs"


def index_reward(sample) -> float:
    return float(sample.index % 2)


def changed(sample) -> bool:
    """The samples the fixed reward scores differently: index 0 of every even group."""
    return sample["group_index"] % 2 == 0 and sample["index"] == 0


def fixed_reward(sample) -> float:
    return 1.0 if changed({"group_index": sample.group_index, "index": sample.index}) else index_reward(sample)


def raises_on_index_3(sample) -> float:
    if sample.index == 3:
        raise ValueError("broken on purpose")
    return index_reward(sample)


@pytest.fixture
def stored_run(tmp_path, tiny_model_dir):
    """Two stored batches of run RUN and checkpoints after rollouts 0 and 1 (manifests only)."""
    from transformers import AutoTokenizer

    from vime_core.config import make_config
    from vime_core.config.loader import dump_config, run_config_uri
    from vime_core.data.batch import build_batch
    from vime_core.demo.task import write_dataset
    from vime_core.storage import BatchStore

    uri = str(tmp_path / "store")
    cfg = make_config(
        {
            "run_name": RUN,
            "storage_uri": uri,
            "hf_checkpoint": str(tiny_model_dir),
            "prompt_data": str(write_dataset(tmp_path / "arith.jsonl")),
            "rollout_batch_size": 4,
            "n_samples_per_prompt": 4,
            "rollout_max_prompt_len": 16,
            "rollout_max_response_len": 8,
            "custom_rm_path": f"{THIS}:index_reward",
            "vllm_server_concurrency": 8,
        }
    )
    dump_config(cfg, run_config_uri(uri, RUN))
    state = make_state(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), FakeGenerator())
    store = BatchStore(uri)
    for k in (0, 1):
        samples, _ = run_loop(state, k)
        store.write(build_batch(samples, cfg), {"run": RUN, "rollout_id": k})
        (tmp_path / "store" / "checkpoints" / RUN / f"rollout_{k:06d}").mkdir(parents=True)
        (tmp_path / "store" / "checkpoints" / RUN / f"rollout_{k:06d}" / "manifest.json").write_text("{}")
    return cfg, store


def _rows(batch: dict) -> list[dict]:
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def test_the_blast_radius_lists_exactly_the_samples_the_new_reward_changed(stored_run):
    from vime_core.rescore import rescore_run

    cfg, store = stored_run
    result = rescore_run(cfg.storage_uri, RUN, f"{THIS}:fixed_reward")
    assert result["version"] == 2 and result["replaces"] == f"{THIS}:index_reward"
    assert result["reward_function"] == f"{THIS}:fixed_reward" and len(result["reward_source_sha256"]) == 64
    for it in result["iterations"]:
        k = it["rollout_id"]
        batch, _ = store.read(RUN, k)
        rows = _rows(batch)
        expected = [i for i, r in enumerate(rows) if changed(r)]
        assert expected and [c["row"] for c in it["changed"]] == expected
        assert all(c["raw_reward_before"] == 0.0 and c["raw_reward"] == 1.0 for c in it["changed"])
        # the run's estimator (grpo) over the new rewards, per group
        new_raw = [1.0 if changed(r) else r["raw_reward"] for r in rows]
        new_adv = postprocess_rewards(
            new_raw, batch["group_index"], cfg.advantage_estimator, cfg.grpo_std_normalization
        )
        moved = {m["row"]: m["advantage_delta"] for m in it["advantages_moved"]}
        groups = {rows[i]["group_index"] for i in expected}
        assert set(moved) == {i for i, r in enumerate(rows) if r["group_index"] in groups}
        for i, delta in moved.items():
            assert delta == pytest.approx(new_adv[i] - batch["advantage"][i])
        # checkpoints at rollout ids >= k were trained on batch k
        assert [p.rsplit("/", 1)[-1] for p in it["checkpoints"]] == [f"rollout_{j:06d}" for j in (0, 1) if j >= k]
        assert it["weight_versions_from"] == k + 2


def test_the_new_rewards_are_stored_beside_the_batch_and_replay_reads_them(stored_run):
    from vime_core.rescore import rescore_run
    from vime_core.storage import rescored

    cfg, store = stored_run
    before = {k: store.read(RUN, k) for k in (0, 1)}
    rescore_run(cfg.storage_uri, RUN, f"{THIS}:fixed_reward", rollout_ids=[1])
    assert {k: store.read(RUN, k) for k in (0, 1)} == before  # the stored batches are untouched
    location = store.location
    assert rescored.resolve_version(location, RUN, 1, "rescored") == 2
    assert rescored.resolve_version(location, RUN, 0, "rescored") is None  # never re-scored: its own rewards
    assert rescored.resolve_version(location, RUN, 1, "stored") is None
    with pytest.raises(rescored.RescoreError, match="rollout 0 of run 'rs' is not in that re-scoring"):
        rescored.resolve_version(location, RUN, 0, "v2")
    batch, lineage = before[1]
    table = rescored.read_table(location, RUN, 2, 1, lineage["checksum"])
    replayed = rescored.apply_rescored(batch, table)
    rows = _rows(batch)
    assert replayed["raw_reward"] == [1.0 if changed(r) else r["raw_reward"] for r in rows]
    assert replayed["advantage"] == postprocess_rewards(
        replayed["raw_reward"], batch["group_index"], cfg.advantage_estimator, cfg.grpo_std_normalization
    )
    assert replayed["tokens"] == batch["tokens"] and replayed["rollout_log_probs"] == batch["rollout_log_probs"]
    with pytest.raises(rescored.RescoreError, match="scored from another batch"):
        rescored.read_table(location, RUN, 2, 1, "0" * 64)
    assert rescore_run(cfg.storage_uri, RUN, f"{THIS}:fixed_reward", rollout_ids=[0])["version"] == 3
    assert list(rescored.versions(location, RUN)) == [2, 3]


def test_a_new_function_that_fails_masks_those_samples(stored_run):
    from vime_core.rescore import rescore_run
    from vime_core.storage import rescored

    cfg, store = stored_run
    result = rescore_run(cfg.storage_uri, RUN, f"{THIS}:raises_on_index_3", rollout_ids=[0])
    (it,) = result["iterations"]
    batch, lineage = store.read(RUN, 0)
    assert [c["row"] for c in it["changed"]] == [i for i, r in enumerate(_rows(batch)) if r["index"] == 3]
    assert all(c["status"] == "failed" for c in it["changed"])
    table = rescored.read_table(store.location, RUN, result["version"], 0, lineage["checksum"])
    replayed = rescored.apply_rescored(batch, table)
    assert all(sum(m) == 0 for m, i in zip(replayed["loss_mask"], batch["index"]) if i == 3)
    assert table.column("reward_error_type").to_pylist().count("ValueError") == len(it["changed"])


def test_vime_rescore_prints_the_blast_radius_without_reward_values(stored_run, capsys):
    from flows.cli import cmd_rescore

    cfg, store = stored_run
    assert (
        cmd_rescore(["--storage-uri", cfg.storage_uri, "--run", RUN, "--custom-rm-path", f"{THIS}:fixed_reward"]) == 0
    )
    out = capsys.readouterr().out
    batch, _ = store.read(RUN, 0)
    n = sum(changed(r) for r in _rows(batch))
    assert f"rollout 0: {n} of {len(batch['index'])} samples changed reward" in out
    assert "trained into checkpoints rollout_000000, rollout_000001" in out
    assert f"--run-name {RUN}-rescored-v2 --source-run {RUN} " in out and "--rollout-ids 0 1 --rewards v2" in out
    assert "raw_reward" not in out
    args = ["--storage-uri", cfg.storage_uri, "--run", RUN, "--custom-rm-path", f"{THIS}:fixed_reward"]
    assert cmd_rescore([*args, "--rollout-ids", "7"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rollout-ids [7]: run 'rs' has no stored batch" in err
