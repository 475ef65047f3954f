"""LoRA runs survive faults and resume exactly, on real actors (a Ray head, one vLLM CPU engine
behind vllm-router, one Megatron actor, Prefect), in both publish modes (`lora_publish`: the
merged weights W + s B A, or only the adapter, which the engine serves as `vime-lora-v<N>`).

One run per mode is shared by the module: 4 iterations with a checkpoint after rollouts 1 and 3,
the engine's vLLM server SIGKILLed as rollout 1 starts. The replacement engine gets the
trainer's current weights (the adapter, in adapter mode) before it serves, so the run keeps the
invariants of test_faults._check_run: one trainable batch per rollout id, sampled by that
iteration's weights (its adapter); one optimizer step per rollout id; the engine scores the
probe as the trainer after every publish (the suite runs adapter mode). Then the same run name is run again from the
checkpoint of rollout 1 (the last one set aside): it trains the stored batches of rollouts 2-3
again, and its adapters and their Adam state end bit for bit as the first run's, whose trainer
was never interrupted.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal

import pytest
import torch
from tests.integration.flows.test_faults import _check_run, _engine_server_pid, _handles, _raw_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

RANK = 4
NUM_ROLLOUT = 4
SAVE_INTERVAL = NUM_ROLLOUT // 2  # checkpoints after rollouts 1 and 3 (the last)
KILLED_ROLLOUT = 1  # the engine's vLLM server dies as this rollout starts


def _config(store, model, ray_address, mode: str):
    from tests.integration.small_run import small_run_config

    return small_run_config(
        run_name=f"lora-faults-{mode}",
        storage_uri=str(store),
        hf_checkpoint=str(model),
        ray_address=ray_address,
        num_rollout=NUM_ROLLOUT,
        save_interval=SAVE_INTERVAL,
        check_weight_update_equal=True,
        # rollout k starts in its rollout task, where the kill lands, in both modes (adapter mode
        # with the weight check prefetches nothing anyway: step_plan.probe_alone)
        rollout_prefetch=False,
        iteration_retry_delay_s=0.5,
        lora_rank=RANK,
        lora_alpha=8.0,
        lora_publish=mode,
        export_hf=False,  # the PEFT adapter alone, as a run whose merged copy would fill the disk
    )


def _trained_state(actor) -> tuple[dict, dict]:
    """On the trainer actor: its adapters (the trained parameters, and the whole tensors under
    PEFT names) and every tensor of its optimizer's state, keyed by (chained part, param group,
    parameter index, state key), copied."""
    from vime_core.trainer.lora import lora_hf_state

    self = actor.trainer  # TrainerActor's MegatronTrainer
    adapters = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
    adapters.update({n: t.detach().clone() for n, t in lora_hf_state(self.model, self.arch).items()})
    state = {}
    for i, part in enumerate(getattr(self.optimizer, "chained_optimizers", [self.optimizer])):
        inner = part.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        state[f"{i}.{g}.{j}.{key}"] = value.detach().clone()
    return adapters, state


def _trainer_snapshot(cfg) -> tuple[dict, dict, dict]:
    import ray

    _, trainers = _handles(cfg)
    adapters, optimizer = ray.get(trainers.actors[0].__ray_call__.remote(_trained_state))
    return adapters, optimizer, trainers.rank0("state")


def _served_adapters(cfg) -> dict:
    import ray

    from vime_core.engines.adapters import served_adapters
    from vime_core.engines.client import EngineClient

    manager, _ = _handles(cfg)
    [url] = ray.get(manager.engine_urls.remote())
    token = ray.get(manager.engine_token.remote())

    async def listed() -> dict:
        async with EngineClient(url, token=token) as client:
            return await served_adapters(client)

    return asyncio.run(listed())


# both publish modes: adapter's restart takes its own publish path; merged sends the merged weights
# bucket by bucket (DeferredTensor), checked against the engine after every publish
@pytest.fixture(scope="module", params=["adapter", "merged"])
def lora_killed_engine(request, tmp_path_factory, ray_head, tiny_model_dir):
    """The run, trained to its end while its engine's vLLM server is SIGKILLed as rollout 1
    starts; checked (test_faults._check_run) and read (the engine's adapters, the trainer's
    adapters and optimizer state) as it ended, then torn down. Yields (configuration, summary,
    what was read)."""
    import tasks.rollout as rollout_task
    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from vime_core.utils.processes import pid_alive

    cfg = _config(tmp_path_factory.mktemp("store"), tiny_model_dir, ray_head, request.param)
    real = rollout_task.rollout.fn
    killed: list[int] = []

    @functools.wraps(real)
    def kill_the_engine_as_rollout_starts(config, rollout_id, version=None):
        if rollout_id == KILLED_ROLLOUT and not killed:
            pid = _engine_server_pid(config)
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            killed.append(pid)
        return real(config, rollout_id, version)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rollout_task.rollout, "fn", kill_the_engine_as_rollout_starts)
            mp.setattr(rollout_task.rollout, "retry_delay_seconds", 0)
            summary = train(cfg)
        assert killed and not pid_alive(killed[0])
        read = {
            "records": _check_run(cfg, cfg.num_rollout),
            "raw_records": _raw_records(cfg),
            "server_pid": _engine_server_pid(cfg),
            "killed_pid": killed[0],
            "served_adapters": _served_adapters(cfg),
            "trainer": _trainer_snapshot(cfg),
        }
    finally:
        teardown(cfg.run_name)
    yield cfg, summary, read


def test_a_killed_engine_is_replaced_and_serves_the_current_lora_weights(lora_killed_engine):
    from vime_core.engines.adapters import adapter_name
    from vime_core.storage.layout import run_dir

    cfg, summary, read = lora_killed_engine
    assert read["server_pid"] != read["killed_pid"]  # a new vLLM server
    assert summary["iterations"] == cfg.num_rollout
    # --no-export-hf: no merged HF folder, and the adapter's PEFT folder all the same
    assert summary["hf_export"] is None
    assert not os.path.exists(run_dir(cfg.storage_uri, cfg.run_name, "exports"))
    assert os.path.isfile(os.path.join(summary["peft_adapter"], "adapter_config.json"))
    final = cfg.num_rollout + 1
    _, _, state = read["trainer"]
    assert state["weight_version"] == final
    records = read["records"]
    # rollout 1 was generated after the kill, so by the restarted engine, which held the
    # trainer's weights of version 2 (the adapter vime-lora-v2) before serving: _check_run
    # found its samples generated by version 2
    assert [r["from_store"] for r in records] == [False] * cfg.num_rollout
    # every publish sent what the mode says, and the engine scored the probe as the trainer
    # (_check_run), the restarted one's first (the sync of the killed rollout) included
    transport = {"adapter": "adapter"}.get(cfg.lora_publish)
    if transport:
        assert [r["publish_transport"] for r in records] == [transport] * cfg.num_rollout
        # the restarted engine serves the current version's adapter (and none older than the one before)
        served = read["served_adapters"]
        assert adapter_name(final) in served, served
        assert set(served) <= {adapter_name(final - 1), adapter_name(final)}, served
    else:
        assert read["served_adapters"] == {}  # merged weights: the engine's own, no adapter
        assert all(r["publish_transport"] != "adapter" for r in records), records


def test_a_resumed_lora_run_ends_bit_for_bit_as_the_uninterrupted_one(lora_killed_engine):
    """The same run name again, from the checkpoint of rollout 1 (the one of rollout 3 set
    aside): the trainer restores its adapters, their Adam state and the RNGs, trains the stored
    batches of rollouts 2 and 3, and ends with the adapters and the optimizer state of the run
    that trained 0-3 without a stop."""
    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from vime_core.trainer.checkpoint import checkpoint_dir, latest_checkpoint

    cfg, _, read = lora_killed_engine
    want_adapters, want_optimizer, want_state = read["trainer"]
    last = checkpoint_dir(cfg, cfg.num_rollout - 1)
    assert latest_checkpoint(cfg) == last
    shutil.rmtree(last)
    assert latest_checkpoint(cfg) == checkpoint_dir(cfg, SAVE_INTERVAL - 1)
    raw_before = len(_raw_records(cfg))
    try:
        summary = train(cfg)
        got_adapters, got_optimizer, got_state = _trainer_snapshot(cfg)
        _check_run(cfg, cfg.num_rollout)
    finally:
        teardown(cfg.run_name)
    assert summary["failed_attempts"] == {}
    again = _raw_records(cfg)[raw_before:]
    assert [(r["rollout_id"], r["from_store"]) for r in again] == [(k, True) for k in range(SAVE_INTERVAL, NUM_ROLLOUT)]
    for key in ("last_trained_rollout_id", "optimizer_steps", "weight_version"):
        assert got_state[key] == want_state[key], key

    assert got_adapters.keys() == want_adapters.keys()
    b = [t for n, t in want_adapters.items() if n.endswith(".lora_B.weight")]
    assert b and all(t.abs().max() > 0 for t in b)  # trained: B starts at zero
    for name, tensor in want_adapters.items():
        assert torch.equal(got_adapters[name], tensor), name
    # Adam's two moments for every trained tensor (the adapters' A and B alone), equal bit for bit
    trained = [n for n in want_adapters if not n.endswith(".weight")]
    assert trained and all(n.endswith((".A", ".B")) for n in trained), trained
    moments = [k for k in want_optimizer if k.endswith(".exp_avg")]
    assert len(moments) == len([k for k in want_optimizer if k.endswith(".exp_avg_sq")]) == len(trained)
    assert got_optimizer.keys() == want_optimizer.keys()
    for key, tensor in want_optimizer.items():
        assert torch.equal(got_optimizer[key], tensor), key
