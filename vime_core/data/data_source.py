"""The prompt data source: rows of a prompt source -> groups of Samples, with exact resume
(`state_dict` / `load_state_dict` continue where a saved source stopped, checked by a fingerprint
of the kept rows)."""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


from vime_core.data.prompt_checks import (
    FIRST_ROWS,
    BadRows,
    length_problem,
    prompt_problem,
    refuse_unlabelled,
    warn_partial_labels,
)
from vime_core.data.sample import Sample
from vime_core.data.sources import describe, read_records

STATE_VERSION = 1


@dataclass
class PromptRow:
    prompt_id: str
    prompt: Any  # str, or a list of chat messages
    label: Any = None
    metadata: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)


# ---- reading ------------------------------------------------------------------------------------


@dataclass
class LoadedPrompts:
    rows: list[PromptRow]  # the usable rows, in the source's order
    dropped: dict[str, int]  # reason -> rows dropped with drop_bad_prompts (prompt_checks.py)


def read_prompt_rows(path: str, cfg, tokenizer: Any = None, split: Optional[str] = None) -> LoadedPrompts:
    """Rows of a prompt source (also the eval set; `split` of a folder or hub dataset, default
    cfg.prompt_data_split), each checked (vime_core/data/prompt_checks.py) and, when a tokenizer
    is given, tokenised and checked for length (below).

    prompt = row[cfg.input_key] (text or chat messages), label = row[cfg.label_key], prompt_id =
    row["prompt_id"] else "row-<i>", the other columns in metadata. A bad or too long prompt stops the
    load, or is dropped and counted with cfg.drop_bad_prompts (prompt_checks.py)."""
    split = split or cfg.prompt_data_split
    where = describe(path, split)
    records = read_records(path, split)
    if not records:
        raise ValueError(f"prompt data {where}: no rows")
    bad = BadRows(where, cfg.input_key, cfg.rollout_max_prompt_len)
    rows: list[PromptRow] = []
    unlabelled: list[int] = []  # the first few rows kept without a label, and how many
    num_unlabelled = 0
    for i, record in enumerate(records):
        problem = prompt_problem(record, cfg.input_key)
        prompt = record.get(cfg.input_key)
        tokens: list[int] = []
        if problem is None and tokenizer is not None:
            tokens = tokenize_prompt(tokenizer, prompt, cfg.apply_chat_template, cfg.apply_chat_template_kwargs)
            templated = isinstance(prompt, list) or cfg.apply_chat_template
            problem = length_problem(len(tokens), cfg.rollout_max_prompt_len, cfg.input_key, templated)
        if problem is not None:
            bad.add(i, *problem)
            continue
        prompt_id = str(record["prompt_id"]) if record.get("prompt_id") is not None else f"row-{i}"
        extra = {k: v for k, v in record.items() if k not in (cfg.input_key, cfg.label_key, "prompt_id")}
        rows.append(PromptRow(prompt_id, prompt, record.get(cfg.label_key), extra, tokens))
        if rows[-1].label is None:
            num_unlabelled += 1
            unlabelled += [i] if len(unlabelled) <= FIRST_ROWS else []
    bad.settle(len(records), cfg.drop_bad_prompts)
    warn_partial_labels(where, unlabelled, num_unlabelled, len(rows), cfg.label_key)
    refuse_unlabelled(where, len(rows), num_unlabelled, cfg, sorted({k for r in records[:FIRST_ROWS] for k in r}))
    return LoadedPrompts(rows, bad.counts)


def load_prompt_rows(path: str, cfg, tokenizer: Any = None, split: Optional[str] = None) -> list[PromptRow]:
    """The usable rows of `read_prompt_rows`."""
    return read_prompt_rows(path, cfg, tokenizer, split).rows


def tokenize_prompt(
    tokenizer: Any, prompt: Any, apply_chat_template: bool, chat_template_kwargs: Optional[dict] = None
) -> list[int]:
    """Token ids of a prompt; chat-formatted (with the generation prompt, and
    `chat_template_kwargs` passed to the template, e.g. enable_thinking) when asked or when the
    prompt is a message list."""
    if isinstance(prompt, list) or apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(str(prompt)))


def load_tokenizer(cfg) -> Any:
    if not cfg.hf_checkpoint:
        raise ValueError("hf_checkpoint is empty: the data source needs its tokenizer (or pass tokenizer=)")
    # boundary: the driver imports this module (through the RolloutManager's class) and must not load
    # transformers, which imports torch; only the RolloutManager's process loads a tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.hf_checkpoint)


# ---- the source -----------------------------------------------------------------------------------


class DataSource:
    def __init__(self, cfg, path: Optional[str] = None, tokenizer: Any = None) -> None:
        self.path = path or cfg.prompt_data
        self.split = cfg.prompt_data_split
        if not self.path:
            raise ValueError("prompt_data is empty: give the prompt dataset (run_assets fills in the embedded task)")
        self.n_samples_per_prompt = cfg.n_samples_per_prompt
        self.run_name = cfg.run_name
        self.shuffle = cfg.rollout_shuffle
        self.seed = cfg.seed
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        loaded = read_prompt_rows(self.path, cfg, tokenizer, self.split)
        self.rows, self.dropped = loaded.rows, loaded.dropped
        self.fingerprint = hashlib.sha256(
            json.dumps([[r.prompt_id, r.tokens] for r in self.rows]).encode()
        ).hexdigest()[:16]
        self.epoch = 0
        self.cursor = 0
        self.next_group_index = 0
        self.buffer: list[list[Sample]] = []
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _next_row(self) -> PromptRow:
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._epoch_order(self.epoch)
        row = self.rows[self._order[self.cursor]]
        self.cursor += 1
        return row

    def _new_group(self) -> list[Sample]:
        row = self._next_row()
        group_index = self.next_group_index
        self.next_group_index += 1
        template = Sample(
            prompt_id=row.prompt_id,
            prompt=row.prompt,
            label=row.label,
            tokens=list(row.tokens),
            prompt_length=len(row.tokens),
            group_index=group_index,
            metadata=dict(row.metadata),
        )
        group = []
        for index in range(self.n_samples_per_prompt):
            s = copy.deepcopy(template)
            s.index = index
            s.session_id = f"{self.run_name}-{group_index}-{index}"
            group.append(s)
        return group

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups: first those `add_back` returned (oldest first, partial responses included),
        then, for the next prompt of the epoch's order (random.Random(seed + epoch).shuffle, identity
        without rollout_shuffle), n_samples_per_prompt copies with group_index a run-wide counter, index
        the position in the group and session_id f"{run_name}-{group_index}-{index}"."""
        if num_groups < 0:
            raise ValueError(f"num_groups={num_groups} must be >= 0")
        groups = self.buffer[:num_groups]
        self.buffer = self.buffer[num_groups:]
        while len(groups) < num_groups:
            groups.append(self._new_group())
        return groups

    def add_back(self, samples: Iterable[Sample] | Iterable[list[Sample]]) -> None:
        """Take back aborted samples (a list of groups, or a flat list regrouped by group_index);
        they are handed out before any new prompt, oldest first."""
        items = list(samples)
        if not items:
            return
        if isinstance(items[0], list):
            groups = [list(g) for g in items if g]
        else:
            by_group: dict[int, list[Sample]] = {}
            for s in items:
                by_group.setdefault(s.group_index, []).append(s)
            groups = list(by_group.values())
        self.buffer.extend(groups)

    # ---- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "path": self.path,
            "split": self.split,
            "fingerprint": self.fingerprint,
            "num_rows": len(self.rows),
            "dropped_rows": dict(self.dropped),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "next_group_index": self.next_group_index,
            "buffer": [[copy.deepcopy(s.to_dict()) for s in g] for g in self.buffer],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data source state version {state.get('version')!r}; this code reads {STATE_VERSION}")
        if state["fingerprint"] != self.fingerprint or state["num_rows"] != len(self.rows):
            raise ValueError(
                f"data source state was saved for {state['path']} ({state['num_rows']} prompts"
                f"{_dropped(state.get('dropped_rows'))}, fingerprint {state['fingerprint']}); this source reads "
                f"{self.path} ({len(self.rows)} prompts{_dropped(self.dropped)}, {self.fingerprint})"
            )
        # The saved seed/shuffle win: they define the order the saved cursor points into.
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.next_group_index = int(state["next_group_index"])
        self.buffer = [[Sample.from_dict(copy.deepcopy(d)) for d in g] for g in state["buffer"]]
        self._order = self._epoch_order(self.epoch)


def _dropped(counts: Optional[dict]) -> str:
    """ ", 3 rows dropped (2 null, 1 too long)" for a state's drop counts; "" for none."""
    if not counts:
        return ""
    total = sum(counts.values())
    reasons = ", ".join(f"{n} {reason}" for reason, n in counts.items())
    return f", {total} row{'s' if total > 1 else ''} dropped ({reasons})"
