"""End to end: the train flow on real actors (Ray head, one vLLM CPU engine behind vllm-router,
one Megatron actor), then what a user does with the run: read its batches and lineage, check
the engine's version and log-probs against the trainer, load the checkpoint and the HF export,
retry a failed task, re-run a killed iteration, and replay a stored batch bit for bit. The model
is given as a hub id (``--hf-checkpoint vime-test/tiny-qwen3``) resolved from a prepared HF cache.

One run is shared by the module (engines are slow to start). The tests run in any
order: those that read the run look at the train flow's three iterations (or at the state the
engines and the trainer agree on now), and each test that extends it runs the run's next
iteration, whichever ran before (3, 4 and 5 in file order).
"""

from __future__ import annotations


import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

# canary credentials in the run's configuration (the `trained` fixture)
CANARIES = ("pw-canary-7f3a", "key-canary-19bd", "hf-canary-c2e0")
RUN_STARTED = __import__("time").time()

# vLLM's CPU build computes in the model's dtype (fp32 here) with its own kernels; the
# max |trainer - engine| log-prob difference on the tiny model stays well below this bound.
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def hub_model_id(tmp_path_factory, tiny_model_dir):
    """The tiny model as the hub id ``vime-test/tiny-qwen3``, from a prepared HF cache (offline):
    the run resolves it to the snapshot folder when it starts (vime_core/models/hub.py)."""
    import os

    from tests.unit.test_hub_checkpoint import cache_snapshot

    cache = tmp_path_factory.mktemp("hf-hub")
    cache_snapshot(cache, "vime-test/tiny-qwen3", tiny_model_dir)
    saved = {key: os.environ.get(key) for key in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    yield "vime-test/tiny-qwen3"
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_head, hub_model_id):
    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from tests.integration.small_run import small_run_config

    cfg = small_run_config(
        run_name="e2e-flows",
        storage_uri=str(tmp_path_factory.mktemp("store")),
        hf_checkpoint=hub_model_id,  # a hub id, from the prepared cache
        ray_address=ray_head,
        num_rollout=3,
        save_interval=1,
        check_weight_update_equal=True,
        # credentials a user may put in fields (unused by this run: rm_type is the demo's; vLLM
        # takes --hf-token and, offline, never uses it): no file, batch, log or Prefect record
        # of the run may hold them (test_no_credential_reaches_what_the_run_leaves)
        rm_url=f"https://bob:{CANARIES[0]}@rm.invalid/score?api_key={CANARIES[1]}",
        vllm_extra_args=["--hf-token", CANARIES[2]],
    )
    summary = train(cfg)
    yield cfg, summary
    teardown(cfg.run_name)


def _handles(cfg):
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach

    ensure_ray(cfg.ray_address)
    return attach(cfg)


def _next_rollout_id(trainers) -> int:
    """The rollout id the run goes on with: 3 after the train flow, one more for every test that
    has extended the run since."""
    return trainers.rank0("state")["last_trained_rollout_id"] + 1


def test_three_batches_stored_with_lineage(trained):
    from vime_core.config import config_hash
    from vime_core.run_assets import resolve_run_config
    from vime_core.storage import BatchStore

    cfg, summary = trained
    store = BatchStore(cfg.storage_uri)
    assert summary["iterations"] == cfg.num_rollout
    for k in range(cfg.num_rollout):
        batch, lineage = store.read(cfg.run_name, k)
        assert len(batch["tokens"]) == cfg.rollout_batch_size * cfg.n_samples_per_prompt
        assert int(lineage["rollout_id"]) == k and lineage["run"] == cfg.run_name
        assert lineage["config_hash"] == config_hash(resolve_run_config(cfg))
        # the hub id ran from its cached snapshot folder
        assert lineage["model_id"] == resolve_run_config(cfg).hf_checkpoint and "/snapshots/" in lineage["model_id"]
        versions = {span["version"] for spans in batch["weight_versions"] for span in spans}
        assert versions == {k + 1}, f"batch {k} was sampled by weights {versions}, expected v{k + 1}"


def test_each_iteration_flow_run_logs_its_console_and_ledger_lines(trained):
    """The UI's page of an iteration flow run holds its story: the report task's console line and
    ledger line reach Prefect's API at INFO, while the console stays at PREFECT_LOGGING_LEVEL."""
    import asyncio
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    cfg, _ = trained

    async def lines_by_rollout() -> dict[int, list[str]]:
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="iter-")))
            ours = {r.id: r.parameters["rollout_id"] for r in runs if cfg.run_name in str(r.parameters)}
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(ours))))
        out: dict[int, list[str]] = {}
        for entry in logs:
            out.setdefault(ours[entry.flow_run_id], []).append(entry.message)
        return out

    deadline = time.monotonic() + 30  # Prefect sends logs in batches from a background thread
    while True:
        lines = asyncio.run(lines_by_rollout())
        found = {k: v for k, v in lines.items() if k in (0, 1, 2)}
        done = all(
            any(m.startswith(f"iter {k:3d} ") for m in found.get(k, []))
            and any(m.startswith(f"ledger {k}:") for m in found.get(k, []))
            for k in (0, 1, 2)
        )
        if done or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert done, {k: [m[:60] for m in v] for k, v in lines.items()}


def test_every_publish_is_checked_against_the_trainer(trained):
    """check_weight_update_equal: after each publish the engine scores the probe as the trainer
    does, and its scores moved since the previous version (the update arrived)."""
    from vime_core.report.records import read_records

    cfg, _ = trained
    records = read_records(cfg.storage_uri, cfg.run_name)
    checks = [r["weight_check"] for r in records if r["rollout_id"] < cfg.num_rollout]  # the train flow's
    assert [c["version"] for c in checks] == [k + 2 for k in range(cfg.num_rollout)]
    assert all(c["max_abs_diff"] < LOGPROB_TOLERANCE for c in checks), checks
    assert all(c["changed_max"] > LOGPROB_TOLERANCE for c in checks[1:]), checks


def test_engine_reports_version_4(trained):
    import ray

    from vime_core.report.records import read_records

    cfg, _ = trained
    manager, trainers = _handles(cfg)
    # v1 after bootstrap, one more per iteration: the train flow went 1 -> 4 (the spec's 1 -> 4)
    records = read_records(cfg.storage_uri, cfg.run_name)[: cfg.num_rollout]
    assert [(r["version_before"], r["version_after"]) for r in records] == [(1, 2), (2, 3), (3, 4)]
    # the engine reports what the trainer published last: 4, or one more per iteration a test added
    final = 1 + _next_rollout_id(trainers)
    assert ray.get(manager.weight_versions.remote()) == [final]
    assert trainers.rank0("state")["weight_version"] == final


def test_sync_to_the_version_the_engines_hold_publishes_nothing(trained):
    from tasks.sync import sync

    cfg, _ = trained
    _, trainers = _handles(cfg)
    final = 1 + _next_rollout_id(trainers)  # 4 after the train flow
    out = sync(cfg, final)  # a task run of its own, outside any flow
    assert out["skipped"] is True and out["started_rollout"] is False
    assert trainers.rank0("state")["weight_version"] == final


def test_sync_whose_publish_fails_changes_nothing_and_starts_no_rollout(trained, monkeypatch):
    """The chained end_sync does not run when a rank's publish fails: the task fails, engines
    and trainer keep their version, and the rollout it was to start is not started."""
    import ray

    import tasks.sync as sync_task

    cfg, _ = trained
    manager, trainers = _handles(cfg)
    next_id = _next_rollout_id(trainers)  # 3 after the train flow
    final = 1 + next_id
    real = sync_task.run_handles

    class PublishToNoEngine:  # publish_weights refuses an empty engine list
        def __init__(self, group):
            self.group = group

        def call_async(self, method, urls, version):
            return self.group.call_async(method, [], version)

        def wait(self, refs):
            return self.group.wait(refs)

    monkeypatch.setattr(sync_task, "run_handles", lambda c: (real(c)[0], PublishToNoEngine(real(c)[1])))
    monkeypatch.setattr(sync_task.sync, "retry_delay_seconds", 0)
    with pytest.raises(Exception, match="engine_urls is empty"):
        sync_task.sync(cfg, final + 1, start_rollout_id=next_id)
    assert ray.get(manager.weight_versions.remote()) == [final]
    assert trainers.rank0("state")["weight_version"] == final
    assert ray.get(manager.prefetched.remote()) is None


def test_trainer_and_engine_logprobs_agree(trained):
    import ray

    from vime_core.engines.client import EngineClient, run_blocking

    cfg, _ = trained
    manager, trainers = _handles(cfg)
    url = ray.get(manager.engine_urls.remote())[0]
    token = ray.get(manager.engine_token.remote())  # a later driver asks the run's actors for it
    prompt = [6, 13, 7, 15]  # "3+4="

    async def generate():
        async with EngineClient(url, "e2e", token=token) as client:
            return await client.generate(prompt, {"max_tokens": 4, "temperature": 1.0, "logprobs": 0, "seed": 3})

    out = run_blocking(generate)
    choice = out["choices"][0]
    response = list(choice["token_ids"])
    engine_lp = [c["logprob"] for c in choice["logprobs"]["content"]]
    batch = {
        "tokens": [prompt + response],
        "response_length": [len(response)],
        "total_length": [len(prompt) + len(response)],
        "loss_mask": [[1] * len(response)],
    }
    trainer_lp = trainers.rank0("compute_log_probs", batch)[0]
    diff = max(abs(a - b) for a, b in zip(trainer_lp, engine_lp))
    assert len(trainer_lp) == len(engine_lp) and diff < LOGPROB_TOLERANCE, diff


def test_checkpoint_and_hf_export_load_in_transformers(trained):
    import torch
    from transformers import AutoModelForCausalLM

    from vime_core.trainer.checkpoint import latest_checkpoint

    cfg, summary = trained
    assert latest_checkpoint(cfg) is not None
    model = AutoModelForCausalLM.from_pretrained(summary["hf_export"])
    logits = model(torch.tensor([[6, 13, 7, 15]])).logits
    assert torch.isfinite(logits).all()


def test_failed_task_is_retried_and_trains_once(trained, monkeypatch):
    """train-k (the run's next iteration, 3 in file order) fails after the trainer trained;
    Prefect retries it; no second optimizer step."""
    import tasks.train as train_task
    from flows.iteration import iteration

    cfg, _ = trained
    _, trainers = _handles(cfg)
    k = _next_rollout_id(trainers)
    cfg_k = cfg.model_copy(update={"num_rollout": k + 1})
    steps_before = trainers.rank0("state")["optimizer_steps"]
    real = train_task.run_handles
    failures = {"left": 1}

    class FailAfterTrain:
        def __init__(self, group):
            self.group = group

        def _fail_once(self, result):
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("injected failure after training")
            return result

        def call(self, method, *args):  # a retry calls the trainer afresh
            return self._fail_once(self.group.call(method, *args))

        def wait(self, refs):  # the first try waits for the training the flow submitted
            return self._fail_once(self.group.wait(refs))

    monkeypatch.setattr(train_task, "run_handles", lambda c: (real(c)[0], FailAfterTrain(real(c)[1])))
    record = iteration(cfg_k, k)
    assert failures["left"] == 0
    assert trainers.rank0("state")["last_trained_rollout_id"] == k
    assert trainers.rank0("state")["optimizer_steps"] == steps_before + cfg_k.num_steps_per_rollout
    assert record["version_after"] == k + 2  # rollout 3 samples v4 and trains it into v5


def test_killed_iteration_resumes_from_stored_batch(trained, monkeypatch):
    import tasks.train as train_task
    from flows.iteration import iteration
    from vime_core.storage import BatchStore

    cfg, _ = trained
    k = _next_rollout_id(_handles(cfg)[1])  # 4 in file order
    cfg_k = cfg.model_copy(update={"num_rollout": k + 1})

    def killed(c):  # every try of train-k dies: the iteration fails after persisting
        raise RuntimeError(f"simulated crash during train-{k}")

    monkeypatch.setattr(train_task, "run_handles", killed)
    with pytest.raises(RuntimeError, match=f"simulated crash during train-{k}"):
        iteration(cfg_k, k)
    assert BatchStore(cfg.storage_uri).exists(cfg.run_name, k)
    monkeypatch.undo()
    record = iteration(cfg_k, k)
    assert record["from_store"] is True and record["version_after"] == k + 2  # rollout 4: v5 -> v6


def test_store_failing_beside_training_is_rerun_with_the_batch_trained_on(trained, monkeypatch):
    """persist-k (5 in file order) fails on every try while train-k trains beside it: the iteration fails and no
    rollout is started on the weights trained on the unstored batch; the re-run stores the very
    batch the trainer trained on (the RolloutManager hands it out again) and does not train a
    second time."""
    import ray

    from flows.iteration import iteration
    from vime_core.cluster import batch_io
    from vime_core.storage import BatchStore

    cfg, _ = trained
    manager, trainers = _handles(cfg)
    k = _next_rollout_id(trainers)
    # not the last iteration (sync would start rollout k + 1); persist's every retry, without waiting
    retries_now = [0.0] * len(cfg.persist_retry_delays_s)
    cfg_k = cfg.model_copy(update={"num_rollout": k + 2, "persist_retry_delays_s": retries_now})

    def store_down(*args, **kwargs):
        raise OSError("simulated object store outage")

    monkeypatch.setattr(batch_io, "save", store_down)
    with pytest.raises(OSError, match="simulated object store outage"):
        iteration(cfg_k, k)
    assert not BatchStore(cfg.storage_uri).exists(cfg.run_name, k)
    assert trainers.rank0("state")["last_trained_rollout_id"] == k
    steps = trainers.rank0("state")["optimizer_steps"]
    assert ray.get(manager.prefetched.remote()) is None  # rollout k + 1 not started
    monkeypatch.undo()
    record = iteration(cfg_k, k)
    assert record["reused"] == 1.0 and not record["from_store"]
    assert BatchStore(cfg.storage_uri).exists(cfg.run_name, k)
    assert trainers.rank0("state")["optimizer_steps"] == steps  # not trained again
    assert record["version_after"] == k + 2
    assert ray.get(manager.prefetched.remote()) == (k + 1, k + 2)  # the re-run's sync started it
    ray.get(manager.discard_prefetch.remote())


def test_replay_is_bit_identical(trained):
    """Batch 2 replayed on checkpoint 1 gives checkpoint 2's weights exactly."""
    from flows.replay import replay
    from vime_core.trainer.checkpoint import checkpoint_dir, load_rank_state

    def load_model_tensors(path):
        return load_rank_state(path, 0, 1, 1)["model"]

    cfg, _ = trained
    replay_cfg = cfg.model_copy(update={"run_name": "e2e-replay"})
    try:
        out = replay(replay_cfg, source_run=cfg.run_name, checkpoint=checkpoint_dir(cfg, 1), rollout_ids=[2])
        original = load_model_tensors(checkpoint_dir(cfg, 2))
        replayed = load_model_tensors(out["checkpoint"])
        assert original.keys() == replayed.keys()
        different = [k for k in original if hasattr(original[k], "shape") and not (original[k] == replayed[k]).all()]
        assert not different, f"replayed weights differ in {different[:5]}"
    finally:
        from vime_core.cluster.run_actors import teardown

        teardown(replay_cfg.run_name)


def test_no_credential_reaches_what_the_run_leaves(trained):
    """Every file under the run's storage (config.json, batches and their Arrow metadata, the
    index, checkpoints, reports, the export), the engine logs written since the run started, and
    Prefect's records of the run (flow-run parameters, log lines) hold none of the canaries put
    in rm_url and vllm_extra_args; the live configuration still has them."""
    import asyncio
    import json
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    from vime_core.engines.server import REPO_ROOT

    cfg, _ = trained
    assert cfg.vllm_extra_args[1] == CANARIES[2]
    files = [p for p in Path(cfg.storage_uri).rglob("*") if p.is_file()]
    files += [p for p in (REPO_ROOT / ".cache" / "engine-logs").glob("*.log") if p.stat().st_mtime >= RUN_STARTED]
    assert any(p.suffix == ".parquet" for p in files) and any(p.name == "config.json" for p in files)
    for path in files:
        blob = path.read_bytes()
        for canary in CANARIES:
            assert canary.encode() not in blob, f"{canary} in {path}"

    async def prefect_records() -> str:
        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=cfg.run_name))
            )
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs]))
            )
            return json.dumps([r.parameters for r in runs], default=str) + "\n".join(entry.message for entry in logs)

    records = asyncio.run(prefect_records())
    assert "rm.invalid" in records  # the parameters were read: the URL is there, its credentials are not
    for canary in CANARIES:
        assert canary not in records, f"{canary} in Prefect's records of the run"
