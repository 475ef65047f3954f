"""What the trainer can train on: one check, applied by the rollout side before a batch is handed
on (so nothing untrainable is stored), by the trainer before it trains, and on resume to a batch
found in the store.

A batch (dict of columns, one entry per sample) is trainable when it has the columns the trainer
reads, every column has one entry per sample, and for every sample i

    prompt_length_i >= 1, response_length_i >= 1      (a response needs a prompt token before it)
    len(tokens_i) == prompt_length_i + response_length_i   (when prompt_length is present)
    len(loss_mask_i) == response_length_i
    len(rollout_log_probs_i) in {0, response_length_i}

A sample whose reward function failed keeps its response and a zero loss mask: trainable. A sample
the engines never answered has no response: not trainable.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

REQUIRED_COLUMNS = ("tokens", "response_length", "loss_mask")


class UntrainableBatchError(ValueError):
    """The batch breaks a rule of the module docstring; the message names the column, the row
    and the sample's prompt id when the batch has one."""


def _where(batch: Mapping[str, Sequence[Any]], i: int) -> str:
    prompt = batch.get("prompt_id")
    return f"sample {i}" + (f" (prompt {prompt[i]!r})" if prompt is not None else "")


def validate_trainable(batch: Mapping[str, Sequence[Any]]) -> int:
    """The number of samples; raises UntrainableBatchError at the first broken rule."""
    missing = [c for c in REQUIRED_COLUMNS if c not in batch]
    if missing:
        raise UntrainableBatchError(f"rollout batch lacks column(s) {missing}; it has {sorted(batch)}")
    n = len(batch["tokens"])
    if n == 0:
        raise UntrainableBatchError("rollout batch has no samples")
    for name, column in batch.items():
        if isinstance(column, (list, tuple)) and len(column) != n:
            raise UntrainableBatchError(f"rollout batch column {name!r} has {len(column)} rows, 'tokens' has {n}")
    prompt_lengths = batch.get("prompt_length")
    log_probs = batch.get("rollout_log_probs")
    for i in range(n):
        r = int(batch["response_length"][i])
        if r < 1:
            metadata = batch.get("metadata")
            why = f"; {metadata[i]}" if metadata is not None and metadata[i] not in (None, "", "{}") else ""
            raise UntrainableBatchError(f"{_where(batch, i)}: response_length={r}, no response to train on{why}")
        if prompt_lengths is not None:
            p = int(prompt_lengths[i])
            if p < 1:
                raise UntrainableBatchError(f"{_where(batch, i)}: prompt_length={p} must be >= 1")
            if len(batch["tokens"][i]) != p + r:
                raise UntrainableBatchError(
                    f"{_where(batch, i)}: {len(batch['tokens'][i])} tokens != prompt_length {p} + response_length {r}")
        elif len(batch["tokens"][i]) <= r:
            raise UntrainableBatchError(f"{_where(batch, i)}: response_length={r} leaves no prompt token of its {len(batch['tokens'][i])}")
        if len(batch["loss_mask"][i]) != r:
            raise UntrainableBatchError(f"{_where(batch, i)}: loss_mask has {len(batch['loss_mask'][i])} entries, response_length={r}")
        if log_probs is not None and log_probs[i] is not None and len(log_probs[i]) not in (0, r):
            raise UntrainableBatchError(f"{_where(batch, i)}: rollout_log_probs has {len(log_probs[i])} entries, response_length={r}")
    return n
