"""The DP schedule: which samples each data-parallel rank trains on, in which step and micro-batch.
Every rank runs the same number of forward/backward passes per step, or the gradient all-reduce of
the last micro-batch would wait forever."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class DPSchedule:
    """micro_batches[rank][step] is that rank's list of micro-batches (lists of sample indices)."""

    num_steps: int
    dp_size: int
    num_microbatches: list[int]
    micro_batches: list[list[list[list[int]]]] = field(repr=False)

    def partition(self, rank: int) -> list[int]:
        """Every sample index rank `rank` trains on, in schedule order (step, micro-batch)."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is outside dp_size {self.dp_size}")
        return [i for step in self.micro_batches[rank] for mb in step for i in mb]


def build_dp_schedule(
    total_lengths: Sequence[int],
    global_batch_size: int,
    dp_size: int,
    micro_batch_size: int,
    max_tokens_per_gpu: Optional[int] = None,
) -> DPSchedule:
    """Split N samples into steps, DP ranks and micro-batches (rules below).

        num_steps      = N // global_batch_size            (N must be a multiple; nothing is dropped)
        per_rank       = global_batch_size // dp_size
        fixed size:    rank r of step s takes per_rank contiguous samples from
                       s*global_batch_size + r*per_rank, cut in order into micro_batch_size pieces
        token budget:  the step's samples dealt to ranks longest first, to the rank with the fewest
                       tokens that has room; each rank packs them first-fit decreasing into micro-batches
                       of at most max_tokens_per_gpu tokens (a longer sample gets one of its own)
        counts:        ranks with fewer micro-batches split their fullest in two until all match

    No empty micro-batch is made."""
    n = len(total_lengths)
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("dp_size", dp_size),
        ("micro_batch_size", micro_batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if max_tokens_per_gpu is not None and max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu={max_tokens_per_gpu} must be >= 1")
    if n == 0 or n % global_batch_size:
        raise ValueError(f"{n} samples are not a positive multiple of global_batch_size={global_batch_size}")
    if global_batch_size % dp_size:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
    num_steps = n // global_batch_size
    per_rank = global_batch_size // dp_size
    micro_batches: list[list[list[list[int]]]] = [[] for _ in range(dp_size)]
    num_microbatches: list[int] = []
    for step in range(num_steps):
        start = step * global_batch_size
        step_indices = list(range(start, start + global_batch_size))
        if max_tokens_per_gpu is None:
            per_rank_mbs = [
                _fixed_micro_batches(step_indices[r * per_rank : (r + 1) * per_rank], micro_batch_size)
                for r in range(dp_size)
            ]
        else:
            ranks = _balance_over_ranks(step_indices, total_lengths, dp_size, per_rank)
            per_rank_mbs = [_pack_first_fit_decreasing(idx, total_lengths, max_tokens_per_gpu) for idx in ranks]
            count = max(len(m) for m in per_rank_mbs)
            per_rank_mbs = [_split_to_count(m, count) for m in per_rank_mbs]
        num_microbatches.append(len(per_rank_mbs[0]))
        for rank in range(dp_size):
            micro_batches[rank].append(per_rank_mbs[rank])
    return DPSchedule(num_steps, dp_size, num_microbatches, micro_batches)


def _fixed_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def _balance_over_ranks(indices: list[int], lengths: Sequence[int], dp_size: int, per_rank: int) -> list[list[int]]:
    """Longest first, each to the rank with the fewest tokens that has room; sorted back per rank."""
    tokens = [0] * dp_size
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        rank = min((r for r in range(dp_size) if len(ranks[r]) < per_rank), key=lambda r: (tokens[r], r))
        ranks[rank].append(i)
        tokens[rank] += lengths[i]
    return [sorted(r) for r in ranks]


def _pack_first_fit_decreasing(indices: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def _split_to_count(bins: list[list[int]], count: int) -> list[list[int]]:
    """Split the bin with the most samples in two until there are `count` bins."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        largest = max(range(len(bins)), key=lambda b: len(bins[b]))
        if len(bins[largest]) < 2:
            raise ValueError(f"cannot make {count} micro-batches from {sum(map(len, bins))} samples")
        half = len(bins[largest]) // 2
        bins[largest : largest + 1] = [bins[largest][:half], bins[largest][half:]]
    return bins
