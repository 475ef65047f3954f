"""Multi-turn generation with a tool (vime_core/rollout/multi_turn.py) and the calculator recipe
(recipes/tool_use/), with the engine boundary stubbed: a scripted engine answers like vLLM's
/inference/v1/generate (token ids in and out, stop strings, max_tokens, aborts), on the tiny
model's real tokenizer. The stored form of the turns (vime_core/data/turns.py) goes through the
real batch builder, Arrow schema and BatchStore, and `vime lineage --turns` reads it back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from recipes.tool_use.calculator import CALCULATOR, Calculator, evaluate, final_answer, reward
from vime_core.data.sample import Sample, Status
from vime_core.data.turns import TURNS_KEY, sample_turns, turns_error, turns_of
from vime_core.rollout.generate import GenerateContext, base_sampling_params
from vime_core.rollout.multi_turn import ToolResult, generate_multi_turn

pytestmark = pytest.mark.timeout(60)
EOS = 2
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LOGPROB = -0.5


class ScriptedEngine:
    """Answers request i with script[i] (text, "<eos>" for EOS), generated token by token as vLLM
    does: it stops after the token that completes a stop string ("stop"), at max_tokens
    ("length"), or at EOS ("stop"). A script entry ("abort", text) comes back with finish "abort",
    as from the rollout's own abort: it sets `aborting` (the context's) first."""

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = list(script)
        self.requests: list[tuple[list[int], dict]] = []
        self.aborting: asyncio.Event | None = None

    def _ids(self, text: str) -> list[int]:
        parts = text.split("<eos>")
        ids = list(self.tokenizer.encode(parts[0], add_special_tokens=False))
        return ids + [EOS] if len(parts) > 1 else ids

    async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
        self.requests.append((list(token_ids), dict(sampling_params)))
        await asyncio.sleep(0)
        entry = self.script.pop(0)
        if isinstance(entry, tuple) and self.aborting is not None:
            self.aborting.set()
        return self.answer(entry, sampling_params)

    def answer(self, entry, sampling_params) -> dict:
        aborted = isinstance(entry, tuple)
        planned = self._ids(entry[1] if aborted else entry)
        out, finish = [], "abort" if aborted else "length"
        for token in planned[: sampling_params["max_tokens"]]:
            out.append(token)
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if token == EOS or any(s in text for s in sampling_params.get("stop") or []):
                finish = "stop"
                break
        else:
            if not aborted and len(planned) <= sampling_params["max_tokens"]:
                finish = "stop"  # a script entry that ends without EOS or a stop string
        with_log_probs = sampling_params.get("logprobs") is not None
        content = [{"token_id": t, "logprob": LOGPROB, "rank": 1, "top_logprobs": []} for t in out]
        return {
            "choices": [
                {
                    "token_ids": out,
                    "finish_reason": finish,
                    "logprobs": {"content": content} if with_log_probs else None,
                    "weight_versions": [{"version": "3", "start": 0, "end": len(out)}] if out else [],
                }
            ],
            "usage": {"completion_tokens": len(out)},
        }


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def make_cfg(tiny_model_dir):
    from vime_core.config import make_config

    def make(**overrides):
        values = {
            "hf_checkpoint": str(tiny_model_dir),
            "device": "cpu",
            "rollout_max_prompt_len": 16,
            "rollout_max_response_len": 32,
            "rollout_batch_size": 1,
            "n_samples_per_prompt": 2,
            "custom_generate_function_path": "recipes.tool_use.calculator:generate",
            "custom_rm_path": "recipes.tool_use.calculator:reward",
        }
        values.update(overrides)
        return make_config(values)

    return make


def run(cfg, tokenizer, script, prompt="3*4+5", label="17", sample=None, max_turns=4, tool=CALCULATOR, log_probs=None):
    engine = ScriptedEngine(tokenizer, script)
    ctx = GenerateContext(cfg, engine, tokenizer, EOS)
    engine.aborting = ctx.aborting
    if sample is None:
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        sample = Sample(
            prompt_id="p", prompt=prompt, label=label, tokens=ids, prompt_length=len(ids), group_index=0, index=0
        )
    params = base_sampling_params(cfg, log_probs=log_probs)
    asyncio.run(generate_multi_turn(ctx, sample, params, tool, max_turns))
    return sample, engine


def text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def spans(sample):
    return [(s["role"], s["turn"], s["start"], s["end"]) for s in sample.metadata[TURNS_KEY]]


# ---- the calculator -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("7", 7),
        ("3*4+5", 17),
        ("3+4*5", 23),
        ("2*3*4-5", 19),
        ("3-5", -2),
        ("3--5", 8),
        ("-2*3", -6),
        ("10-2-3", 5),
        ("007+1", 8),
        ("5*0-1", -1),
    ],
)
def test_evaluate_follows_precedence_and_signs(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["", "3*", "*3", "3**4", "3---5", "3 4", "1234567890123+1", "999999*999999*9"])
def test_evaluate_refuses_what_is_not_integers_joined_by_operators(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


@pytest.mark.parametrize(
    "response, call, output",
    [
        ("3*4=", "3*4", "12"),
        ("3*4=12+5=", "12+5", "17"),  # the previous result, continued
        ("12 3*4=", "3*4", "12"),  # a space ends the expression
        ("5>3 * 4 =", "3*4", "12"),  # spaces around operators are dropped
        ("3*=", "3*", ""),
        ("=", "", ""),
    ],
)
def test_calculator_answers_the_call_before_the_marker(response, call, output):
    result = Calculator()(response)
    assert (result.call, result.output) == (call, output)
    assert (result.error is None) == bool(output)


def test_reward_reads_the_number_after_the_last_marker_of_a_finished_sample():
    def done(response, status=Status.COMPLETED, finish="stop"):
        return Sample(response=response, label="17", status=status, finish_reason=finish)

    assert reward(done("3*4=12+5=17>17")) == 1.0
    assert reward(done(">9 >17")) == 1.0 and final_answer(">9 >17") == "17"
    assert reward(done("3*4=12+5=17>18")) == 0.0
    assert reward(done("3*4=12+5=17")) == 0.0  # no answer
    assert reward(done(">17 3")) == 0.0 and final_answer(">17 3") is None
    assert reward(done(">17", status=Status.TRUNCATED)) == 0.0  # cut by the length or the turn limit
    assert reward(Sample(response=">-2", label="-2", status=Status.COMPLETED, finish_reason="stop")) == 1.0


# ---- the turn loop -------------------------------------------------------------------------------


def test_turns_alternate_model_and_tool_and_only_model_tokens_are_trained(make_cfg, tokenizer):
    cfg = make_cfg(use_rollout_logprobs=True)
    sample, engine = run(cfg, tokenizer, ["3*4=", "+5=", ">17<eos>"])

    assert text(tokenizer, sample.response_tokens) == "3*4=12+5=17>17<eos>"
    assert sample.response == "3*4=12+5=17>17"
    assert (sample.status, sample.finish_reason) == (Status.COMPLETED, "stop")
    assert spans(sample) == [
        ("model", 0, 0, 4),
        ("tool", 0, 4, 6),
        ("model", 1, 6, 9),
        ("tool", 1, 9, 11),
        ("model", 2, 11, 15),
    ]
    turns = sample.metadata[TURNS_KEY]
    assert [(t["call"], t["output"]) for t in turns if t["role"] == "tool"] == [("3*4", "12"), ("12+5", "17")]
    assert [t["finish"] for t in turns if t["role"] == "model"] == ["stop"] * 3
    assert sample.loss_mask == [1] * 4 + [0] * 2 + [1] * 3 + [0] * 2 + [1] * 4
    assert sample.rollout_log_probs == [LOGPROB] * 4 + [0.0] * 2 + [LOGPROB] * 3 + [0.0] * 2 + [LOGPROB] * 4
    assert turns_error(turns, sample.response_length, sample.loss_mask) is None
    assert sample.metadata["tool_calls"] == 2 and sample.metadata["completion_tokens"] == 11
    # the engine's weight spans cover the model's tokens only
    assert [(w.version, w.start, w.end) for w in sample.weight_versions] == [(3, 0, 4), (3, 6, 9), (3, 11, 15)]
    # token in, token out: every request is the prompt and the whole response so far, as ids
    prompt = sample.tokens[: sample.prompt_length]
    assert [r[0] for r in engine.requests] == [
        prompt,
        prompt + sample.response_tokens[:6],
        prompt + sample.response_tokens[:11],
    ]
    assert all(r[1]["stop"] == ["="] for r in engine.requests)
    assert [r[1]["max_tokens"] for r in engine.requests] == [32, 26, 21]  # the budget covers tool tokens too
    assert reward(sample) == 1.0


@pytest.mark.parametrize("recipe", ["cpu_tiny.yaml", "gpu_qwen2.5_0.5b.yaml"])
def test_a_special_token_is_no_answer_marker_under_the_recipes_settings(make_cfg, tokenizer, recipe):
    """'<bos>' ends with '>': decoded into the response text it would read as the answer marker
    and reward "...-<bos>3" as the answer 3. The recipes skip special tokens, so it does not."""
    from vime_core.config import load_config

    script = ["=", "48>7-<bos>3<eos>"]  # an unreadable call, then a non-answer with <bos> inside
    skip = load_config(RECIPES / "tool_use" / recipe).rollout_skip_special_tokens
    sample, _ = run(make_cfg(rollout_skip_special_tokens=skip), tokenizer, script, prompt="3+0*4", label="3")
    assert (sample.response, reward(sample)) == ("=48>7-3", 0.0)
    unskipped, _ = run(make_cfg(rollout_skip_special_tokens=False), tokenizer, script, prompt="3+0*4", label="3")
    assert (unskipped.response, reward(unskipped)) == ("=48>7-<bos>3", 1.0)  # the hazard the setting removes


def test_the_turn_limit_leaves_the_last_call_unanswered(make_cfg, tokenizer):
    sample, engine = run(make_cfg(), tokenizer, ["1=", "+1=", "+1=", "+1=", ">4<eos>"], max_turns=3)
    assert text(tokenizer, sample.response_tokens) == "1=1+1=2+1="  # three model turns, two answered
    assert [s[0] for s in spans(sample)] == ["model", "tool", "model", "tool", "model"]
    assert sample.status is Status.TRUNCATED and sample.metadata["unanswered_call"] is True
    assert sample.metadata["tool_calls"] == 2 and len(engine.requests) == 3
    assert reward(sample) == 0.0
    assert sample.rollout_log_probs == []  # none asked for: the tool's 0.0 do not make a column


def test_a_model_turn_cut_by_the_budget_calls_no_tool(make_cfg, tokenizer):
    sample, _ = run(make_cfg(rollout_max_response_len=6), tokenizer, ["3*4=", "+5+5+5+5="])
    assert text(tokenizer, sample.response_tokens) == "3*4=12"[:6]
    sample, _ = run(make_cfg(rollout_max_response_len=8), tokenizer, ["3*4=", "+5+5+5+5="])
    assert text(tokenizer, sample.response_tokens) == "3*4=12+5"
    assert (sample.status, sample.finish_reason) == (Status.TRUNCATED, "length")
    assert spans(sample) == [("model", 0, 0, 4), ("tool", 0, 4, 6), ("model", 1, 6, 8)]
    assert sample.metadata[TURNS_KEY][-1]["finish"] == "length" and "unanswered_call" not in sample.metadata


def test_a_tool_answer_longer_than_the_budget_is_cut(make_cfg, tokenizer):
    sample, engine = run(make_cfg(rollout_max_response_len=6), tokenizer, ["99*99="])
    assert len(engine.requests) == 1 and text(tokenizer, sample.response_tokens) == "99*99="  # no room for the answer
    assert sample.status is Status.TRUNCATED and sample.metadata["unanswered_call"] is True
    sample, engine = run(make_cfg(rollout_max_response_len=8), tokenizer, ["99*99="])
    assert text(tokenizer, sample.response_tokens) == "99*99=98"  # 9801, cut to the budget
    assert (sample.status, sample.finish_reason) == (Status.TRUNCATED, "length")
    assert sample.metadata[TURNS_KEY][-1] == {
        "turn": 0,
        "role": "tool",
        "start": 6,
        "end": 8,
        "call": "99*99",
        "output": "9801",
    }
    assert turns_error(sample.metadata[TURNS_KEY], sample.response_length, sample.loss_mask) is None


def test_a_call_the_calculator_cannot_read_gets_an_empty_tool_turn(make_cfg, tokenizer):
    sample, _ = run(make_cfg(), tokenizer, ["3*=", "3*4=", ">12<eos>"])
    assert text(tokenizer, sample.response_tokens) == "3*=3*4=12>12<eos>"
    tool_turns = [t for t in sample.metadata[TURNS_KEY] if t["role"] == "tool"]
    assert tool_turns[0]["start"] == tool_turns[0]["end"] == 3 and "not integers" in tool_turns[0]["error"]
    assert "error" not in tool_turns[1] and sample.metadata["tool_calls"] == 2


def test_an_answer_without_a_call_is_one_turn(make_cfg, tokenizer):
    sample, engine = run(make_cfg(), tokenizer, [">17<eos>"])
    assert spans(sample) == [("model", 0, 0, 4)] and "tool_calls" not in sample.metadata
    assert sample.loss_mask == [1] * 4 and reward(sample) == 1.0 and len(engine.requests) == 1


def test_an_aborted_turn_resumes_in_the_same_span_and_a_retry_starts_over(make_cfg, tokenizer):
    from vime_core.rollout.loop import requeue_partial

    cfg = make_cfg()
    sample, _ = run(cfg, tokenizer, ["3*4=", ("abort", "+5")])
    assert sample.status is Status.ABORTED
    assert spans(sample) == [("model", 0, 0, 4), ("tool", 0, 4, 6), ("model", 1, 6, 8)]
    assert sample.metadata[TURNS_KEY][-1]["finish"] == "abort"

    class Source:
        def add_back(self, groups):
            pass

    requeue_partial(Source(), [[sample]])  # partial_rollout: the off-policy part is masked
    sample, engine = run(cfg, tokenizer, ["=", ">17<eos>"], sample=sample)
    assert text(tokenizer, sample.response_tokens) == "3*4=12+5=17>17<eos>"
    assert spans(sample) == [
        ("model", 0, 0, 4),
        ("tool", 0, 4, 6),
        ("model", 1, 6, 9),
        ("tool", 1, 9, 11),
        ("model", 2, 11, 15),
    ]
    assert sample.metadata[TURNS_KEY][2]["finish"] == "stop" and sample.metadata["tool_calls"] == 2
    assert sample.loss_mask == [0] * 8 + [1] + [0] * 2 + [1] * 4
    assert engine.requests[0][0] == sample.tokens[: sample.prompt_length + 8]

    sample.clear_response()  # the group generated again from its prompt (an engine died)
    sample, _ = run(cfg, tokenizer, [">17<eos>"], sample=sample)
    assert spans(sample) == [("model", 0, 0, 4)] and "tool_calls" not in sample.metadata


def test_a_failed_request_keeps_the_turns_so_far(make_cfg, tokenizer):
    from vime_core.engines.client import EngineError

    class Failing(ScriptedEngine):
        async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
            if self.requests:
                raise EngineError("fake", "/inference/v1/generate", 400, "bad request")
            return await super().generate(token_ids, sampling_params, session_id, request_id)

    cfg = make_cfg()
    ids = list(tokenizer.encode("3*4+5", add_special_tokens=False))
    sample = Sample(tokens=ids, prompt_length=len(ids))
    ctx = GenerateContext(cfg, Failing(tokenizer, ["3*4="]), tokenizer, EOS)
    asyncio.run(generate_multi_turn(ctx, sample, base_sampling_params(cfg), CALCULATOR, 4))
    assert sample.status is Status.FAILED and spans(sample) == [("model", 0, 0, 4), ("tool", 0, 4, 6)]


def test_a_slow_tool_answers_nothing_after_its_timeout(make_cfg, tokenizer):
    class Slow:
        call_marker = "="

        async def __call__(self, response_text):
            await asyncio.sleep(5)
            return ToolResult("x", "1")

    cfg = make_cfg()
    ids = list(tokenizer.encode("1", add_special_tokens=False))
    sample = Sample(tokens=ids, prompt_length=1)
    ctx = GenerateContext(cfg, ScriptedEngine(tokenizer, ["1=", ">1<eos>"]), tokenizer, EOS)
    asyncio.run(generate_multi_turn(ctx, sample, base_sampling_params(cfg), Slow(), 4, tool_timeout_s=0.05))
    tool = sample.metadata[TURNS_KEY][1]
    assert tool["start"] == tool["end"] and "within 0.05 s" in tool["error"] and sample.status is Status.COMPLETED


@pytest.mark.integration  # the recipe's calculator answers from its sandbox's child processes
def test_the_recipe_hook_runs_in_the_rollout_loop(make_cfg, tokenizer, tmp_path):
    """The hooks loaded by path as the RolloutManager does, through the real rollout loop and
    the batch builder: every sample has its turns, tool tokens untrained, the calculator's
    answers from its sandbox."""
    from tests.unit.test_rollout_loop import make_state
    from vime_core.data.batch import build_batch
    from vime_core.rollout.loop import generate_rollout
    from vime_core.utils.imports import load_function
    from recipes.tool_use.prompts import TINY

    cfg = make_cfg(prompt_data=str(TINY), rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=2)

    class Solver(ScriptedEngine):
        """Solves each prompt in two calls (the expression, then +0), the answer read from the last result."""

        async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
            context = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            expr = next(r["prompt"] for r in rows if context.startswith(r["prompt"]))
            done = context[len(expr) :]
            if not done:
                entry = expr + "="
            elif done.count("=") == 1:
                entry = "+0="
            else:
                entry = ">" + done.rsplit("=", 1)[1] + "<eos>"
            self.requests.append((list(token_ids), dict(sampling_params)))
            return self.answer(entry, sampling_params)

    rows = [json.loads(line) for line in TINY.read_text().splitlines()]
    state = make_state(cfg, tokenizer, Solver(tokenizer, []))
    state.generate_fn = load_function(cfg.custom_generate_function_path, field="custom_generate_function_path")
    samples, metrics = asyncio.run(generate_rollout(state, 0))
    assert len(samples) == 4 and metrics["rollout/reward_mean"] == 1.0
    batch = build_batch(samples, cfg)
    for row in range(4):
        shown = sample_turns(batch, row, lambda ids: text(tokenizer, ids))
        assert shown["check"] == "ok" and [t["role"] for t in shown["turns"]] == [
            "model",
            "tool",
            "model",
            "tool",
            "model",
        ]
        assert [t["trained_tokens"] for t in shown["turns"]][1::2] == [0, 0]
        assert shown["turns"][-1]["text"].startswith(">") and shown["turns"][-1]["text"].endswith("<eos>")


# ---- stored turns --------------------------------------------------------------------------------


def test_a_sample_without_turns_reads_as_one_model_turn():
    assert turns_of("{}", 5) == [{"turn": 0, "role": "model", "start": 0, "end": 5, "finish": ""}]
    assert turns_of({"turns": []}, 0) == [] and turns_of("not json", 2)[0]["end"] == 2
    assert turns_error(turns_of("{}", 5), 5, [1] * 5) is None


def test_turns_error_names_gaps_roles_and_trained_tool_tokens():
    model = {"turn": 0, "role": "model", "start": 0, "end": 2, "finish": "stop"}
    tool = {"turn": 0, "role": "tool", "start": 2, "end": 4, "call": "1", "output": "1"}
    assert turns_error([model, tool], 4, [1, 1, 0, 0]) is None
    assert "loss mask 1" in turns_error([model, tool], 4, [1, 1, 0, 1])
    assert "end at 4" in turns_error([model, tool], 5, [1, 1, 0, 0, 1])
    assert "covers [3, 4)" in turns_error([model, {**tool, "start": 3}], 4, [1, 1, 0, 0])
    assert "role 'user'" in turns_error([{**model, "role": "user"}], 2, [1, 1])


def test_turns_are_stored_with_the_batch_and_shown_by_vime_lineage(
    make_cfg, tokenizer, tiny_model_dir, tmp_path, capsys
):
    from flows.cli import cmd_lineage
    from vime_core.data.batch import build_batch
    from vime_core.storage import BatchStore

    cfg = make_cfg()
    solved, _ = run(cfg, tokenizer, ["3*4=", "+5=", ">17<eos>"])
    single, _ = run(cfg, tokenizer, [">16<eos>"])
    single.index = 1
    single.metadata.pop(TURNS_KEY)  # as a single-turn sample (or a batch from before multi-turn)
    for s in (solved, single):
        s.reward = reward(s)
    store = BatchStore(str(tmp_path / "store"))
    store.write(build_batch([solved, single], cfg), {"run": "tools", "rollout_id": 0, "model_id": str(tiny_model_dir)})
    batch, _ = store.read("tools", 0)
    assert json.loads(batch["metadata"][0])[TURNS_KEY] == solved.metadata[TURNS_KEY]

    assert cmd_lineage(["--storage-uri", str(tmp_path / "store"), "--run", "tools", "--turns", "0"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [s["row"] for s in shown] == [0, 1]
    first = shown[0]
    assert (first["prompt"], first["raw_reward"], first["check"]) == ("3*4+5", 1.0, "ok")
    assert [(t["role"], t["text"], t["trained_tokens"]) for t in first["turns"]] == [
        ("model", "3*4=", 4),
        ("tool", "12", 0),
        ("model", "+5=", 3),
        ("tool", "17", 0),
        ("model", ">17<eos>", 4),
    ]
    assert first["turns"][1]["call"] == "3*4" and first["turns"][1]["token_ids"] == tokenizer.encode(
        "12", add_special_tokens=False
    )
    assert [(t["role"], t["text"]) for t in shown[1]["turns"]] == [("model", ">16<eos>")]

    # one row, and without a tokenizer that loads: token ids only, said on stderr
    assert (
        cmd_lineage(
            [
                "--storage-uri",
                str(tmp_path / "store"),
                "--run",
                "tools",
                "--turns",
                "0",
                "--sample",
                "1",
                "--tokenizer",
                str(tmp_path / "none"),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    only = json.loads(captured.out)
    assert len(only) == 1 and "text" not in only[0]["turns"][0] and "token ids only" in captured.err
    with pytest.raises(SystemExit):
        cmd_lineage(["--storage-uri", str(tmp_path / "store"), "--run", "tools", "--turns", "0", "--sample", "2"])
    assert "has rows 0..1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cmd_lineage(["--storage-uri", str(tmp_path / "store"), "--turns", "0"])
    assert "--turns needs --run" in capsys.readouterr().err


def test_a_call_marker_that_is_a_special_token_is_seen_as_the_engine_saw_it(make_cfg, tokenizer):
    """vLLM matches stop strings on text decoded with the request's skip_special_tokens (false by
    default): the turn is read the same way, so a special-token marker calls the tool."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<call>"]})
    call = tokenizer.convert_tokens_to_ids("<call>")
    first = tokenizer.encode("3*4=", add_special_tokens=False)

    class Engine:
        answers = [first + [call], tokenizer.encode(">12", add_special_tokens=False) + [EOS]]

        async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
            assert sampling_params["skip_special_tokens"] is False and "<call>" in sampling_params["stop"]
            out = self.answers.pop(0)
            return {"choices": [{"token_ids": out, "finish_reason": "stop", "logprobs": None}], "usage": {}}

    calls = []

    class Tool:
        call_marker = "<call>"

        def __call__(self, text):
            calls.append(text)
            return ToolResult(call=text, output="12")

    cfg = make_cfg()
    sample = Sample(tokens=[4, 13, 4], prompt_length=3, group_index=0, index=0)
    ctx = GenerateContext(cfg, Engine(), tokenizer, EOS)
    asyncio.run(generate_multi_turn(ctx, sample, base_sampling_params(cfg), Tool(), max_turns=3))
    assert calls == ["3*4=<call>"] and sample.metadata["tool_calls"] == 1
    assert [t["role"] for t in sample.metadata[TURNS_KEY]] == ["model", "tool", "model"]
