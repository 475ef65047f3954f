"""Top-k / top-p truncation of the trainer's log-probs, so they score the distribution the engine sampled.

vLLM (processed_logprobs) samples from the tempered distribution y = z / T truncated to a kept set S
and renormalised: log p'(a) = y_a - logsumexp_{v in S} y_v. S is vLLM's (topk_topp_sampler.py, 0.32):
the k largest y, then of those the smallest most-probable set whose renormalised mass reaches p
(a token is kept iff the mass strictly before it is < p). A row's S is two numbers, the boundary
value tau and the weight w_tie of each token tied at it (only the count kept of a tie matters):

    w_v = 1 (y_v > tau),  w_tie (y_v = tau: c / g, or (c - 1) / (g - 1) when a is one of them),  0 (y_v < tau)
    w_a = 1 always: a sampled token the trainer's logits leave out is added, so its log-prob is finite

and every sum over S becomes sum_v w_v (...): lse = log sum_v w_v e^{y_v}, H = lse - sum_v w_v p_v y_v,
d log p'(a) / d y_v = [v = a] - w_v p_v. The selection has no gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch

# Values gathered per rank and row in the first round of top-p without top-k, and the factor by
# which rows whose nucleus reaches past them gather again.
FIRST_CANDIDATES = 256
GROWTH = 8


@dataclass(frozen=True)
class Sampling:
    """What the engine sampled with: temperature, top-k (<= 0: off), top-p (1: off)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @classmethod
    def of(cls, cfg: Any) -> "Sampling":
        """The rollout's sampling (rollout_temperature, rollout_top_k, rollout_top_p)."""
        return cls(float(cfg.rollout_temperature), int(cfg.rollout_top_k), float(cfg.rollout_top_p))

    def top_k_on(self, vocab_size: int) -> bool:
        return 0 < self.top_k < vocab_size

    def truncates(self, vocab_size: int) -> bool:
        """Whether S can be smaller than the vocabulary."""
        return self.top_p < 1.0 or self.top_k_on(vocab_size)


def as_sampling(sampling: Union[float, Sampling]) -> Sampling:
    """A bare temperature is sampling without truncation."""
    return sampling if isinstance(sampling, Sampling) else Sampling(float(sampling))


class Collectives(Protocol):
    """The TP group's collectives the selection needs (``ProcessGroupCollectives``; tests
    simulate ranks in-process with their own)."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[ranks, *tensor.shape], in rank order."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """The elementwise "sum" or "max" over the ranks."""


class ProcessGroupCollectives:
    """``Collectives`` over a torch.distributed group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = torch.distributed.get_world_size(group)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        out = tensor.clone()
        reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(out, op=reduce_op, group=self.group)
        return out


@torch.no_grad()
def select(
    y: torch.Tensor,
    local: torch.Tensor,
    sampling: Sampling,
    vocab_size: int,
    width: int,
    comm: Optional[Collectives] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau, w_tie) per row (module docstring) of this rank's tempered logits ``y`` [r, C] over
    its real tokens; ``local``: each row's sampled token as a column of ``y`` (outside [0, C):
    another rank's); ``width``: the rank's column count with padding (C <= width), the same on
    every rank; ``comm``: the TP group (None: one rank). Every rank of the group must call it
    with the same rows and sampling.

    Each rank contributes its m largest values (m = k with top-k, else 256): the merged, sorted list is
    the exact global prefix down to the largest of the ranks' m-th values; rows whose crossing falls
    below it are gathered again with 8 m. The default (top_p 1, top_k off) never runs any of it."""
    rows_n = y.shape[0]
    k_on = sampling.top_k_on(vocab_size)
    k, p = sampling.top_k, sampling.top_p
    tau = y.new_empty(rows_n)
    kept_ties = y.new_empty(rows_n)  # c: how many tokens equal to tau are kept
    m = min(k if k_on else FIRST_CANDIDATES, width)
    rows: Optional[torch.Tensor] = None  # the rows still to resolve (None: all)
    mass: Optional[torch.Tensor] = None  # top-p without top-k: sum_v exp(y_v - max), every row
    while True:
        sub = y if rows is None else y.index_select(0, rows)
        merged, exact = _merged_top(sub, m, width, comm)
        top = merged[:, :1]  # the global max
        if k_on:
            merged = merged[:, :k]  # the top-k values, exact since m >= k (or all gathered)
            exact = torch.full_like(exact, merged.shape[1])
        pos = torch.arange(merged.shape[1], device=y.device).unsqueeze(0)
        if p < 1.0:
            q = torch.where(pos < exact.unsqueeze(1), (merged - top).exp(), 0.0)
            if k_on:
                total = q.sum(dim=1)
            else:
                if mass is None:  # first round: every row
                    mass = (y - top).exp().sum(dim=1) if y.shape[1] else y.new_zeros(rows_n)
                    mass = comm.all_reduce(mass, "sum") if comm is not None else mass
                total = mass if rows is None else mass.index_select(0, rows)
            excl = q.cumsum(dim=1) - q  # mass strictly before each position
            n = ((excl < p * total.unsqueeze(1)) & (pos < exact.unsqueeze(1))).sum(dim=1).clamp(min=1)
            reached = (excl + q).gather(1, (n - 1).unsqueeze(1)).squeeze(1) >= p * total
            done = reached | (m >= width) | k_on  # with top-k every candidate is in the list
        else:  # top-k only
            n = torch.full_like(exact, k)
            done = torch.ones_like(exact, dtype=torch.bool)
        t = merged.gather(1, (n - 1).unsqueeze(1)).squeeze(1)
        c = (n - (merged > t.unsqueeze(1)).sum(dim=1)).to(y.dtype)
        index = torch.arange(rows_n, device=y.device) if rows is None else rows
        tau.index_copy_(0, index[done], t[done])
        kept_ties.index_copy_(0, index[done], c[done])
        if bool(done.all()):  # the same on every rank: computed from gathered values
            break
        rows = index[~done]
        m = min(m * GROWTH, width)
    return tau, _tie_weight(y, local, tau, kept_ties, comm)


def _merged_top(
    sub: torch.Tensor, m: int, width: int, comm: Optional[Collectives]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(every rank's m largest values of ``sub`` merged and sorted descending [r, ranks * m],
    the length of its exact prefix [r]): every value above the largest of the ranks' m-th values
    L is in the list, so its entries >= L are the global sorted list's first ones."""
    rows, cols = sub.shape
    vals = sub.topk(min(m, cols), dim=1).values if cols else sub.new_empty(rows, 0)
    if vals.shape[1] < m:  # fewer real tokens than m on this rank: it has given them all
        vals = torch.cat([vals, vals.new_full((rows, m - vals.shape[1]), float("-inf"))], dim=1)
    if comm is None:
        merged = vals
        last = vals[:, -1]
    else:
        gathered = comm.all_gather(vals)  # [ranks, r, m]
        last = gathered[:, :, -1].amax(dim=0)
        merged = gathered.transpose(0, 1).reshape(rows, -1).sort(dim=1, descending=True).values
    bound = last if m < width else torch.full_like(last, float("-inf"))
    exact = ((merged >= bound.unsqueeze(1)) & (merged > float("-inf"))).sum(dim=1)
    return merged, exact


def _tie_weight(
    y: torch.Tensor, local: torch.Tensor, tau: torch.Tensor, kept_ties: torch.Tensor, comm: Optional[Collectives]
) -> torch.Tensor:
    """w_tie: c / g, or (c - 1) / (g - 1) when the sampled token is one of the g tokens equal
    to tau (it is kept; the others share the rest)."""
    cols = y.shape[1]
    inside = (local >= 0) & (local < cols)
    if cols:
        target = torch.where(inside, y.gather(1, local.clamp(0, cols - 1).unsqueeze(1)).squeeze(1), 0.0)
    else:
        target = y.new_zeros(y.shape[0])
    both = torch.stack([target, (y == tau.unsqueeze(1)).sum(dim=1).to(y.dtype)])
    if comm is not None:  # the sampled token's logit from its owner (the others add 0), the tie count
        both = comm.all_reduce(both, "sum")
    target, ties = both[0], both[1]
    in_ties = target == tau
    return torch.where(in_ties, (kept_ties - 1) / (ties - 1).clamp(min=1), kept_ties / ties.clamp(min=1))


def keep_weights(y: torch.Tensor, hit: torch.Tensor, tau: torch.Tensor, w_tie: torch.Tensor) -> torch.Tensor:
    """w_v of every column of ``y`` [r, C] (module docstring); ``hit`` [r, C]: the sampled token's
    column."""
    tau, w_tie = tau.unsqueeze(1), w_tie.unsqueeze(1)
    w = torch.where(y > tau, 1.0, torch.where(y == tau, w_tie, 0.0))
    return torch.where(hit, 1.0, w)
