"""One step off-policy (`async_staleness` 1): what the step plan decides, which started rollout
answers a request, the configuration's refusals, and the staleness an iteration records."""

import pytest

from vime_core.config.loader import ConfigError, make_config
from vime_core.data.batch import weight_version_range
from vime_core.rollout.manager import usable_prefetch
from vime_core.step_plan import iteration_record, plan_step


def _cfg(**kw):
    return make_config({"run_name": "p", "num_rollout": 10, "device": "cpu", "use_tis": True, **kw})


def test_the_plan_starts_the_next_rollout_at_the_sync_even_when_an_evaluation_is_due():
    plan = plan_step(_cfg(async_staleness=1, rollout_prefetch=False, eval_interval=4), 3)
    assert plan.off_policy and plan.eval_due
    assert plan.sync_starts_next(next_stored=False) == 4 and not plan.flow_starts_next(False)
    assert plan.sync_starts_next(next_stored=True) is None  # a stored batch 4 is replayed
    assert plan_step(_cfg(async_staleness=1), 9).sync_starts_next(False) is None  # the last starts nothing
    on_policy = plan_step(_cfg(rollout_prefetch=True, eval_interval=4), 3)
    assert not on_policy.off_policy and on_policy.sync_starts_next(False) is None and on_policy.flow_starts_next(False)


@pytest.mark.parametrize(
    "started, asked, staleness, usable",
    [
        ((4, 5), (4, 5), 0, True),
        ((4, 4), (4, 5), 0, False),  # on-policy: one version behind is discarded
        ((4, 4), (4, 5), 1, True),
        ((4, 3), (4, 5), 1, False),  # two behind: beyond the bound
        ((4, 6), (4, 5), 1, False),  # ahead of what is asked: not this iteration's
        ((3, 5), (4, 5), 1, False),  # another rollout
        ((4, None), (4, None), 1, True),
        ((4, None), (4, 5), 1, False),
    ],
)
def test_a_started_rollout_answers_only_its_id_within_the_staleness_bound(started, asked, staleness, usable):
    assert usable_prefetch(*started, *asked, staleness) is usable


def test_the_configuration_refuses_sleeping_engines_and_an_uncorrected_lag():
    with pytest.raises(ConfigError, match="async_staleness=1 needs engines that stay awake"):
        _cfg(async_staleness=1, device="cuda", offload_rollout=True)
    with pytest.raises(ConfigError, match="add --use-tis"):
        make_config({"run_name": "p", "device": "cpu", "async_staleness": 1})
    assert make_config({"run_name": "p", "device": "cpu", "async_staleness": 1, "use_rollout_logprobs": True})
    with pytest.raises(ConfigError, match="async_staleness"):
        _cfg(async_staleness=2)  # one step is what the flow implements


def test_the_record_says_how_far_the_oldest_sampled_token_lags_the_trainer():
    batch = {
        "weight_versions": [
            [{"version": 4, "start": 0, "end": 3}, {"version": 5, "start": 3, "end": 9}],
            [{"version": 5, "start": 0, "end": 2}],
        ]
    }
    versions = weight_version_range(batch)
    assert versions == {"weight_version_min": 4, "weight_version_max": 5}
    assert weight_version_range({"weight_versions": [[], []]}) == {}
    plan = plan_step(_cfg(async_staleness=1), 4)  # trains on weights v5
    record = iteration_record(plan, {f"rollout/{k}": v for k, v in versions.items()}, False, {}, 1.0)
    assert record["staleness"] == plan.version - 4 == 1
    assert "staleness" not in iteration_record(plan, {}, False, {}, 1.0)
