"""What the trainer can train on: one check, applied by the rollout side before a batch is handed on,
by the trainer before it trains, and on resume to a stored batch. A batch (one entry per sample in
every column) is trainable when it has the required columns (vime_core/data/columns.py), at least
one sample, and for every sample i

    len(tokens_i) == prompt_length_i + response_length_i    (when prompt_length is present)
    len(tokens_i) == total_length_i                          (when total_length is present)
    len(loss_mask_i) == response_length_i
    len(rollout_log_probs_i) in {0, response_length_i}
    routed_experts_i null, or a [rows, layers, top_k] array with rows <= len(tokens_i) - 1
    prompt_length_i >= 1, response_length_i >= 1
    no tool token trained: a sample whose metadata records turns (multi-turn, data/turns.py) has
    spans covering its response and loss mask 0 on every tool span (turns_error)

`lengths_only` (what the store checks) drops the last rule. Where a set flag reads the engines'
log-probs (config.derive.rollout_logprob_readers), len(rollout_log_probs_i) == response_length_i
with no entry MISSING_LOGPROB or NaN, or the trainer would train on -9999 for a log-prob."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Optional, Sequence

from vime_core.data import routed_experts
from vime_core.data.columns import REQUIRED_COLUMNS
from vime_core.data.sample import MISSING_LOGPROB, MISSING_LOGPROBS_ENGINE
from vime_core.data.turns import turns_error, turns_of


class UntrainableBatchError(ValueError):
    """The batch breaks a rule of the module docstring; the message names the column, the row,
    and the sample's group, index and prompt id where the batch has them."""


def _where(batch: Mapping[str, Sequence[Any]], i: int) -> str:
    parts = []
    if "group_index" in batch and "index" in batch:
        parts.append(f"group {batch['group_index'][i]} index {batch['index'][i]}")
    if "prompt_id" in batch:
        parts.append(f"prompt {batch['prompt_id'][i]!r}")
    return f"sample {i}" + (f" ({', '.join(parts)})" if parts else "")


def _engine_of(metadata: Any) -> str:
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except ValueError:
            metadata = None
    engine = metadata.get(MISSING_LOGPROBS_ENGINE) if isinstance(metadata, dict) else None
    return f"engine {engine}" if engine else "the engine"


def _needed_by(readers: Sequence[str], what: str) -> str:
    return f"{' and '.join(readers)} need{'s' if len(readers) == 1 else ''} {what}"


def log_probs_error(
    where: str, log_probs: Optional[Sequence[float]], response_length: int, metadata: Any, readers: Sequence[str]
) -> Optional[str]:
    """The one-line refusal of a sample whose rollout_log_probs cannot serve `readers` (the set
    flags that read them; module docstring), or None. `where` names the sample; `metadata` is
    its metadata (dict or JSON string), which may name the engine."""
    if not readers:
        return None
    need = _needed_by(readers, "them")
    if not log_probs and response_length == 0:
        return None
    if not log_probs:
        return f"{where}: rollout_log_probs is empty (generated without asking the engines for log-probs), and {need}"
    if len(log_probs) != response_length:
        return f"{where}: rollout_log_probs has {len(log_probs)} entries, response_length={response_length}, and {need}"
    missing = sum(1 for x in log_probs if x is None or math.isnan(x) or x <= MISSING_LOGPROB)
    if missing:
        return (
            f"{where}: rollout_log_probs lacks {missing} of {response_length} log-probs: {_engine_of(metadata)} "
            f"answered without them (field logprobs.content[j].logprob of its choice), and {need}"
        )
    return None


def validate_trainable(
    batch: Mapping[str, Sequence[Any]], *, lengths_only: bool = False, log_prob_readers: Sequence[str] = ()
) -> int:
    """The number of samples; raises UntrainableBatchError at the first broken rule.
    `log_prob_readers`: the set flags that read rollout_log_probs (module docstring)."""
    missing = [c for c in REQUIRED_COLUMNS if c not in batch]
    if missing:
        raise UntrainableBatchError(f"rollout batch lacks column(s) {missing}; it has {sorted(batch)}")
    if log_prob_readers and "rollout_log_probs" not in batch:
        raise UntrainableBatchError(
            f"rollout batch has no column 'rollout_log_probs', and {_needed_by(log_prob_readers, 'it')}"
        )
    n = len(batch["tokens"])
    if n == 0 and not lengths_only:
        raise UntrainableBatchError("rollout batch has no samples")
    for name, column in batch.items():
        if isinstance(column, (list, tuple)) and len(column) != n:
            raise UntrainableBatchError(f"rollout batch column {name!r} has {len(column)} rows, 'tokens' has {n}")
    prompt_lengths = batch.get("prompt_length")
    total_lengths = batch.get("total_length")
    log_probs = batch.get("rollout_log_probs")
    metadata_column = batch.get("metadata")
    for i in range(n):
        r = int(batch["response_length"][i])
        n_tokens = len(batch["tokens"][i])
        if r < 1 and not lengths_only:
            metadata = batch.get("metadata")
            why = f"; {metadata[i]}" if metadata is not None and metadata[i] not in (None, "", "{}") else ""
            raise UntrainableBatchError(f"{_where(batch, i)}: response_length={r}, no response to train on{why}")
        if prompt_lengths is not None:
            p = int(prompt_lengths[i])
            if p < 1 and not lengths_only:
                raise UntrainableBatchError(f"{_where(batch, i)}: prompt_length={p} must be >= 1")
            if n_tokens != p + r:
                raise UntrainableBatchError(
                    f"{_where(batch, i)}: {n_tokens} tokens != prompt_length {p} + response_length {r}"
                )
        elif n_tokens <= r and not lengths_only:
            raise UntrainableBatchError(
                f"{_where(batch, i)}: response_length={r} leaves no prompt token of its {n_tokens}"
            )
        if total_lengths is not None and int(total_lengths[i]) != n_tokens:
            raise UntrainableBatchError(
                f"{_where(batch, i)}: total_length={int(total_lengths[i])} != {n_tokens} tokens"
            )
        if len(batch["loss_mask"][i]) != r:
            raise UntrainableBatchError(
                f"{_where(batch, i)}: loss_mask has {len(batch['loss_mask'][i])} entries, response_length={r}"
            )
        if metadata_column is not None:  # a multi-turn sample's tool tokens are never trained (data/turns.py)
            error = turns_error(turns_of(metadata_column[i], r), r, batch["loss_mask"][i])
            if error:
                raise UntrainableBatchError(f"{_where(batch, i)}: {error}")
        if log_probs is not None and log_probs[i] is not None and len(log_probs[i]) not in (0, r):
            raise UntrainableBatchError(
                f"{_where(batch, i)}: rollout_log_probs has {len(log_probs[i])} entries, response_length={r}"
            )
        experts = batch.get("routed_experts")
        if experts is not None and experts[i] is not None:
            try:
                rows = routed_experts.decode(experts[i]).shape[0]
            except routed_experts.RoutedExpertsError as exc:
                raise UntrainableBatchError(f"{_where(batch, i)}: {exc}") from None
            if rows > n_tokens - 1:
                raise UntrainableBatchError(
                    f"{_where(batch, i)}: routed_experts has {rows} rows for {n_tokens} tokens (at most {n_tokens - 1})"
                )
        if log_prob_readers:
            metadata = batch.get("metadata")
            error = log_probs_error(
                _where(batch, i), log_probs[i], r, metadata[i] if metadata is not None else None, log_prob_readers
            )
            if error:
                raise UntrainableBatchError(error)
    return n
