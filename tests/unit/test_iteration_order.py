"""The order of one iteration's phases is flows/iteration.py's, read top to bottom: the flow's
function runs here with every task replaced by a stub that records its task's name (a Phase of
vime_core/step_plan.py), on a CPU run (engines awake: training and the publish submitted
to Ray right after the rollout) and a colocated GPU run (engines and trainer sleep). A change
of the order, or of what the flow submits ahead, fails here first."""

import pytest

import flows.iteration as it
from tasks.rollout import persist as persist_task
from vime_core.config import VimeConfig
from vime_core.config.loader import make_config
from vime_core.step_plan import Phase

TASKS = [
    "rollout",
    "offload_rollout",
    "train",
    "offload_train",
    "onload_weights",
    "sync",
    "onload_kv",
    "check_weights",
    "evaluate",
    "save_checkpoint",
    "start_next_rollout",
    "report_iteration",
]


class _Done:
    def wait(self):
        pass

    def result(self):
        return {}


class _Out:
    batch_ref, metrics, from_store, next_stored = "batch", {}, False, False


def _run(monkeypatch, rollout_id: int = 4, **overrides) -> list[str]:
    calls: list[str] = []

    def stub(name, returns):
        def called(*args, **kwargs):
            calls.append(name)
            return returns

        called.submit = lambda *a, **kw: calls.append(name) or _Done()
        return called

    for attr in TASKS:
        name = getattr(it, attr).name
        assert name in set(Phase), f"{attr}'s task name {name!r} is not a Phase"
        monkeypatch.setattr(it, attr, stub(name, _Out() if name == Phase.ROLLOUT else {}))
    # persist, with the configuration's retries (tasks/rollout.persist_for)
    persist = stub(Phase(persist_task.name), {})

    def persist_for(config):
        assert isinstance(config, VimeConfig), type(config)  # the retries are read from it
        return persist

    monkeypatch.setattr(it, "persist_for", persist_for)
    # training and the publish, submitted to Ray by the flow ahead of the train and sync tasks
    monkeypatch.setattr(it, "train_then_publish", stub("train_then_publish", None))
    monkeypatch.setattr(it.interrupt, "reinstall", lambda: None)
    cfg = make_config({"run_name": "order", "num_rollout": 10, **overrides})
    it.iteration.fn(cfg, rollout_id)
    return calls


def test_cpu_iteration_order(monkeypatch):
    calls = _run(monkeypatch, device="cpu", rollout_prefetch=True, eval_interval=5, save_interval=5)
    assert calls == [
        "rollout",
        "train_then_publish",
        "persist",
        "train",
        "sync",
        "eval",
        "save",
        "start-next-rollout",
        "report",
    ]


def test_colocated_gpu_iteration_order(monkeypatch):
    calls = _run(
        monkeypatch,
        device="cuda",
        offload_rollout=True,
        offload_train=True,
        check_weight_update_equal=True,
        eval_interval=5,
        save_interval=5,
    )
    assert calls == [
        "rollout",
        "persist",
        "offload-rollout",
        "train",
        "offload-train",
        "onload-weights",
        "sync",
        "onload-kv",
        "check-weights",
        "eval",
        "save",
        "report",
    ]


@pytest.mark.parametrize("rollout_id, last_sync", [(4, []), (9, ["sync", "check-weights"])])
def test_one_step_off_policy_iteration_order(monkeypatch, rollout_id, last_sync):
    """async_staleness 1: the sync (which starts rollout k + 1) before training on k; the last
    iteration (9 of 10) publishes what it trained too."""
    calls = _run(
        monkeypatch,
        rollout_id,
        device="cpu",
        async_staleness=1,
        use_tis=True,
        check_weight_update_equal=True,
        eval_interval=5,
        save_interval=5,
    )
    assert calls == ["rollout", "sync", "check-weights", "persist", "train", *last_sync, "eval", "save", "report"]


@pytest.mark.parametrize("phase", list(Phase))
def test_every_phase_names_a_task(phase):
    import tasks.checkpoint
    import tasks.evaluate
    import tasks.offload
    import tasks.report
    import tasks.rollout
    import tasks.sync
    import tasks.train

    names = {
        getattr(obj, "name", None)
        for mod in (
            tasks.checkpoint,
            tasks.evaluate,
            tasks.offload,
            tasks.report,
            tasks.rollout,
            tasks.sync,
            tasks.train,
        )
        for obj in vars(mod).values()
    }
    assert phase in names
