"""The compute ledger (vime_core/ledger.py, vime_core/rollout/tokens.py): rollouts through the real
loop with the engine stubbed (tests/unit/test_rollout_loop.py's fake generator), each with a known
number of dropped, surplus, aborted, truncated, reward-failed, generate-failed and masked samples;
every count is computed here from the samples and groups, and generated = trained + discarded."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_rollout_loop import EOS, FakeGenerator, HealthyFake, make_state, run_loop
from vime_core.data.sample import Status
from vime_core.ledger import (
    CAUSES,
    ROLLOUT_TOKENS,
    PhaseDevices,
    flat,
    iteration_ledger,
    ledger_line,
    run_ledger,
)
from vime_core.step_plan import Phase, iteration_record, plan_step

pytestmark = pytest.mark.timeout(60)
THIS = __file__
NONZERO_STD = "vime_core.rewards.filters:check_reward_nonzero_std"
RESPONSE = (5, EOS)  # the fake engine's answer: 2 tokens


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def make_cfg(tiny_model_dir, tmp_path):
    """test_rollout_loop.py's configuration: 4 groups of 4 samples of the embedded task."""
    from vime_core.config import make_config
    from vime_core.demo.task import write_dataset

    data = write_dataset(tmp_path / "arith.jsonl")
    base = {
        "hf_checkpoint": str(tiny_model_dir),
        "prompt_data": str(data),
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 4,
        "rollout_max_prompt_len": 16,
        "rollout_max_response_len": 8,
        "rm_type": "arith",
        "vllm_server_concurrency": 8,
    }
    return lambda **overrides: make_config({**base, **overrides})


def constant_for_even_groups(sample) -> float:
    return 1.0 if sample.group_index % 2 == 0 else float(sample.index % 2)


def index_reward(sample) -> float:
    return float(sample.index % 2)


def fails_on_index_0(sample) -> float:
    if sample.index == 0:
        raise ValueError("broken on purpose")
    return float(sample.index % 2)


def balanced(tokens: dict) -> bool:
    return tokens["generated"] == tokens["trainable"] + sum(tokens["discarded"].values())


def test_filter_drops_are_counted_by_their_tokens(make_cfg, tokenizer):
    cfg = make_cfg(
        custom_rm_path=f"{THIS}:constant_for_even_groups",
        over_sampling_batch_size=1,
        dynamic_sampling_filter_path=NONZERO_STD,
    )
    samples, metrics = run_loop(make_state(cfg, tokenizer, FakeGenerator(response=RESPONSE)))
    tokens = metrics[ROLLOUT_TOKENS]
    per_group = cfg.n_samples_per_prompt * len(RESPONSE)
    dropped, submitted = int(metrics["rollout/dropped_groups"]), int(metrics["rollout/submitted_groups"])
    assert dropped > 0
    assert tokens["discarded"]["filter"] == dropped * per_group
    assert tokens["trainable"] == sum(s.response_length for s in samples) == cfg.rollout_batch_size * per_group
    assert tokens["generated"] == submitted * per_group == metrics["rollout/output_tokens"]
    assert balanced(tokens)


def test_over_sampling_surplus_and_aborted_requests(make_cfg, tokenizer):
    # 4 groups submitted for 2: one of the three fast ones finishes after the batch is full
    cfg = make_cfg(rollout_batch_size=2, over_sampling_batch_size=4, custom_rm_path=f"{THIS}:index_reward")
    slow = {3}  # never finishes on its own: aborted, one token per sample
    gen = FakeGenerator(response=RESPONSE, slow=lambda session: int(session.split("-")[-2]) in slow)
    samples, metrics = run_loop(make_state(cfg, tokenizer, gen))
    tokens = metrics[ROLLOUT_TOKENS]
    per_group = cfg.n_samples_per_prompt * len(RESPONSE)
    fast = cfg.over_sampling_batch_size - len(slow)
    assert metrics["rollout/aborted_count"] == len(slow) * cfg.n_samples_per_prompt
    assert tokens["discarded"]["aborted"] == len(slow) * cfg.n_samples_per_prompt * 1  # the fake's abort: 1 token
    assert tokens["discarded"]["surplus"] == (fast - cfg.rollout_batch_size) * per_group
    assert tokens["trainable"] == sum(sum(s.loss_mask) for s in samples) == cfg.rollout_batch_size * per_group
    assert balanced(tokens)


def test_partial_rollout_counts_only_this_rollouts_tokens_of_a_continued_sample(make_cfg, tokenizer):
    cfg = make_cfg(
        rollout_batch_size=2, over_sampling_batch_size=4, partial_rollout=True, custom_rm_path=f"{THIS}:index_reward"
    )
    state = make_state(cfg, tokenizer, FakeGenerator(slow=lambda s: int(s.split("-")[-2]) >= 2))
    run_loop(state)
    state.generator = FakeGenerator(response=RESPONSE, slow=lambda s: int(s.split("-")[-2]) >= 4)
    state.engines = [state.generator]
    samples, metrics = run_loop(state, 1)
    tokens = metrics[ROLLOUT_TOKENS]
    continued = [s for s in samples if s.group_index in (2, 3)]
    assert len(continued) == len(samples)  # the batch is the two continued groups
    # each continued sample holds 1 old token (masked, counted in rollout 0) and 2 new ones
    assert tokens["trainable"] == sum(s.response_length - 1 for s in continued) == len(continued) * len(RESPONSE)
    assert tokens["discarded"].get("masked", 0) == 0
    assert tokens["discarded"]["aborted"] == 2 * cfg.n_samples_per_prompt  # groups 4 and 5, one token each
    assert balanced(tokens)


def test_truncated_samples_are_trained_and_counted_apart(make_cfg, tokenizer):
    cfg = make_cfg(rollout_max_response_len=1, custom_rm_path=f"{THIS}:index_reward")
    samples, metrics = run_loop(make_state(cfg, tokenizer, FakeGenerator(response=RESPONSE)))
    tokens = metrics[ROLLOUT_TOKENS]
    truncated = [s for s in samples if s.status is Status.TRUNCATED]
    assert len(truncated) == len(samples)
    assert tokens["truncated"] == tokens["trainable"] == sum(s.response_length for s in truncated)
    assert balanced(tokens)


def test_reward_failures_are_discarded_tokens(make_cfg, tokenizer):
    cfg = make_cfg(custom_rm_path=f"{THIS}:fails_on_index_0")
    samples, metrics = run_loop(make_state(cfg, tokenizer, FakeGenerator(response=RESPONSE)))
    tokens = metrics[ROLLOUT_TOKENS]
    failed = [s for s in samples if s.status is Status.FAILED]
    assert len(failed) == cfg.rollout_batch_size
    assert tokens["discarded"]["reward_failed"] == sum(s.response_length for s in failed)
    assert tokens["trainable"] == sum(s.response_length for s in samples if s.status is not Status.FAILED)
    assert balanced(tokens)


def test_generate_failures_count_the_tokens_of_the_failed_try(make_cfg, tokenizer):
    from vime_core.rollout.generate import fail_sample, generate_sample

    cfg = make_cfg(rollout_group_max_attempts=2, over_sampling_batch_size=1)
    state = make_state(cfg, tokenizer, HealthyFake(response=RESPONSE))

    async def generate_then_fail_group_1(ctx, sample, params):
        await generate_sample(ctx, sample, params)
        if sample.group_index == 1:  # tokens came, then the connection broke: the try is lost
            fail_sample(sample, "connection reset", retryable=True)
        return sample

    state.generate_fn = generate_then_fail_group_1
    samples, metrics = run_loop(state)
    tokens = metrics[ROLLOUT_TOKENS]
    tries = int(metrics["rollout/retried_groups"] + metrics["rollout/failed_groups"])
    assert tries == 2  # generated again once, then dropped
    assert tokens["discarded"]["generate_failed"] == tries * cfg.n_samples_per_prompt * len(RESPONSE)
    assert balanced(tokens)


def test_tool_tokens_of_kept_samples_are_masked(make_cfg, tokenizer):
    from tests.unit.test_rollout_loop import tool_use_generate

    cfg = make_cfg(custom_rm_path=f"{THIS}:index_reward")
    state = make_state(cfg, tokenizer, FakeGenerator(response=(5, 6)))
    state.generate_fn = tool_use_generate
    samples, metrics = run_loop(state)
    tokens = metrics[ROLLOUT_TOKENS]
    assert tokens["discarded"]["masked"] == sum(s.loss_mask.count(0) for s in samples)
    assert tokens["trainable"] == sum(sum(s.loss_mask) for s in samples)
    assert balanced(tokens)


def test_a_discarded_prefetch_is_counted_stale_in_the_next_rollout():
    from vime_core.rollout.tokens import add_stale, generated_tokens

    dropped = {ROLLOUT_TOKENS: {"generated": 40, "trainable": 32, "truncated": 0, "discarded": {"filter": 8}}}
    taken = {ROLLOUT_TOKENS: {"generated": 24, "trainable": 24, "truncated": 0, "discarded": {}}}
    left = add_stale(taken, generated_tokens(dropped))
    assert left == 0
    assert taken[ROLLOUT_TOKENS]["discarded"]["stale"] == 40 and taken[ROLLOUT_TOKENS]["generated"] == 64
    assert balanced(taken[ROLLOUT_TOKENS])


# ---- the iteration's ledger -------------------------------------------------------------------


def _record(cfg, rollout_tokens, trained_tokens, times):
    plan = plan_step(cfg, 0)
    phases = {
        Phase.TRAIN: {"trained_tokens": trained_tokens, "t_train": times["t_train"]},
        Phase.PERSIST: {"t_persist": times["t_persist"]},
        Phase.SYNC: {"t_sync": times["t_sync"]},
        Phase.OFFLOAD_ROLLOUT: {"seconds": times["t_offload_rollout"]},
        Phase.ONLOAD_WEIGHTS: {"seconds": times["t_onload"]},
    }
    metrics = {ROLLOUT_TOKENS: rollout_tokens, "t_rollout": times["t_rollout"]}
    return iteration_record(plan, metrics, False, phases, times["t_step"])


TIMES = {
    "t_rollout": 3.0,
    "t_train": 2.0,
    "t_persist": 2.5,
    "t_sync": 0.5,
    "t_offload_rollout": 0.25,
    "t_onload": 0.125,
    "t_step": 7.0,
}


@pytest.mark.parametrize(
    "layout",
    [
        {"colocate": True, "actor_num_gpus_per_node": 4},
        {"colocate": False, "actor_num_gpus_per_node": 2, "rollout_num_gpus": 3},
    ],
)
def test_the_record_carries_the_ledger_with_device_seconds(layout):
    from vime_core.config.loader import make_config

    cfg = make_config({"run_name": "l", "num_rollout": 2, "device": "cuda", **layout})
    trainer = layout["actor_num_gpus_per_node"]
    engines = layout.get("rollout_num_gpus", trainer)
    run = trainer if layout["colocate"] else trainer + engines
    tokens = {"generated": 100, "trainable": 70, "truncated": 5, "discarded": {"filter": 20, "aborted": 10}}
    record = _record(cfg, tokens, 60, TIMES)  # one step of 10 trainable tokens skipped
    ledger = record["ledger"]
    assert ledger["tokens_generated"] == 100 and ledger["tokens_trained"] == 60
    assert ledger["tokens_discarded"]["skipped_steps"] == 10
    assert ledger["tokens_unaccounted"] == 0 and set(ledger["tokens_discarded"]) == set(CAUSES)
    assert ledger["useful_share"] == 60 / 100
    assert ledger["device_s"] == {
        "rollout": TIMES["t_rollout"] * engines,
        "train": TIMES["t_train"] * trainer,
        "sync": TIMES["t_sync"] * run,
        "offload": TIMES["t_offload_rollout"] * engines,
        "onload": TIMES["t_onload"] * engines,
        "persist": (TIMES["t_persist"] - TIMES["t_train"] - TIMES["t_offload_rollout"]) * run,
    }
    assert ledger["device_s_held"] == TIMES["t_step"] * run
    assert ledger["trained_tokens_per_device_s"] == 60 / (TIMES["t_step"] * run)
    line = ledger_line(0, ledger)
    assert ledger_line(0, json.loads(json.dumps(ledger, sort_keys=True))) == line  # as metrics.jsonl holds it
    assert "generated 100 tok, trained 60 (60.0%)" in line and "filter 20 aborted 10 skipped_steps 10" in line
    assert (
        flat(ledger)["tokens_discarded_filter"] == 20 and flat(ledger)["device_s_train"] == ledger["device_s"]["train"]
    )


def test_a_stored_batch_generated_nothing_and_has_no_useful_share():
    ledger = iteration_ledger(None, {"trained_tokens": 30, "t_step": 2.0, "t_train": 1.0}, PhaseDevices())
    assert ledger["tokens_generated"] == 0 and ledger["tokens_trained"] == 30 and ledger["useful_share"] is None
    assert ledger["tokens_discarded"]["skipped_steps"] == 0 and ledger["trained_tokens_per_device_s"] == 15.0


def test_the_run_ledger_sums_its_iterations():
    one = iteration_ledger(
        {"generated": 10, "trainable": 8, "discarded": {"filter": 2}},
        {"trained_tokens": 8, "t_step": 1.0},
        PhaseDevices(),
    )
    two = iteration_ledger(
        {"generated": 30, "trainable": 10, "discarded": {"surplus": 20}},
        {"trained_tokens": 10, "t_step": 3.0},
        PhaseDevices(),
    )
    total = run_ledger([one, two])
    assert total["tokens_generated"] == 40 and total["tokens_trained"] == 18 and total["useful_share"] == 18 / 40
    assert total["tokens_discarded"]["filter"] == 2 and total["tokens_discarded"]["surplus"] == 20
    assert total["trained_tokens_per_device_s"] == 18 / 4.0


def test_the_trainer_counts_the_loss_mask_of_applied_steps_only():
    from vime_core.trainer.rollout_training import trained_tokens

    masks = [[1, 1, 0], [1], [1, 1, 1, 1], [0, 1]]
    per_step = [{"skipped_steps": 0.0}, {"skipped_steps": 1.0}]  # the second step had a non-finite gradient
    assert trained_tokens(masks, per_step, 2) == sum(masks[0]) + sum(masks[1])
