"""Which prompt rows can be trained on, checked while a prompt source loads (training and eval). A bad
row stops the load in one line (source, row, reason, how many are bad), or with drop_bad_prompts is
dropped and counted, the same rows on every load so the resume fingerprint holds. Messages never
hold a prompt's text, which may be private. Labels are not checked: that is the reward's business."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from vime_core.builtin_rewards import LABEL_READING_REWARDS

log = logging.getLogger(__name__)

FIRST_ROWS = 5  # row numbers named per reason in a summary


def _rows(numbers: list[int]) -> str:
    """e.g. "row 3", "rows 3, 17", "rows 1, 2, 3, 4, 5, ..." (`numbers`: the first FIRST_ROWS + 1
    row numbers, or all when fewer)"""
    named = ", ".join(str(r) for r in numbers[:FIRST_ROWS]) + (", ..." if len(numbers) > FIRST_ROWS else "")
    return f"row{'s' if len(numbers) > 1 else ''} {named}"


def prompt_problem(record: dict, input_key: str) -> Optional[tuple[str, str]]:
    """(reason, one line saying why) for a row whose prompt cannot be used, else None:

        missing    the row has no field input_key
        null       None ("None" would be trained on as text)
        empty      "" or only whitespace, an empty message list (the engines answer a 400)
        not text   anything but a str or a list of chat messages (dicts with a "role")

    Nothing of the prompt's text goes into the line."""
    if input_key not in record:
        return "missing", f"no field {input_key!r} (input_key); fields: {sorted(record)}"
    prompt = record[input_key]
    what = f"the prompt field {input_key!r}"
    if prompt is None:
        return "null", f"{what} is null"
    if isinstance(prompt, str):
        return ("empty", f"{what} is empty or only whitespace") if not prompt.strip() else None
    if isinstance(prompt, list):
        if not prompt:
            return "empty", f"{what} is an empty list of messages"
        if all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
            return None
        return "not text", f"{what} is a list but not of chat messages (objects with a 'role'), nor text"
    return "not text", f"{what} is of type {type(prompt).__name__}, not text or a list of chat messages"


def length_problem(num_tokens: int, max_len: int, input_key: str, templated: bool) -> Optional[tuple[str, str]]:
    """(reason, line) for a tokenised prompt of `num_tokens` that cannot be used, else None."""
    what = f"the prompt field {input_key!r}"
    after = " after the chat template" if templated else ""
    if num_tokens == 0:
        return "empty", f"{what} has no token{after}"
    if num_tokens > max_len:
        return "too long", f"{what} has {num_tokens} tokens{after}, more than rollout_max_prompt_len={max_len}"
    return None


@dataclass
class BadRows:
    """The bad rows of one source, in row order: `add` each, then `settle` once."""

    where: str  # the source, as messages name it
    input_key: str
    max_len: int  # rollout_max_prompt_len
    counts: dict[str, int] = field(default_factory=dict)  # reason -> bad rows
    rows: dict[str, list[int]] = field(default_factory=dict)  # reason -> its first FIRST_ROWS + 1 rows
    first: Optional[tuple[int, str, str]] = None  # (row, reason, line) of the first bad row

    def add(self, row: int, reason: str, line: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        rows = self.rows.setdefault(reason, [])
        rows += [row] if len(rows) <= FIRST_ROWS else []
        if self.first is None:
            self.first = (row, reason, line)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """e.g. "2 null (rows 3, 17), 1 longer than rollout_max_prompt_len=1024 tokens (row 8)"."""
        says = {
            "missing": f"without field {self.input_key!r}",
            "too long": f"longer than rollout_max_prompt_len={self.max_len} tokens",
        }
        return ", ".join(
            f"{self.counts[reason]} {says.get(reason, reason)} ({_rows(rows)})" for reason, rows in self.rows.items()
        )

    def settle(self, num_rows: int, drop: bool) -> None:
        """Refuse the source (drop False) or warn once about what was dropped (drop True); a
        source whose every row is bad fails either way. KeyError when the named row lacks the
        field (as a missing column), else ValueError: both are configuration or data errors
        that the train flow does not retry (vime_core/faults.py)."""
        if self.first is None:
            return
        row, reason, line = self.first
        of = f"{self.total} of {num_rows} rows"
        if not drop:
            error = KeyError if reason == "missing" else ValueError
            raise error(
                f"prompt data {self.where}, row {row}: {line}; {of} {'is' if self.total == 1 else 'are'} bad: "
                f"{self.summary()} (set --drop-bad-prompts to drop such rows)"
            )
        if self.total == num_rows:
            raise ValueError(
                f"prompt data {self.where}: every row is bad, no prompt left ({self.summary()}; row {row}: {line})"
            )
        log.warning("prompt data %s: dropped %s (drop_bad_prompts): %s", self.where, of, self.summary())


def warn_partial_labels(where: str, unlabelled: list[int], num_unlabelled: int, num_kept: int, label_key: str) -> None:
    """One warning when some of the `num_kept` rows kept have a label and `num_unlabelled` none
    (most likely a data error); `unlabelled`: the first of those rows' numbers (FIRST_ROWS + 1 suffice)."""
    if 0 < num_unlabelled < num_kept:
        log.warning(
            "prompt data %s: %s (%d of %d prompts) have no label (label_key %r); the reward function gets "
            "None for them",
            where,
            _rows(unlabelled),
            num_unlabelled,
            num_kept,
            label_key,
        )


def refuse_unlabelled(where: str, num_kept: int, num_unlabelled: int, cfg, columns: list[str]) -> None:
    """No row kept has a label: with a built-in reward that scores against the label, every
    reward would be that of a wrong answer and every group's advantage 0 (a run that learns
    nothing and says nothing), so the source is refused naming label_key and the columns it has;
    with a reward function of the user's (which may not read labels), one warning."""
    if num_kept == 0 or num_unlabelled < num_kept:
        return
    says = f"prompt data {where}: no row has label_key {cfg.label_key!r} (its columns: {', '.join(columns)})"
    if not cfg.custom_rm_path and cfg.rm_type in LABEL_READING_REWARDS:
        raise ValueError(f"{says}; rm_type={cfg.rm_type!r} scores against the label: set --label-key")
    log.warning("%s; the reward function gets None as every label", says)
