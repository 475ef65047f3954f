"""Multi-turn tool use with a calculator: the hooks of the recipes in this folder.

The protocol fits the tiny model's alphabet (digits, + - * = > and space), so the embedded CPU
model exercises it as a real model on a GPU does:

    prompt     3*4+5
    response   3*4=12+5=17>17<eos>
               ^^^^            model turn 0, ends at '=' (the call marker, a stop string)
                   ^^          tool turn 0: the calculator's answer, loss mask 0
                     ^^^       model turn 1, ends at '='
                        ^^     tool turn 1
                          ^^^^^^^^ model turn 2: '>', the final answer, EOS

A call evaluates the expression written right before its '=': the longest run of digits and
+ - * there (spaces around an operator are dropped, so "3 * 4 =" calls 3*4; "12 3*4=" calls 3*4),
which must read as integers joined by + - * (a minus may also sign a number); * binds tighter
than + and -. So "3*4=12+5=" chains the first result into the second call. A run that does
not read so, a number of more than MAX_DIGITS digits, or a result of more than MAX_DIGITS digits,
is an error: the tool appends nothing and the turn's span records why.

`generate` (custom_generate_function_path) runs up to MAX_TURNS model turns
(vime_core/rollout/multi_turn.py); `reward` (custom_rm_path) scores the final answer only:

    reward = 1.0  when the sample ended on its own (EOS, not the length or the turn limit) and the
                  text after its last '>' is the label's integer
           = 0.0  otherwise

The reward reads the response text, so the recipes decode it with special tokens skipped
(rollout_skip_special_tokens): a special token's text such as '<bos>' or '<|endoftext|>' ends
with '>' and would otherwise read as the answer marker.

Recipe-level settings are this module's constants (the configuration has no field for them):
edit them, or point custom_generate_function_path at a function of your own that calls
generate_multi_turn with others.
"""

from __future__ import annotations

import re

from vime_core.data.sample import Sample, Status
from vime_core.rollout.multi_turn import ToolResult, generate_multi_turn
from vime_core.rollout.sandbox import SandboxedTool, SandboxLimits

MAX_TURNS = 4  # model turns per sample: at most 3 calculator calls
MAX_DIGITS = 12  # per number in a call, and of a result
CALL_MARKER = "="
ANSWER_MARKER = ">"

_RUN = re.compile(r"[0-9+\-* ]*\Z")  # the characters a call's expression may use, up to the marker
_SPACES_AROUND_OPERATORS = re.compile(r"\s*([-+*])\s*")
_EXPRESSION = re.compile(r"-?\d+(?:[-+*]-?\d+)*")
_TERM = re.compile(r"(^|[-+*])(-?\d+)")
_INTEGER = re.compile(r"-?\d+")


def evaluate(expression: str) -> int:
    """The value of integers joined by + - * (module docstring); ValueError when it is not one."""
    if not _EXPRESSION.fullmatch(expression):
        raise ValueError(f"{expression!r} is not integers joined by + - *")
    total, term = 0, None
    for op, number in _TERM.findall(expression):
        if len(number.lstrip("-")) > MAX_DIGITS:
            raise ValueError(f"{number} has more than {MAX_DIGITS} digits")
        value = int(number)
        if term is None:
            term = value
        elif op == "*":
            term *= value
        else:
            total, term = total + term, (value if op == "+" else -value)
    value = total + term
    if len(str(abs(value))) > MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return value


class Calculator:
    """The tool: answers the call that ends `response_text` (module docstring)."""

    call_marker = CALL_MARKER

    def __call__(self, response_text: str) -> ToolResult:
        text = response_text.rstrip()
        if text.endswith(CALL_MARKER):
            text = text[: -len(CALL_MARKER)]
        run = _SPACES_AROUND_OPERATORS.sub(r"\1", _RUN.search(text.rstrip()).group(0).strip())
        call = run.rsplit(" ", 1)[-1]  # "12 3*4" calls 3*4
        try:
            return ToolResult(call=call, output=str(evaluate(call)))
        except ValueError as exc:
            return ToolResult(call=call, output="", error=str(exc))


CALCULATOR = Calculator()


def answer(response_text: str) -> dict:
    """The calculator's answer as JSON values: what the sandboxed calculator's child returns."""
    result = CALCULATOR(response_text)
    return {"call": result.call, "output": result.output, "error": result.error}


# The rollout's calls run in the sandbox (vime_core/rollout/sandbox.py): the calculator reads text
# the model wrote, so a call gets a time and memory limit and no file system or network.
SANDBOXED_CALCULATOR = SandboxedTool(
    "recipes.tool_use.calculator:answer", CALL_MARKER, SandboxLimits(wall_s=5.0, memory_mb=256)
)


async def generate(ctx, sample: Sample, sampling_params: dict) -> Sample:
    """The custom generate hook: up to MAX_TURNS model turns, the sandboxed calculator between them."""
    return await generate_multi_turn(ctx, sample, sampling_params, SANDBOXED_CALCULATOR, MAX_TURNS)


def final_answer(response: str) -> str | None:
    """The text after the last ANSWER_MARKER when it is an integer, else None."""
    if ANSWER_MARKER not in response:
        return None
    tail = response.rsplit(ANSWER_MARKER, 1)[1].strip()
    return tail if _INTEGER.fullmatch(tail) else None


def reward(sample: Sample) -> float:
    """1.0 for the label's integer after the last '>' of a sample that ended on its own."""
    if sample.status is not Status.COMPLETED or sample.finish_reason != "stop":
        return 0.0
    answer = final_answer(sample.response or "")
    return 1.0 if answer is not None and int(answer) == int(str(sample.label).strip()) else 0.0
