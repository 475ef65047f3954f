"""The step's protocol (vime_core/step_plan.py): which phases run where, when prefetch,
eval and save happen, and how the phases' results become the iteration record."""

from vime_core.config.loader import make_config
from vime_core.step_plan import Phase, due, iteration_record, plan_step


def _cfg(**kw):
    return make_config({"run_name": "p", "num_rollout": 10, **kw})


def test_cpu_runs_no_engine_moves_and_prefetches():
    plan = plan_step(_cfg(device="cpu", rollout_prefetch=True, save_interval=4), 3)
    assert (plan.engines_sleep, plan.trainer_sleeps) == (False, False)
    assert plan.version == 4 and plan.next_version == 5
    assert plan.save_due and not plan.last
    assert plan.sync_starts_next(next_stored=False) == 4
    assert plan.sync_starts_next(next_stored=True) is None  # a stored batch 4 is replayed, not generated


def test_gpu_colocated_sleeps_both_sides_and_never_prefetches():
    plan = plan_step(_cfg(device="cuda", offload_rollout=True, offload_train=True, rollout_prefetch=True), 0)
    assert plan.engines_sleep and plan.trainer_sleeps
    assert plan.sync_starts_next(False) is None and not plan.flow_starts_next(False)


def test_gpu_without_offload_train_keeps_the_trainer_awake():
    plan = plan_step(_cfg(device="cuda", offload_rollout=True, offload_train=False), 0)
    assert plan.engines_sleep and not plan.trainer_sleeps


def test_eval_due_moves_the_prefetch_after_the_evaluation():
    plan = plan_step(_cfg(device="cpu", rollout_prefetch=True, eval_interval=5), 4)
    assert plan.eval_due
    assert plan.sync_starts_next(False) is None and plan.flow_starts_next(False)


def test_last_rollout_saves_evaluates_draws_and_starts_nothing():
    plan = plan_step(_cfg(device="cpu", rollout_prefetch=True, eval_interval=3, save_interval=None), 9)
    assert plan.last and plan.save_due and plan.eval_due and plan.draw_curve
    assert not plan.flow_starts_next(False) and plan.sync_starts_next(False) is None


def test_due_every_interval_and_on_the_last():
    assert [k for k in range(10) if due(4, k, 9)] == [3, 7, 9]
    assert [k for k in range(10) if due(None, k, 9)] == [9]


def test_record_from_the_phases_results():
    plan = plan_step(_cfg(device="cuda", save_interval=1), 2)
    done = {
        Phase.TRAIN: {
            "loss": 0.5,
            "pg_clipfrac": 0.1,
            "wake_time_s": 0.2,
            "memory_after_wake": [{"allocated_bytes": 9}],
            "memory_after_train": [{"allocated_bytes": 8, "peak_allocated_bytes": 11}],
            "per_rank": [1],
        },
        Phase.PERSIST: {"t_persist": 0.3, "key": "batches/p/2"},
        Phase.OFFLOAD_ROLLOUT: {"seconds": 0.1, "memory": [{"process_bytes": 1}]},
        Phase.OFFLOAD_TRAIN: {"seconds": 0.4},
        Phase.ONLOAD_WEIGHTS: {"seconds": 0.05},
        Phase.ONLOAD_KV: {"seconds": 0.07},
        Phase.SYNC: {
            "seconds": {"gather": 0.01, "transfer": 0.2, "total": 0.25},
            "transport_seconds": {"pack": 0.1},
            "transport": "adapter",
            "bytes": 1234,
            "t_sync": 0.3,
            "trainer_memory_after_publish": [{"allocated_bytes": 1}],
        },
        Phase.CHECK_WEIGHTS: {"max_abs_diff": 0.01},
        Phase.SAVE: {"path": "ckpt/2", "t_save": 4.5},
    }
    rec = iteration_record(
        plan, {"rollout/reward_mean": 0.7, "rollout/time_build_s": 0.02, "rollout/hist": [1]}, False, done, 9.0
    )
    assert (rec["version_before"], rec["version_after"]) == (3, 4)
    assert rec["reward_mean"] == 0.7 and "hist" not in rec and rec["t_build"] == 0.02
    assert rec["train_loss"] == 0.5 and rec["clip_fraction"] == 0.1 and "per_rank" not in rec
    assert rec["t_offload"] == 0.5 and abs(rec["t_onload"] - 0.12) < 1e-12 and rec["publish_s"] == 0.25
    assert rec["publish_phases_s"] == {"gather": 0.01, "transfer": 0.2} and rec["publish_transport_s"] == {"pack": 0.1}
    assert rec["publish_transport"] == "adapter" and rec["publish_bytes"] == 1234
    assert rec["memory"]["engines_after_offload_rollout"] == [{"process_bytes": 1}]
    assert rec["memory"]["trainer_after_train"] == [{"allocated_bytes": 8, "peak_allocated_bytes": 11}]
    assert rec["weight_check"] == {"max_abs_diff": 0.01} and rec["checkpoint"] == "ckpt/2" and rec["t_step"] == 9.0
    assert "eval_reward_mean" not in rec
    assert rec["t_save"] == 4.5 and rec["t_eval"] == 0.0  # the periodic phases, apart from T_step's terms


def test_bootstrap_publishes_to_engines_at_another_version_or_woken_from_sleep():
    from tasks.bootstrap import publish_needed

    assert publish_needed(3, [], engines_woken=False)  # no engine answered: the first publish
    assert publish_needed(3, [3, 2], engines_woken=False)
    assert not publish_needed(3, [3, 3], engines_woken=False)
    # asleep at level 2 the engine still says v3, but its weights were dropped
    assert publish_needed(3, [3, 3], engines_woken=True)


def test_no_save_checkpoints_saves_nothing_not_even_the_last():
    cfg = _cfg(device="cpu", save_interval=2, save_checkpoints=False)
    assert [k for k in range(10) if plan_step(cfg, k).save_due] == []
    assert [k for k in range(10) if plan_step(_cfg(device="cpu", save_interval=2), k).save_due] == [1, 3, 5, 7, 9]
