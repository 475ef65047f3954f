"""Reward hub, rule-based checkers, the remote reward model (against a real loopback HTTP
server), filters and hook loading."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from tests.unit.test_batch import _sample as _batch_sample
from vime_core.config import load_config
from vime_core.data.batch import build_batch
from vime_core.data.sample import Sample, Status
from vime_core.rewards.filters import check_reward_nonzero_std, keep_all, load_filter
from vime_core.rewards.hub import RewardHub
from vime_core.rewards.math_checker import extract_answer, extract_boxed, is_equiv, math_reward
from vime_core.rewards.remote import RemoteRewardError, RemoteRewardModel, parse_reward
from vime_core.utils.secrets import redact_url
from vime_core.rewards.scorers import exact_match_reward, f1_score
from vime_core.utils.imports import HookLoadError, load_function


def _sample(response: str, label, **kw) -> Sample:
    return Sample(prompt="q", response=response, label=label, **kw)


# ---- math checker -------------------------------------------------------------------------------


def test_boxed_extraction_handles_nesting_and_last_box():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed("no box") is None
    assert extract_boxed(r"\boxed{unbalanced") is None
    assert extract_answer("so 3 apples and 12 pears") == "12"
    assert extract_answer("it costs 1,250 dollars, not 12,") == "12"
    assert extract_answer("total: 1,250.") == "1,250"
    assert extract_boxed(r"\boxed 7$") == "7"


@pytest.mark.parametrize(
    "pred, label, equal",
    [
        (r"\frac{1}{2}", "0.5", True),
        (r"\dfrac{3}{4}", "3/4", True),
        ("1,000", "1000", True),
        ("50\\%", "0.5", True),
        ("x = 5", "5", True),
        ("5.", "5", True),
        ("6", "5", False),
        ("abc", "5", False),
        (None, "5", False),
    ],
)
def test_equivalence(pred, label, equal):
    assert is_equiv(pred, label) is equal


def test_math_reward_boxed_and_final_number():
    assert math_reward(_sample(r"... the answer is \boxed{42}", "42")) == 1.0
    assert math_reward(_sample("7 then 42", "42")) == 1.0
    assert math_reward(_sample(r"\boxed{41}", r"\boxed{42}")) == 0.0


# ---- text scorers ---------------------------------------------------------------------------------


def test_math_reward_reads_a_gsm8k_label_after_its_hashes():
    gsm8k = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"
    assert math_reward(_sample("so 72 in all", gsm8k)) == 1.0
    assert math_reward(_sample("so 24 in all", gsm8k)) == 0.0  # a number of the reasoning is not the answer
    assert math_reward(_sample("1,234", "#### 1,234")) == 1.0


def test_exact_match_and_f1():
    assert exact_match_reward(_sample("The Eiffel Tower!", "eiffel tower")) == 1.0
    assert exact_match_reward(_sample("tower", ["eiffel tower", "Tower"])) == 1.0
    # pred {paris, france}, ref {paris}: P = 1/2, R = 1 -> F1 = 2/3
    p, r = 1 / 2, 1.0
    assert f1_score("Paris France", "paris") == pytest.approx(2 * p * r / (p + r))
    assert f1_score("", "") == 1.0 and f1_score("x", "") == 0.0


# ---- hub ------------------------------------------------------------------------------------------


def _hub(**over) -> RewardHub:
    return RewardHub(load_config(overrides=over))


def test_builtin_arith_and_math():
    s = _sample("7", "7", finish_reason="stop")
    asyncio.run(_hub(rm_type="arith").score(s))
    assert s.reward == 1.0 and s.status == Status.PENDING
    s2 = _sample(r"\boxed{8}", "7")
    asyncio.run(_hub(rm_type="math").score(s2))
    assert s2.reward == 0.0


def test_unknown_rm_type_is_named():
    with pytest.raises(ValueError, match="rm_type='nope'"):
        _hub(rm_type="nope")


HOOKS = """
import asyncio

def per_sample(sample):
    return float(len(sample.response))

async def per_sample_async(sample):
    await asyncio.sleep(0)
    return 2.5

def per_group(samples):
    return [float(i) for i, _ in enumerate(samples)]

def raises(sample):
    raise RuntimeError("judge exploded")

def not_a_number(sample):
    return "high"

def short_group(samples):
    return [1.0]

VALUE = 3
"""


@pytest.fixture
def hooks(tmp_path):
    path = tmp_path / "my_hooks.py"
    path.write_text(HOOKS)
    return str(path)


def test_custom_sync_and_async(hooks):
    s = _sample("abcd", None)
    asyncio.run(_hub(custom_rm_path=f"{hooks}:per_sample").score(s))
    assert s.reward == 4.0
    group = [_sample("a", None), _sample("b", None)]
    asyncio.run(_hub(custom_rm_path=f"{hooks}:per_sample_async").score_group(group))
    assert [g.reward for g in group] == [2.5, 2.5]


def test_group_function_scores_a_single_sample(hooks):
    s = _sample("a", None)
    asyncio.run(_hub(custom_rm_path=f"{hooks}:per_group", group_rm=True).score(s))
    assert s.reward == 0.0 and s.status == Status.PENDING


def test_custom_group_reward(hooks):
    group = [_sample("a", None) for _ in range(3)]
    asyncio.run(_hub(custom_rm_path=f"{hooks}:per_group", group_rm=True).score_group(group))
    assert [g.reward for g in group] == [0.0, 1.0, 2.0]


def test_raising_reward_marks_sample_failed_and_goes_on(hooks):
    hub = _hub(custom_rm_path=f"{hooks}:raises")
    samples = [_sample("a", None), _sample("b", None)]
    asyncio.run(hub.score_group(samples))
    for s in samples:
        assert s.status == Status.FAILED
        assert s.reward == 0.0
        assert s.metadata["reward_error"] == "RuntimeError: judge exploded"


def test_non_numeric_reward_and_wrong_group_length_fail(hooks):
    s = _sample("a", None)
    asyncio.run(_hub(custom_rm_path=f"{hooks}:not_a_number").score(s))
    assert s.status == Status.FAILED and s.metadata["reward_error"].startswith("InvalidRewardError")
    assert s.metadata["reward_error_type"] == "returned str" and "high" not in s.metadata["reward_error"]
    group = [_sample("a", None), _sample("b", None)]
    asyncio.run(_hub(custom_rm_path=f"{hooks}:short_group", group_rm=True).score_group(group))
    assert all(g.status == Status.FAILED for g in group)


REALS = [
    True,
    False,
    7,
    -0.5,
    Fraction(1, 4),
    np.float32(0.25),
    np.float16(-2.0),
    np.int64(3),
    np.uint8(200),
    np.bool_(True),
    np.array(2.5),
    np.array(1, dtype=np.int32),
    torch.tensor(1.5),
    torch.tensor(4),
    torch.tensor(True),
    torch.tensor(0.5, dtype=torch.bfloat16),
]


def _returning(value, **over) -> RewardHub:
    hub = _hub(**over)
    hub.fn = lambda arg: value
    return hub


@pytest.mark.parametrize("value", REALS, ids=repr)
def test_every_real_scalar_is_a_reward(value):
    expected = float(value.item() if hasattr(value, "item") else value)
    s = _sample("a", None)
    asyncio.run(_returning(value).score(s))
    assert s.reward == expected and s.status == Status.PENDING and "reward_error" not in s.metadata


def test_a_group_function_may_answer_an_array_and_a_bad_value_fails_only_its_sample():
    scores = [np.float32(0.5), np.int64(1), np.bool_(False)]
    group = [_sample("a", None) for _ in scores]
    asyncio.run(
        _returning(np.array(scores), custom_rm_path="vime_core.rewards.filters:keep_all", group_rm=True).score_group(
            group
        )
    )
    assert [g.reward for g in group] == [float(v) for v in scores]
    group = [_sample("a", None) for _ in range(3)]
    asyncio.run(
        _returning(
            torch.tensor([1.0, float("nan"), 0.0]), custom_rm_path="vime_core.rewards.filters:keep_all", group_rm=True
        ).score_group(group)
    )
    assert [g.status for g in group] == [Status.PENDING, Status.FAILED, Status.PENDING]
    assert group[1].metadata["reward_error_type"] == "returned a non-finite float (NaN or Inf)"


SECRET = "sk-secret-0.9"


@pytest.mark.parametrize(
    "value, what",
    [
        (1 + 2j, "returned complex"),
        (np.complex64(1), "returned numpy.complex64"),
        (SECRET, "returned str"),
        (None, "returned NoneType"),
        ([0.9], "returned list"),
        (np.array([0.9]), "returned numpy.ndarray[shape (1,)]"),
        (torch.tensor([0.9]), "returned torch.Tensor[shape (1,)]"),
        (float("nan"), "returned a non-finite float (NaN or Inf)"),
        (np.float32("inf"), "returned a non-finite numpy.float32 (NaN or Inf)"),
        (torch.tensor(float("-inf")), "returned a non-finite torch.Tensor[torch.float32] (NaN or Inf)"),
    ],
    ids=repr,
)
def test_what_is_not_a_finite_real_fails_the_sample_naming_its_type_only(value, what):
    s = _sample("a", None)
    asyncio.run(_returning(value).score(s))
    assert s.status == Status.FAILED and s.reward == 0.0
    assert s.metadata["reward_error_type"] == what
    assert (
        s.metadata["reward_error"] == f"InvalidRewardError: the reward function {what}; expected a finite real "
        f"number (int, float, bool, a numpy or torch scalar)"
    )


def test_the_remote_reward_follows_the_same_rule_and_never_quotes_the_answer():
    assert parse_reward(True) == 1.0 and parse_reward({"reward": 0}) == 0.0
    assert parse_reward(json.loads('{"reward": 2.5}')) == 2.5
    for payload, shown in [
        ({"reward": SECRET}, "{'reward': str}"),
        (json.loads("NaN"), "a non-finite float (NaN or Inf)"),
        ({"score": SECRET}, "{'reward': NoneType}"),
        ([SECRET], "list"),
    ]:
        with pytest.raises(RemoteRewardError) as info:
            parse_reward(payload, "http://rm:8000/score")
        assert str(info.value) == (
            f"reward model http://rm:8000/score answered {shown}; expected a finite number or {{'reward': number}}"
        )


# ---- hook loading ---------------------------------------------------------------------------------


def test_load_function_errors_name_the_path(hooks):
    assert load_function("vime_core.rewards.filters:check_reward_nonzero_std") is check_reward_nonzero_std
    with pytest.raises(HookLoadError, match=r"custom_rm_path='no_such_mod:f': module 'no_such_mod' not found"):
        load_function("no_such_mod:f", field="custom_rm_path")
    with pytest.raises(HookLoadError, match="has no attribute 'missing'"):
        load_function("vime_core.rewards.filters:missing")
    with pytest.raises(HookLoadError, match="exactly one ':'"):
        load_function("vime_core.rewards.filters.keep_all")
    with pytest.raises(HookLoadError, match="not a callable"):
        load_function(f"{hooks}:VALUE")
    with pytest.raises(HookLoadError, match="does not exist"):
        load_function("/nonexistent/x.py:f")


def test_bad_custom_rm_path_fails_at_hub_construction():
    with pytest.raises(HookLoadError, match="custom_rm_path"):
        _hub(custom_rm_path="vime_core.rewards.filters:nope")


# ---- filters --------------------------------------------------------------------------------------


def _failed(group: int, index: int):
    s = _batch_sample(group, index, 0.0, status=Status.FAILED)  # the hub's placeholder reward
    s.metadata["reward_error"] = "ValueError: boom"
    return s


def test_a_group_whose_counted_rewards_are_equal_is_rejected():
    """[1, 1, 1, FAILED]: the normalisation leaves FAILED out, so every advantage is 0; the filter
    must drop the group too (it used to score FAILED as 0 and keep it)."""
    group = [_batch_sample(0, i, 1.0) for i in range(3)] + [_failed(0, 3)]
    assert check_reward_nonzero_std(group) is False


@pytest.mark.parametrize(
    "rewards",
    [[1, 1, 1, None], [1, 0, None, None], [None] * 4, [0.5, None], [1, 0, 1, 0], [2, 2], [0.5, 0.5, None, 1.0]],
    ids=repr,
)
def test_the_filter_keeps_a_group_exactly_when_its_advantages_are_not_all_zero(rewards):
    """One rule for the filter and the normalisation (data/group_rewards.py): None is a FAILED sample."""
    group = [_failed(0, i) if r is None else _batch_sample(0, i, float(r)) for i, r in enumerate(rewards)]
    advantages = build_batch(group, load_config())["advantage"]
    assert check_reward_nonzero_std(group) is any(a != 0.0 for a in advantages)


def test_check_reward_nonzero_std():
    assert check_reward_nonzero_std([_sample("", None, reward=r) for r in (1, 0, 0, 1)]) is True
    assert check_reward_nonzero_std([_sample("", None, reward=1.0) for _ in range(8)]) is False
    assert check_reward_nonzero_std([_sample("", None, reward=1.0)]) is False
    assert load_filter("vime_core.rewards.filters:check_reward_nonzero_std") is check_reward_nonzero_std
    assert load_filter("") is keep_all
    with pytest.raises(HookLoadError, match="dynamic_sampling_filter_path"):
        load_filter("x:y")


# ---- remote reward model against a real loopback server ------------------------------------------


class _RewardServer:
    """A loopback HTTP reward model: answers 503 for the first `fail_first` calls, sleeps
    `delay_s` per call, then returns {"reward": len(response)}; records the headers it saw."""

    def __init__(self, fail_first: int = 0, delay_s: float = 0.0, status: int = 200):
        self.calls = 0
        self.seen_auth: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                outer.calls += 1
                outer.seen_auth.append(self.headers.get("Authorization", ""))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(delay_s)
                if outer.calls <= fail_first:
                    code, payload = 503, {"error": "busy"}
                elif status != 200:
                    code, payload = status, {"error": "bad request"}
                else:
                    code, payload = 200, {"reward": float(len(body["response"]))}
                data = json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def reward_server(request):
    servers = []

    def make(**kw):
        s = _RewardServer(**kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def test_remote_retries_then_succeeds_and_sends_key(reward_server, monkeypatch):
    server = reward_server(fail_first=2)
    monkeypatch.setenv("VIME_RM_API_KEY", "sk-secret-123")
    hub = _hub(rm_type="remote_rm", rm_url=server.url)
    hub.fn.backoff_s = 0.01
    s = _sample("abc", "x")
    asyncio.run(hub.score(s))
    assert s.reward == 3.0 and s.status == Status.PENDING
    assert server.calls == 3
    assert server.seen_auth[-1] == "Bearer sk-secret-123"
    assert "sk-secret" not in repr(hub.fn)


def test_remote_token_from_a_file_is_sent_and_never_in_the_config_or_errors(reward_server, tmp_path, monkeypatch):
    token = "sk-file-secret-456"
    key_file = tmp_path / "rm_token"
    key_file.write_text(token + "\n")  # a mounted secret usually ends with a newline
    monkeypatch.setenv("VIME_RM_API_KEY", "sk-env-secret-789")  # the file wins over the variable
    server = reward_server(fail_first=100)
    cfg = load_config(overrides={"rm_type": "remote_rm", "rm_url": server.url, "rm_api_key_file": str(key_file)})
    hub = RewardHub(cfg)
    key_file.unlink()  # read once, when the hub was built
    hub.fn.max_retries, hub.fn.backoff_s = 1, 0.01
    s = _sample("abc", "x")
    asyncio.run(hub.score(s))
    assert server.calls == hub.fn.max_retries + 1 and server.seen_auth == [f"Bearer {token}"] * server.calls
    assert s.status == Status.FAILED and "HTTP 503" in s.metadata["reward_error"]
    for text in (s.metadata["reward_error"], repr(hub), repr(hub.fn), cfg.model_dump_json()):
        assert "secret" not in text


def test_remote_token_source_that_is_named_but_missing_fails_at_start_naming_the_field(
    reward_server, tmp_path, monkeypatch
):
    server = reward_server()
    monkeypatch.delenv("VIME_RM_API_KEY", raising=False)
    hub = _hub(rm_type="remote_rm", rm_url=server.url)  # the default variable unset: no token
    asyncio.run(hub.score(_sample("ab", "x")))
    assert server.seen_auth == [""]
    monkeypatch.delenv("MY_RM_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"rm_api_key_env='MY_RM_TOKEN'"):
        _hub(rm_type="remote_rm", rm_url=server.url, rm_api_key_env="MY_RM_TOKEN")
    monkeypatch.setenv("MY_RM_TOKEN", "sk-named-secret")
    hub = _hub(rm_type="remote_rm", rm_url=server.url, rm_api_key_env="MY_RM_TOKEN")
    asyncio.run(hub.score(_sample("ab", "x")))
    assert server.seen_auth[-1] == "Bearer sk-named-secret"
    missing = tmp_path / "absent"
    with pytest.raises(ValueError, match=r"rm_api_key_file=.*absent.*FileNotFoundError") as info:
        _hub(rm_type="remote_rm", rm_url=server.url, rm_api_key_file=str(missing))
    assert "secret" not in str(info.value)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"rm_api_key_file=.*empty"):
        _hub(rm_type="remote_rm", rm_url=server.url, rm_api_key_file=str(empty))


def test_remote_gives_up_and_error_has_no_secret(reward_server):
    server = reward_server(fail_first=100)
    model = RemoteRewardModel(
        server.url, timeout_s=2, max_retries=2, backoff_s=0.01, headers={"Authorization": "Bearer sk-secret-123"}
    )
    with pytest.raises(RemoteRewardError) as info:
        asyncio.run(model(_sample("a", None)))
    assert server.calls == 3
    assert "HTTP 503" in str(info.value) and "sk-secret" not in str(info.value)


def test_remote_timeout_and_client_error_mark_failed(reward_server):
    slow = reward_server(delay_s=0.5)
    hub = _hub(rm_type="remote_rm", rm_url=slow.url, rm_timeout_s=0.1)
    hub.fn.max_retries, hub.fn.backoff_s = 1, 0.01
    s = _sample("a", None)
    asyncio.run(hub.score(s))
    assert s.status == Status.FAILED and "timed out" in s.metadata["reward_error"]
    bad = reward_server(status=400)
    model = RemoteRewardModel(bad.url, max_retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="HTTP 400"):
        asyncio.run(model(_sample("a", None)))
    assert bad.calls == 1  # 4xx is not retried


def test_redact_url():
    assert redact_url("http://user:pw@host:8080/score?key=abc") == "http://host:8080/score"
    assert redact_url("http://tok@127.0.0.1:8000/#frag") == "http://127.0.0.1:8000"  # engines: no trailing slash
