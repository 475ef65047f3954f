"""The multi-turn tool-use recipe end to end, as a user runs it: `vime train --config
recipes/tool_use/cpu_tiny.yaml` for 2 iterations on real actors (Ray head, one vLLM CPU engine behind
vllm-router, one Megatron actor; the run builds the embedded tiny model itself), then `vime lineage
--turns` on what it stored.

The tiny model starts random, so it calls the calculator (ends a turn with '=') in about half of
its samples: the real engine's stop string, the token-in/token-out continuation and the tool's
tokens are exercised, not their learning. Checked on every stored sample: the turn spans cover the
response, tool tokens are untrained and hold exactly what the calculator answers for the text
before them, a model turn holds '=' only as its last token, and the stored reward is the recipe's
for the final answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "tool-use-e2e"
RECIPE = "recipes/tool_use/cpu_tiny.yaml"
NUM_ROLLOUT = 2


def _vime(args: list[str], repo_root, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def tool_use_run(tmp_path_factory, ray_head, repo_root, new_prefect_home, session_prefect_api):
    tmp = tmp_path_factory.mktemp("tool-use")
    store = tmp / "store"
    env = {**os.environ, "PREFECT_HOME": str(new_prefect_home(tmp / "prefect"))}
    t0 = time.monotonic()
    done = _vime(
        [
            "train",
            "--config",
            RECIPE,
            "--run-name",
            RUN,
            "--storage-uri",
            str(store),
            "--ray-address",
            ray_head,
            "--num-rollout",
            str(NUM_ROLLOUT),
        ],
        repo_root,
        env,
        timeout_s=540,
    )
    seconds = time.monotonic() - t0
    try:
        assert done.returncode == 0, f"stdout: {done.stdout[-4000:]}\nstderr: {done.stderr[-4000:]}"
        summary = json.loads(done.stdout[done.stdout.index('{\n  "run_name"') :])  # `vime train` prints it last
        yield store, summary, env, seconds
    finally:
        # a flow run too: on the session's Prefect server, not a temporary one of its own
        teardown_env = {**env, "PREFECT_API_URL": session_prefect_api}
        _vime(["teardown", "--run-name", RUN, "--ray-address", ray_head], repo_root, teardown_env, timeout_s=120)


def _stored(store):
    from vime_core.storage import BatchStore

    return [BatchStore(str(store)).read(RUN, k) for k in range(NUM_ROLLOUT)]


def test_the_recipe_trains_and_stores_every_sample_turn_by_turn(tool_use_run):
    from transformers import AutoTokenizer

    from recipes.tool_use.calculator import CALCULATOR, evaluate, final_answer
    from vime_core.data.turns import turns_error, turns_of

    store, summary, _, seconds = tool_use_run
    assert summary["iterations"] == NUM_ROLLOUT
    print(f"vime train, {NUM_ROLLOUT} iterations of the recipe: {seconds:.0f} s")
    calls = answered = multi_turn = 0
    for k, (batch, lineage) in enumerate(_stored(store)):
        tokenizer = AutoTokenizer.from_pretrained(lineage["model_id"])  # the model the run built
        versions = {span["version"] for spans in batch["weight_versions"] for span in spans}
        assert versions == {k + 1}
        for row in range(len(batch["tokens"])):
            p, r = batch["prompt_length"][row], batch["response_length"][row]
            response, mask = batch["tokens"][row][p:], batch["loss_mask"][row]
            turns = turns_of(batch["metadata"][row], r)
            assert turns and turns_error(turns, r, mask) is None, (row, turns)
            assert json.loads(batch["metadata"][row])["turns"], "every sample of the recipe records its turns"
            multi_turn += sum(t["role"] == "model" for t in turns) > 1
            for t in turns:
                ids = response[t["start"] : t["end"]]
                text = tokenizer.decode(ids, skip_special_tokens=True)
                if t["role"] == "model":
                    assert all(mask[t["start"] : t["end"]]), (row, t)
                    assert "=" not in text[:-1], (row, t, text)  # the stop string ended the turn at its first '='
                    continue
                calls += 1
                answered += bool(ids)
                assert not any(mask[t["start"] : t["end"]])
                before = tokenizer.decode(response[: t["start"]], skip_special_tokens=True)
                expected = CALCULATOR(before)  # the calculator's answer to the text the engine generated
                assert (t["call"], t["output"], t.get("error")) == (expected.call, expected.output, expected.error)
                if text != expected.output:  # cut to the response budget: the sample's last span
                    assert expected.output.startswith(text) and t["end"] == r and batch["status"][row] == "truncated"
            prompt = tokenizer.decode(batch["tokens"][row][:p], skip_special_tokens=True)
            whole = tokenizer.decode(response, skip_special_tokens=True)
            solved = (
                batch["status"][row] == "completed"
                and batch["finish_reason"][row] == "stop"
                and final_answer(whole) is not None
                and int(final_answer(whole)) == evaluate(prompt)
            )
            assert batch["raw_reward"][row] == (1.0 if solved else 0.0), (row, prompt, whole)
    assert calls and answered and multi_turn, (calls, answered, multi_turn)


def test_vime_lineage_shows_a_stored_sample_turn_by_turn(tool_use_run, repo_root):
    from transformers import AutoTokenizer

    from vime_core.data.turns import turns_of

    store, _, env, _ = tool_use_run
    batch, lineage = _stored(store)[0]
    row = next(
        i
        for i, m in enumerate(batch["metadata"])
        if any(t["role"] == "tool" and t["end"] > t["start"] for t in turns_of(m, batch["response_length"][i]))
    )
    done = _vime(
        ["lineage", "--storage-uri", str(store), "--run", RUN, "--turns", "0", "--sample", str(row)],
        repo_root,
        env,
        timeout_s=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [shown] = json.loads(done.stdout)
    assert shown["row"] == row and shown["check"] == "ok"
    roles = [t["role"] for t in shown["turns"]]
    assert "tool" in roles and roles == [("model", "tool")[i % 2] for i in range(len(roles))]
    for t in shown["turns"]:
        assert t["trained_tokens"] == (len(t["token_ids"]) if t["role"] == "model" else 0)
    response_ids = batch["tokens"][row][batch["prompt_length"][row] :]
    assert sum((t["token_ids"] for t in shown["turns"]), []) == response_ids
    tokenizer = AutoTokenizer.from_pretrained(lineage["model_id"])
    assert "".join(t["text"] for t in shown["turns"]) == tokenizer.decode(response_ids, skip_special_tokens=False)
    assert shown["prompt"] == tokenizer.decode(
        batch["tokens"][row][: batch["prompt_length"][row]], skip_special_tokens=False
    )
