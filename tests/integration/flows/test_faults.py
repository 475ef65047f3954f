"""A run survives its processes being killed, on real actors: a Ray head, one vLLM CPU
engine behind vllm-router, one Megatron actor, Prefect.

One run is shared by the module (engines are slow to start). The run the module's
fixture makes (the first case below) is checked when it ends; each test after it takes the run
on from wherever it stands, so the tests run in any order:
- the trainer actor's process is SIGKILLed as train-3 starts (training was submitted after the
  rollout: the trainer is training rollout 3 or has just trained it, and what it trained since
  its checkpoint is lost either way): the train flow retries the iteration, bootstrap rebuilds
  the trainer from the checkpoint of rollout 1, and rollouts 2-3 are trained again from their
  stored batches;
- the trainer refuses a batch (a data error): the iteration is not retried and the error says so;
- the driver (`vime train`) is SIGKILLed inside each phase in turn (rollout, persist, train, sync,
  checkpoint), each time resumed by the same command, then stopped by SIGTERM (a scheduler's
  preemption: exit 143 within the grace period, no task retried); the same command finishes the run.
  The first killed driver and the stopped one run Prefect's temporary server in their process
  group (killed or signalled with them, on one user's Prefect home); the others talk to a server
  that outlives them (`session_prefect_api`), as drivers of a Prefect server do;
- within one `vime train`, the trainer's process, the RolloutManager's process and the vLLM
  server are SIGKILLed as chosen phases start: the run goes on, and its console says so in one
  line per fault, without a traceback.
A kill lands in its phase because the driver pauses as that phase's task run starts
(vime_core/faults.PausePoints, off unless VIME_FAULT_PAUSE_AT is set).
After each: every rollout id has one trainable batch, the optimizer made one step per rollout id,
and the engines hold the trainer's weights after every sync.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tests.integration.flows.test_train_flow import LOGPROB_TOLERANCE  # vLLM CPU vs the trainer, fp32

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]


KILLED_ROLLOUT = 3  # the trainer dies while this rollout trains; the checkpoint is of rollout 1


def _config(store, model, ray_address, **over):
    from tests.integration.small_run import small_run_config

    base = dict(
        run_name="fault-kill",
        storage_uri=str(store),
        hf_checkpoint=str(model),
        ray_address=ray_address,
        num_rollout=5,
        save_interval=2,  # checkpoints of rollouts 1, 3 and the last
        check_weight_update_equal=True,  # every record then says whether engines == trainer
        iteration_retry_delay_s=0.5,
    )
    return small_run_config(**{**base, **over})


def _handles(cfg):
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach

    ensure_ray(cfg.ray_address)
    return attach(cfg)


def _trainer_pid(trainers) -> int:
    import ray

    return ray.get(trainers.actors[0].__ray_call__.remote(lambda self: os.getpid()))


def _raw_records(cfg) -> list[dict]:
    """Every record metrics.jsonl holds, in the order written (read_records keeps the last per id)."""
    from vime_core.report.records import run_dir

    with open(f"{run_dir(cfg.storage_uri, cfg.run_name)}/metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def killed_trainer(tmp_path_factory, ray_head, tiny_model_dir):
    """The run, trained to the end while its trainer's process is SIGKILLed during train-3."""
    import tasks.train as train_task
    from flows.train import train
    from vime_core.cluster.run_actors import teardown

    cfg = _config(tmp_path_factory.mktemp("store"), tiny_model_dir, ray_head)
    real = train_task.train.fn
    seen = {"pid": None, "killed": False}

    @functools.wraps(real)
    def kill_during_train_3(config, rollout_id, batch_ref, submitted=None):
        if rollout_id == KILLED_ROLLOUT and not seen["killed"]:
            # training was submitted after the rollout: the trainer is training or has just trained
            os.kill(seen["pid"], signal.SIGKILL)
            seen["killed"] = True
        out = real(config, rollout_id, batch_ref, submitted)
        if seen["pid"] is None:  # asked while the trainer is idle: a call waits behind training
            seen["pid"] = _trainer_pid(_handles(config)[1])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_task.train, "fn", kill_during_train_3)
        mp.setattr(train_task.train, "retry_delay_seconds", 0)
        summary = train(cfg)
    assert seen["killed"]
    # the run as it ended, before any test takes it further (the tests run in any order)
    _check_run(cfg, cfg.num_rollout)
    summary["raw_records"] = _raw_records(cfg)
    yield cfg, summary, seen["pid"]
    teardown(cfg.run_name)


def _check_run(cfg, num_rollout: int, resumed: frozenset = frozenset()) -> list[dict]:
    """The invariants of a finished run: one trainable batch per rollout id, sampled by the
    weights of that iteration; one optimizer step per rollout id; engines == trainer after every
    sync. `resumed`: iterations run again after a driver died, whose sync may have found the
    engines already at its version (it then publishes and checks nothing). Returns the records
    (the last per rollout id)."""
    import ray

    from vime_core.data.validation import validate_trainable
    from vime_core.report.records import read_records
    from vime_core.storage import BatchStore

    store = BatchStore(cfg.storage_uri)
    assert [b.rollout_id for b in store.list_batches(cfg.run_name)] == list(range(num_rollout))
    assert store.quarantined(cfg.run_name) == []
    for k in range(num_rollout):
        batch, lineage = store.read(cfg.run_name, k)  # checksum verified
        assert validate_trainable(batch) == cfg.rollout_batch_size * cfg.n_samples_per_prompt
        versions = {span["version"] for spans in batch["weight_versions"] for span in spans}
        assert versions == {k + 1}, f"batch {k} was sampled by weights {versions}, expected v{k + 1}"

    manager, trainers = _handles(cfg)
    state = trainers.rank0("state")
    assert state["last_trained_rollout_id"] == num_rollout - 1
    assert state["optimizer_steps"] == num_rollout * cfg.num_steps_per_rollout
    assert state["weight_version"] == num_rollout + 1
    assert ray.get(manager.weight_versions.remote()) == [num_rollout + 1]

    records = read_records(cfg.storage_uri, cfg.run_name)
    assert [r["rollout_id"] for r in records] == list(range(num_rollout))
    for r in records:
        if "weight_check" not in r and r["rollout_id"] in resumed:
            continue
        check = r["weight_check"]  # the engine scores the probe as the trainer that published it
        assert check["version"] == r["rollout_id"] + 2 and check["max_abs_diff"] < LOGPROB_TOLERANCE, r
    return records


def test_killed_trainer_is_rebuilt_and_the_run_continues_exactly(killed_trainer):
    cfg, summary, old_pid = killed_trainer
    _, trainers = _handles(cfg)
    assert _trainer_pid(trainers) != old_pid  # a new process
    assert summary["failed_attempts"] == {KILLED_ROLLOUT: 1}  # and _check_run held as the run ended

    raw = summary["raw_records"]
    # the dead trainer finished 0-2; the rebuilt one (checkpoint of rollout 1) trained 2, 3, 4
    assert [r["rollout_id"] for r in raw] == [0, 1, 2, 2, 3, 4]
    first, again = raw[2], raw[3]
    assert again["from_store"] is True and raw[4]["from_store"] is True
    # the same checkpoint and the same stored batch give the same training step, bit for bit
    for key in ("train_loss", "grad_norm", "lr"):
        if key in first:
            assert again[key] == first[key], (key, first[key], again[key])


def test_a_data_error_is_not_retried_and_says_what_to_fix(killed_trainer):
    """The trainer refuses the batch of the run's next rollout (5 in file order; a response of
    length 0): the iteration runs once, the train flow fails with one line naming the error and
    what to do, and nothing moved."""
    import ray

    import flows.iteration as iteration_flow
    import flows.train as train_flow
    import tasks.train as train_task
    from tasks.rollout import RolloutOutput
    from vime_core.storage import BatchStore

    cfg, _, _ = killed_trainer
    _, trainers = _handles(cfg)
    before = trainers.rank0("state")
    k = before["last_trained_rollout_id"] + 1
    cfg_k = cfg.model_copy(update={"num_rollout": k + 1})
    batch, _ = BatchStore(cfg.storage_uri).read(cfg.run_name, k - 1)
    batch["response_length"][0] = 0
    bad = ray.put(batch)
    attempts = []
    real_iteration = train_flow.iteration

    def rollout_giving_an_untrainable_batch(config, rollout_id, version=None):
        return RolloutOutput(bad, {}, from_store=True, storage_key="untrainable")

    def counted(config, rollout_id):
        attempts.append(rollout_id)
        return real_iteration(config, rollout_id)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(iteration_flow, "rollout", rollout_giving_an_untrainable_batch)
        mp.setattr(train_flow, "iteration", counted)
        mp.setattr(train_task.train, "retry_delay_seconds", 0)
        with pytest.raises(train_flow.IterationFailedError) as info:
            train_flow.train(cfg_k)
    assert attempts == [k]
    message = str(info.value)
    assert message.startswith(f"iteration {k} failed: sample 0"), message
    assert "response_length=0" in message and "(UntrainableBatchError)" in message
    assert "a configuration or data error, not retried; fix it" in message and "\n" not in message
    after = trainers.rank0("state")
    assert (after["last_trained_rollout_id"], after["optimizer_steps"]) == (
        before["last_trained_rollout_id"],
        before["optimizer_steps"],
    )
    assert not BatchStore(cfg.storage_uri).exists(cfg.run_name, k)


def _vime_train(
    cfg, repo_root, prefect_home, log_path, pause_at=(), pause_dir=None, prefect_api: str = ""
) -> subprocess.Popen:
    """`vime train` for the run, in its own session (a SIGKILL to it takes its temporary Prefect
    server too); `pause_at`: task runs it pauses at (vime_core/faults.PausePoints), announcing in
    `pause_dir`; `prefect_api`: the Prefect server it talks to (PREFECT_API_URL), else a
    temporary one of its own."""
    from vime_core.demo.settings import DEMO_SETTINGS
    from vime_core.faults import PAUSE_AT_ENV, PAUSE_DIR_ENV

    args = [sys.executable, "-m", "flows.cli", "train"]
    # the tiny model named by its folder: the demo's settings come as flags too
    for name in dict.fromkeys(
        (
            "run_name",
            "storage_uri",
            "hf_checkpoint",
            "ray_address",
            "num_rollout",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "micro_batch_size",
            "save_interval",
            "vllm_server_concurrency",
            "iteration_retry_delay_s",
            *DEMO_SETTINGS,
        )
    ):
        args += [f"--{name.replace('_', '-')}", str(getattr(cfg, name))]
    args.append("--check-weight-update-equal")
    env = {k: v for k, v in os.environ.items() if k not in (PAUSE_AT_ENV, PAUSE_DIR_ENV, "PREFECT_API_URL")}
    env["PREFECT_HOME"] = str(prefect_home)
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    if pause_at:
        env.update({PAUSE_AT_ENV: ",".join(pause_at), PAUSE_DIR_ENV: str(pause_dir)})
    # what a user's terminal shows, stdout and stderr apart
    out, err = open(log_path, "w"), open(_stderr_path(log_path), "w")
    return subprocess.Popen(args, cwd=repo_root, env=env, stdout=out, stderr=err, start_new_session=True)


def _stderr_path(log_path):
    return log_path.with_suffix(".stderr")


def _tail(log_path, chars: int = 5000) -> str:
    return f"stdout: {log_path.read_text()[-chars:]}\nstderr: {_stderr_path(log_path).read_text()[-chars:]}"


def _wait_paused(driver: subprocess.Popen, announced, log_path, timeout_s: float = 600) -> None:
    """Until the driver announces that it paused where asked (it is then inside that phase)."""
    deadline = time.monotonic() + timeout_s
    while not announced.exists():
        assert driver.poll() is None, f"the driver ended before {announced.name}:\n{_tail(log_path)}"
        assert time.monotonic() < deadline, f"the driver did not reach {announced.name}:\n{_tail(log_path)}"
        time.sleep(0.1)
    assert announced.read_text() == str(driver.pid)


def _stored_ids_whole(cfg) -> list[int]:
    """What a reader of the store sees: the published rollout ids, each whole (checksum against
    the object and the index); every batch object, published or not, is a whole table."""
    from vime_core.storage import BatchStore
    from vime_core.storage.store import verify_table

    store = BatchStore(cfg.storage_uri)
    ids = [b.rollout_id for b in store.list_batches(cfg.run_name)]
    for k in ids:
        store.read(cfg.run_name, k)
    for key in store.location.list_keys(f"batches/{cfg.run_name}"):
        verify_table(store.location.get(key), key)
    return ids


def test_driver_killed_in_each_phase_resumes_with_the_same_command(
    killed_trainer, repo_root, tmp_path, new_prefect_home, session_prefect_api
):
    """`vime train` SIGKILLed (with everything it started) inside each phase of the step, one
    phase per driver, each driver the same command resuming after the one before, then one
    stopped by SIGTERM; the last runs the run to its end. Each kill lands in its phase: the
    driver pauses as that phase's task run starts (vime_core/faults.PausePoints) and is killed
    there. The first killed driver and the stopped one run their own temporary Prefect server
    (module docstring)."""
    from vime_core.step_plan import due, version_before

    cfg, _, _ = killed_trainer
    first = len(_stored_ids_whole(cfg))  # the earlier tests stored 0 .. first-1
    rollout_k, persist_k, train_k, sync_k = range(first, first + 4)
    save_k = next(k for k in range(sync_k + 1, sync_k + 1 + cfg.save_interval) if due(cfg.save_interval, k, -1))
    kills = [
        f"rollout-{rollout_k}",
        f"persist-{persist_k}",
        f"train-{train_k}",
        f"sync-v{version_before(sync_k) + 1}",
        f"save-{save_k}",
    ]
    term_k = save_k + 1  # a driver stopped by SIGTERM (a scheduler's preemption) once past train-term_k's start
    run = cfg.model_copy(
        update={"num_rollout": term_k + 3}
    )  # the SIGTERM lands, as a rule, before the last iteration ends
    raw_before = len(_raw_records(cfg))
    trainer_pid = _trainer_pid(_handles(run)[1])
    pause_dir = tmp_path / "paused"
    pause_dir.mkdir()
    prefect_home = new_prefect_home(tmp_path / "prefect")  # every driver's, as one user's
    for i, at in enumerate(kills):
        log = tmp_path / f"driver-{i}.log"
        api = "" if i == 0 else session_prefect_api  # the first one's temporary server dies with it
        driver = _vime_train(run, repo_root, prefect_home, log, pause_at=[at], pause_dir=pause_dir, prefect_api=api)
        try:
            _wait_paused(driver, pause_dir / at, log)
        finally:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        stored = _stored_ids_whole(run)
        assert stored == list(range(len(stored))), (at, stored)  # nothing partial, no gap

    # SIGTERM to the driver's process group (with its Prefect server) 0.5 s after it went on from
    # train-term_k's start. Training was submitted right after the rollout, so on the tiny model the
    # driver may be an iteration further by then; the iteration it lands in is the first one not
    # reported. The driver retries nothing and exits 143 within the grace period
    # (vime_core/utils/interrupt.py).
    from vime_core.utils.interrupt import GRACE_S

    at, log = f"train-{term_k}", tmp_path / "sigterm.log"
    driver = _vime_train(run, repo_root, prefect_home, log, pause_at=[at], pause_dir=pause_dir)
    try:
        _wait_paused(driver, pause_dir / at, log)
        (pause_dir / at).unlink()  # the train task goes on into its call to the trainer
        time.sleep(0.5)
        t0 = time.monotonic()
        os.killpg(driver.pid, signal.SIGTERM)
        try:
            rc = driver.wait(timeout=GRACE_S + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver outlived its grace period after SIGTERM:\n{_tail(log)}")
        elapsed = time.monotonic() - t0
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    console = log.read_text() + _stderr_path(log).read_text()
    assert rc == 143 and elapsed < GRACE_S + 5, (rc, elapsed, _tail(log))
    assert f"--run-name {run.run_name} to resume" in console, _tail(log)
    assert "; try 2 of" not in console and " - Retry " not in console, _tail(log)  # no task retried after the signal
    stored = _stored_ids_whole(run)
    assert stored == list(range(len(stored))), stored
    stopped_k = max(r["rollout_id"] for r in _raw_records(cfg)) + 1  # the iteration the SIGTERM stopped
    assert term_k <= stopped_k <= run.num_rollout, (term_k, stopped_k)  # num_rollout: after the last one

    log = tmp_path / "last.log"
    rc = _vime_train(run, repo_root, prefect_home, log, prefect_api=session_prefect_api).wait(timeout=900)
    assert rc == 0, _tail(log)
    killed_ids = frozenset(range(rollout_k, stopped_k + 1))
    _check_run(run, run.num_rollout, resumed=killed_ids)
    # each killed iteration ended before its report: the next driver ran it again, once
    assert [r["rollout_id"] for r in _raw_records(cfg)][raw_before:] == list(range(first, run.num_rollout))
    assert _trainer_pid(_handles(run)[1]) == trainer_pid  # the actors outlived every driver


def _engine_server_pid(cfg) -> int:
    """The pid of engine 0's vLLM server (a process of its own, started by the engine actor)."""
    import ray

    from vime_core.cluster import names
    from vime_core.cluster.run_actors import _get_actor

    engine = _get_actor(names.engine(0), cfg.run_name)
    return ray.get(engine.__ray_call__.remote(lambda self: self._proc.pid))


def _manager_pid(cfg) -> int:
    import ray

    return ray.get(_handles(cfg)[0].__ray_call__.remote(lambda self: os.getpid()))


def _kill_manager_noting_its_router(cfg, routers: list) -> None:
    import psutil

    manager = psutil.Process(_manager_pid(cfg))
    routers += [p for p in manager.children(recursive=True) if "vllm-router" in " ".join(p.cmdline())]
    manager.kill()


def test_killed_trainer_manager_and_engine_within_one_driver(
    killed_trainer, repo_root, tmp_path, new_prefect_home, session_prefect_api
):
    """One `vime train` goes on while, each as a phase starts (the driver paused there), the
    trainer's process, the RolloutManager's process and the vLLM server are SIGKILLed: the run
    ends with every invariant held, and the console says what happened and what the run does in
    one line per fault, without a traceback."""
    cfg, _, _ = killed_trainer
    first = len(_stored_ids_whole(cfg))
    trainer_k, manager_k, engine_k = range(first, first + 3)
    run = cfg.model_copy(update={"num_rollout": engine_k + 2})
    raw_before = len(_raw_records(cfg))
    routers: list = []  # the killed RolloutManager's vllm-router processes
    faults = {
        f"train-{trainer_k}": lambda: os.kill(_trainer_pid(_handles(run)[1]), signal.SIGKILL),
        f"rollout-{manager_k}": lambda: _kill_manager_noting_its_router(run, routers),
        f"rollout-{engine_k}": lambda: os.killpg(os.getpgid(_engine_server_pid(run)), signal.SIGKILL),
    }
    pause_dir = tmp_path / "paused"
    pause_dir.mkdir()
    prefect_home = new_prefect_home(tmp_path / "prefect")  # every driver's, as one user's
    log = tmp_path / "driver.log"
    driver = _vime_train(
        run, repo_root, prefect_home, log, pause_at=list(faults), pause_dir=pause_dir, prefect_api=session_prefect_api
    )
    try:
        for at, harm in faults.items():
            _wait_paused(driver, pause_dir / at, log)
            harm()
            (pause_dir / at).unlink()  # the driver goes on
        rc = driver.wait(timeout=900)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert rc == 0, _tail(log)
    # the router the killed RolloutManager had started went with it (vime_core/utils/orphan_guard.py)
    from vime_core.utils.processes import pid_alive

    assert routers and not [p for p in routers if pid_alive(p.pid)], routers
    _check_run(run, run.num_rollout, resumed=frozenset(range(first)))  # the ids before: checked by the tests before
    # an iteration that failed ended before its report: each rollout id reported once
    assert [r["rollout_id"] for r in _raw_records(cfg)][raw_before:] == list(range(first, run.num_rollout))
    stdout = log.read_text()
    summary = json.loads(stdout[stdout.index('{\n  "run_name"') :])  # `vime train` prints it last
    assert {trainer_k, manager_k} <= set(map(int, summary["failed_attempts"])), summary["failed_attempts"]

    # the console: one line per fault saying what died and what the run does, no traceback
    console = _stderr_path(log).read_text()
    assert "Traceback" not in console and '\n  File "' not in console, console[-5000:]
    for k, died in ((trainer_k, "trainer-0 died"), (manager_k, "rollout-manager died")):
        said = [line for line in console.splitlines() if f"iteration {k} failed: {died}" in line]
        assert len(said) == 1 and "retrying in" in said[0], (k, said)
