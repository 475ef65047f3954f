"""The rollout loop against two real vLLM servers (behind the real vllm-router or routed in-client).

The engine-kill test is last in this file on purpose: it leaves the killed engine restarted by
the health monitor, and `healthy_engines` re-checks before every test anyway.
"""

from __future__ import annotations

import statistics
import threading

import pytest

from tests.integration.rollout.conftest import hook, make_cfg
from vime_core.data.sample import Status
from vime_core.demo.task import reward as arith_reward

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def make_manager(healthy_engines, tiny_model_dir, vllm_python, arith_data, cache_dir):
    from vime_core.rollout.manager import RolloutManager

    made = []

    def make(**overrides):
        cfg = make_cfg(tiny_model_dir, vllm_python, arith_data, **overrides)
        manager = RolloutManager(cfg, servers=healthy_engines, log_dir=str(cache_dir / "engine-logs"))
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.shutdown()


def check_batch_shape(batch: dict, groups: int, n: int, log_probs: bool = False) -> None:
    """Rows, group order and lengths; `log_probs`: a flag asked for them (one per response token),
    else the samples carry none."""
    rows = groups * n
    assert all(len(col) == rows for col in batch.values()), {k: len(v) for k, v in batch.items()}
    group_ids = batch["group_index"]
    assert [group_ids[i * n] for i in range(groups)] == sorted(set(group_ids)), "groups are not contiguous"
    assert batch["index"] == [i % n for i in range(rows)]
    for i in range(rows):
        assert (
            batch["prompt_length"][i] + batch["response_length"][i]
            == batch["total_length"][i]
            == len(batch["tokens"][i])
        )
        assert len(batch["loss_mask"][i]) == batch["response_length"][i]
        assert len(batch["rollout_log_probs"][i]) == (batch["response_length"][i] if log_probs else 0)


def record_requests(manager) -> list[tuple[dict, object]]:
    """(sampling params, the engine's `logprobs` field) of every generate the rollouts send from now on."""
    seen: list[tuple[dict, object]] = []
    generator = manager.state.generator
    real = generator.generate

    async def generate(token_ids, sampling_params, session_id=None, request_id=None):
        answer = await real(token_ids, sampling_params, session_id=session_id, request_id=request_id)
        seen.append((dict(sampling_params), answer["choices"][0].get("logprobs")))
        return answer

    generator.generate = generate
    return seen


def test_prefetched_rollout_is_claimed_or_discarded_with_the_data_source_put_back(make_manager):
    manager = make_manager(router_policy="round_robin")
    before = manager.data_source_state()
    assert manager.start_generate(0, 1)
    assert not manager.start_generate(1, 1), "one prefetched rollout at a time"
    # a checkpoint taken while it is unclaimed records the state before it
    assert manager.data_source_state() == before
    batch, metrics = manager.generate(0, 1)
    assert metrics["rollout/prefetched"] == 1.0
    check_batch_shape(batch, 4, 4)
    after_first = manager.data_source_state()
    assert after_first != before
    # asked again for the same id and version (a re-run iteration whose batch was not stored):
    # the same batch, no new prompts drawn
    again, again_metrics = manager.generate(0, 1)
    assert again_metrics["rollout/reused"] == 1.0 and again["prompt_id"] == batch["prompt_id"]
    assert manager.data_source_state() == after_first

    # started at weights v2 but asked for at v3: waited for, data source put back, generated afresh
    assert manager.start_generate(1, 2)
    batch2, metrics2 = manager.generate(1, 3)
    assert "rollout/prefetched" not in metrics2
    # the afresh rollout drew the same prompts the discarded one had drawn: none skipped
    manager.load_data_source_state(after_first)
    batch3, _ = manager.generate(1)
    assert sorted(set(batch2["prompt_id"])) == sorted(set(batch3["prompt_id"]))
    assert set(batch2["prompt_id"]).isdisjoint(batch["prompt_id"])

    # sync's two actor calls: nothing to do at the engines' own version; otherwise admission
    # paused and the URLs returned, then resumed with rollout 2 started on the new weights
    current = manager.weight_versions()[0]
    assert manager.begin_sync(current) is None and manager.fleet.admission_open.is_set()
    assert manager.begin_sync(current + 1) == manager.engine_urls()
    assert not manager.fleet.admission_open.is_set()
    assert manager.end_sync(True, 2, current + 1) and manager.fleet.admission_open.is_set()
    _, metrics4 = manager.generate(2, current + 1)
    assert metrics4["rollout/prefetched"] == 1.0

    # a retried rollout task asking while its first try's call still runs gets that rollout,
    # not a second one (the trainer may already be training on the first)
    answers = []
    askers = [threading.Thread(target=lambda: answers.append(manager.generate(3, current + 1))) for _ in range(2)]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert answers[0][0]["prompt_id"] == answers[1][0]["prompt_id"]
    assert sorted(m.get("rollout/reused", 0.0) for _, m in answers) == [0.0, 1.0]


def test_full_loop_router_arith_reward(make_manager):
    # get_mismatch_metrics reads the engines' log-probs: asked for, one per token, none missing
    manager = make_manager(router_policy="consistent_hash", get_mismatch_metrics=True)
    requests = record_requests(manager)
    batch, metrics = manager.generate(0)
    check_batch_shape(batch, 4, 4, log_probs=True)
    assert requests and all(params["logprobs"] == 0 and len(sent["content"]) > 0 for params, sent in requests)
    assert set(batch["status"]) <= {"completed", "truncated"}
    for i, status in enumerate(batch["status"]):
        spans = batch["weight_versions"][i]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == batch["response_length"][i]
        assert all(-50.0 < lp <= 0.0 for lp in batch["rollout_log_probs"][i])
        assert batch["finish_reason"][i] == ("length" if status == "truncated" else "stop")
    # The rule-based reward recomputed from the returned tokens agrees with the loop's.
    tokenizer = manager.tokenizer
    for i in range(16):
        response_ids = batch["tokens"][i][batch["prompt_length"][i] :]
        if batch["finish_reason"][i] == "stop":
            assert response_ids[-1] == tokenizer.eos_token_id
            response_ids = response_ids[:-1]

        class Probe:
            finish_reason = batch["finish_reason"][i]
            response = tokenizer.decode(response_ids)
            label = str(sum(int(x) for x in batch["prompt_id"][i].split("-")[1:]))

        assert batch["raw_reward"][i] == arith_reward(Probe)
    lengths = batch["response_length"]
    assert metrics["rollout/response_len_mean"] == pytest.approx(statistics.fmean(lengths))
    assert metrics["rollout/response_len_max"] == max(lengths)
    assert metrics["rollout/truncated_rate"] == pytest.approx(batch["status"].count("truncated") / 16)
    assert metrics["rollout/output_tokens"] >= sum(lengths)
    assert metrics["rollout/generate_tokens_per_s"] > 0
    assert metrics["rollout/missing_logprob_count"] == 0


def test_filter_drops_all_equal_groups_and_oversampling_refills(make_manager):
    manager = make_manager(
        custom_rm_path=hook("parity_reward"),
        dynamic_sampling_filter_path="vime_core.rewards.filters:check_reward_nonzero_std",
        over_sampling_batch_size=2,
    )
    samples, metrics = manager.generate_samples(0)
    assert len(samples) == 16
    groups = [samples[i : i + 4] for i in range(0, 16, 4)]
    for group in groups:
        assert group[0].group_index % 2 == 1, "a constant-reward group was kept"
        assert [s.reward for s in group] == [float(s.index % 2) for s in group]
    # Every even group the loop completed was dropped; over-sampling replaced each one.
    assert metrics["rollout/dropped_groups"] > 0
    assert metrics["rollout/submitted_groups"] >= 4 + metrics["rollout/dropped_groups"]
    completed = 4 + metrics["rollout/dropped_groups"]
    assert metrics["rollout/filter_drop_rate"] == pytest.approx(metrics["rollout/dropped_groups"] / completed)


def test_partial_rollout_requeues_aborted_samples(make_manager):
    # 1 group wanted, 6 submitted, 4 requests at a time: most groups are still running or
    # waiting when the first group completes, and must come back through the data source.
    manager = make_manager(
        rollout_batch_size=1,
        over_sampling_batch_size=6,
        vllm_server_concurrency=2,
        rollout_max_response_len=64,
        partial_rollout=True,
        custom_rm_path=hook("index_reward"),
    )
    samples, metrics = manager.generate_samples(0)
    assert len(samples) == 4
    buffered = manager.data_source.buffer
    requeued = [s for g in buffered for s in g]
    assert metrics["rollout/requeued_count"] == len(requeued) > 0
    assert metrics["rollout/aborted_count"] > 0
    returned_ids = {s.group_index for s in samples}
    assert not returned_ids & {g[0].group_index for g in buffered}, "a group came back and was requeued"
    for s in requeued:
        assert s.loss_mask == [0] * s.response_length, "off-policy tokens must not be trained"
        assert s.status in (Status.PENDING, Status.COMPLETED, Status.TRUNCATED)
    # Next rollout continues the requeued groups first; a continued sample's old part stays masked.
    old = {s.session_id: s.response_length for s in requeued}
    samples2, _ = manager.generate_samples(1)
    continued = [s for s in samples2 if s.session_id in old]
    assert continued, "requeued groups were not handed out first"
    for s in continued:
        k = old[s.session_id]
        assert s.loss_mask[:k] == [0] * k
        if s.metadata.get("requeued") and s.status is not Status.FAILED and k < s.response_length:
            assert s.loss_mask[k:] == [1] * (s.response_length - k)
        assert s.weight_versions[-1].end == s.response_length


def test_reward_function_raising_marks_samples_failed(make_manager):
    from vime_core.rollout.loop import RewardFailureError

    # the default bound (max_reward_failure_share 0.5) fails the rollout and gives its prompts back
    manager = make_manager(custom_rm_path=hook("raising_reward"))
    before = manager.data_source.state_dict()
    with pytest.raises(RewardFailureError, match=r"rollout 0: the reward function .*raising_reward failed on 16 of 16"):
        manager.generate(0)
    assert manager.data_source.state_dict() == before
    # 1: the samples are FAILED and trained on with a zero loss mask
    manager = make_manager(custom_rm_path=hook("raising_reward"), max_reward_failure_share=1.0)
    batch, metrics = manager.generate(0)
    check_batch_shape(batch, 4, 4)
    assert set(batch["status"]) == {"failed"}
    assert all(m == [0] * len(m) for m in batch["loss_mask"])
    assert all("RuntimeError: reward exploded" in md for md in batch["metadata"])
    assert metrics["rollout/failed_count"] == 16 == metrics["rollout/reward_failed_count"]


def test_in_client_consistent_hash_and_eval(make_manager, arith_data):
    manager = make_manager(
        use_router=False,
        router_policy="consistent_hash",
        eval_prompt_data=arith_data,
        n_samples_per_eval_prompt=2,
        eval_temperature=0.0,
    )
    router = manager.state.generator
    assert router.pick("session-a") is router.pick("session-a")
    picks = {router.pick(f"s-{i}").base_url for i in range(32)}
    assert len(picks) == 2, "32 sessions all hashed onto one engine"
    requests = record_requests(manager)
    batch, metrics = manager.generate(0)
    # no flag reads the engines' log-probs: none asked for, none sent, none carried or missing
    check_batch_shape(batch, 4, 4, log_probs=False)
    assert requests and all("logprobs" not in params and sent is None for params, sent in requests)
    assert metrics["rollout/missing_logprob_count"] == 0
    state_before = manager.data_source_state()
    del requests[:]
    metrics = manager.eval(0)
    assert len(requests) == 25 * 2 and all("logprobs" not in params for params, _ in requests)
    assert manager.data_source_state() == state_before, "eval touched the training data source"
    assert metrics["eval/num_samples"] == 25 * 2
    assert 0.0 <= metrics["eval/reward_mean"] <= 1.0
    assert manager.weight_versions() == [0, 0]


def test_killing_an_engine_mid_rollout_still_returns_a_full_batch(make_manager, healthy_engines):
    manager = make_manager(rollout_batch_size=8, rollout_max_response_len=32, vllm_server_concurrency=4)
    victim = healthy_engines[1]
    killed = threading.Event()

    def kill_after_first_sample(sample):
        if not killed.is_set():
            killed.set()
            victim.kill()

    manager.state.sample_hook = kill_after_first_sample
    batch, metrics = manager.generate(0)
    assert killed.is_set()
    check_batch_shape(batch, 8, 4)
    assert "failed" not in batch["status"], [m for m in batch["metadata"] if "generate_error" in m]
    assert len(set(batch["session_id"])) == 32, "a sample was duplicated"
    # The monitor brings the engine back (same URL) for the tests that follow.
    deadline_s = 240
    import time

    t0 = time.monotonic()
    while manager.fleet.health.restarts == 0 and time.monotonic() - t0 < deadline_s:
        time.sleep(1)
    assert manager.fleet.health.restarts >= 1, manager.fleet.health.errors
    assert victim.is_alive()


def test_the_only_engine_killed_mid_rollout_gives_a_full_trainable_batch(
    healthy_engines, tiny_model_dir, vllm_python, arith_data, cache_dir
):
    """A fault: the run's only vLLM server SIGKILLed during a rollout. Its samples
    fail until the health monitor has it back; their groups are generated again on it, and the
    batch is full, trainable and without a duplicate (nothing failed is handed on). One attempt
    per request: a request's own retries could otherwise outlast the restart, and the group
    path would go untested."""
    import time

    from vime_core.data.validation import validate_trainable
    from vime_core.rollout.manager import RolloutManager

    victim = healthy_engines[0]
    cfg = make_cfg(
        tiny_model_dir,
        vllm_python,
        arith_data,
        rollout_batch_size=4,
        rollout_max_response_len=32,
        vllm_server_concurrency=4,
        rollout_request_max_attempts=1,
    )
    manager = RolloutManager(cfg, servers=[victim], log_dir=str(cache_dir / "engine-logs"))
    killed = threading.Event()

    def kill_after_first_sample(sample):
        if not killed.is_set():
            killed.set()
            victim.kill()

    try:
        manager.state.sample_hook = kill_after_first_sample
        t0 = time.monotonic()
        batch, metrics = manager.generate(0)
        assert killed.is_set() and manager.fleet.health.restarts >= 1, manager.fleet.health.errors
        check_batch_shape(batch, 4, 4)
        assert validate_trainable(batch) == 16
        assert set(batch["status"]) <= {"completed", "truncated"}, [
            m for m in batch["metadata"] if "generate_error" in m
        ]
        assert len(set(batch["session_id"])) == 16, "a sample was duplicated"
        assert metrics["rollout/retried_groups"] >= 1 and metrics["rollout/failed_groups"] == 0
        print(
            (
                f"rollout across the restart: {time.monotonic() - t0:.1f} s, {metrics['rollout/retried_groups']:.0f} "
                f"groups generated again"
            )
        )
    finally:
        manager.shutdown()
    assert victim.is_alive()
