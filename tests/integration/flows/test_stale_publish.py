"""A publish whose bytes do not change the engine's weights, in a whole run on real actors (a Ray
head, one vLLM CPU engine behind vllm-router, one Megatron actor, Prefect), with the weight check on.

As it publishes v3 (after training rollout 1), the trainer actor sends the weights of v2 again under
version 3: every control call succeeds and the engine reports v3, but its weights are v2's. The check
after that publish finds the engine's log-probs of the probe exactly as before while the trainer's
moved: the iteration fails (StaleEnginesError), the RolloutManager reports the engine at version 0, and
the iteration's retry (bootstrap first) publishes the trainer's real v3. The run must end as one
without the fault: every batch sampled by the weights of its iteration, one optimizer step per
rollout, the engines at the trainer's weights after every sync that published.
"""

from __future__ import annotations

import pytest

from tests.integration.flows.test_faults import _check_run, _handles, _raw_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

STALE_VERSION = 3  # published after rollout 1 trained


def _send_the_previous_weights_as(actor, version: int) -> None:
    """In the trainer actor's process: the publish of `version` (once) sends the weights the
    trainer held before its last training, those of the version before it. Armed in the actor
    before the rollout that leads to `version` trains (its calls run in the order submitted)."""
    import ray

    def arm(self):
        trainer = self.trainer
        train, publish, weights = trainer.train, trainer.publish, trainer.iter_hf_weights
        state = {"before_train": None, "stale": False, "done": False}

        def train_keeping_the_weights(*args, **kwargs):
            state["before_train"] = [(name, tensor.detach().clone()) for name, tensor in weights()]
            return train(*args, **kwargs)

        def iter_hf_weights(defer_merge=False):
            if state["stale"]:
                state["stale"] = False
                return iter(state["before_train"])
            return weights(defer_merge=defer_merge)

        def publish_once_stale(engine_urls, target_version=None, *after):
            if engine_urls is not None and target_version == version and not state["done"]:
                state["stale"] = state["done"] = True
            return publish(engine_urls, target_version, *after)

        trainer.train, trainer.iter_hf_weights, trainer.publish = (
            train_keeping_the_weights,
            iter_hf_weights,
            publish_once_stale,
        )

    ray.get(actor.__ray_call__.remote(arm))


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory, ray_head, tiny_model_dir):
    import functools

    import tasks.sync as sync_task
    import tasks.train as train_task
    from flows.train import train
    from tests.integration.small_run import small_run_config
    from vime_core.cluster.run_actors import teardown

    cfg = small_run_config(
        run_name="stale-publish",
        storage_uri=str(tmp_path_factory.mktemp("store")),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=4,
        check_weight_update_equal=True,
        iteration_retry_delay_s=0.5,
    )
    real = train_task.train.fn
    armed = {"done": False}

    @functools.wraps(real)
    def arm_first(config, rollout_id, batch_ref, submitted=None):
        if not armed["done"]:  # in the train task of rollout 0: queued before rollout 1 trains
            _send_the_previous_weights_as(_handles(config)[1].actors[0], STALE_VERSION)
            armed["done"] = True
        return real(config, rollout_id, batch_ref, submitted)

    check, failed_checks = sync_task.check_weights.fn, []

    @functools.wraps(check)
    def check_noting_failures(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except Exception as exc:
            failed_checks.append(exc)
            raise

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_task.train, "fn", arm_first)
        mp.setattr(sync_task.check_weights, "fn", check_noting_failures)
        summary = train(cfg)
    yield cfg, summary, failed_checks
    teardown(cfg.run_name)


def test_a_publish_that_did_not_reach_the_engine_is_caught_and_published_again(stale_run):
    from vime_core.utils.errors import StaleEnginesError

    cfg, summary, failed_checks = stale_run
    assert summary["failed_attempts"] == {STALE_VERSION - 2: 1}  # iteration 1 failed once: its check
    [failed] = failed_checks
    assert isinstance(failed, StaleEnginesError)
    assert str(failed).startswith(f"check weights v{STALE_VERSION}: engine(s) 0 scored the probe exactly as before")
    _check_run(cfg, cfg.num_rollout, resumed=frozenset({STALE_VERSION - 2}))
    raw = _raw_records(cfg)
    assert [r["rollout_id"] for r in raw] == list(range(cfg.num_rollout))  # the failed try wrote no record
    checks = [r["weight_check"] for r in raw if "weight_check" in r]
    assert all(not c.get("stale_engines") for c in checks), checks
