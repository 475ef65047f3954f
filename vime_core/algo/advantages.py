"""Reward post-processing per group and per-token advantages; each estimator is one `register_adv_est`.

Group normalisation of the scalar rewards r_i of one group g (|g| = n), once per rollout:

    mean_std (grpo / gspo / cispo):       A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6)  (unbiased std;
                                          r_i - mean_g(r) without grpo_std_normalization or when n = 1)
    mean (reinforce_plus_plus_baseline):  A_i = r_i - mean_g(r)
    leave_one_out (rloo):                 A_i = r_i - 1/(n - 1) * sum_{j != i} r_j;  A_i = 0 when n = 1
    none (reinforce_plus_plus, ppo):      A_i = r_i

Per-token advantages, by the trainer per optimizer step, over the model tokens t_1 < ... < t_K of
sample i (loss mask m = 1; tool and failed tokens get 0, and the recursions step over them):

    grpo / gspo / cispo / rloo:     A_{i,t} = A_i                                  (returns = A)
    reinforce_plus_plus:            r_{i,t} = m_{i,t} * (-kl_coef * kl_{i,t}) + [t = t_K] * A_i
                                    G_{i,t_k} = r_{i,t_k} + gamma * G_{i,t_{k+1}}, G_{i,t_{K+1}} = 0
                                    A = whiten(G)                                  (returns = G)
    reinforce_plus_plus_baseline:   A = whiten(m * (A_i - kl_coef * kl))           (returns = A)
    ppo (GAE, value V):             delta_k = r_{i,t_k} + gamma * V_{i,t_{k+1}} - V_{i,t_k}
                                    D_k = delta_k + gamma * lambd * D_{k+1},  D_{K+1} = V_{K+1} = 0
                                    returns = D + V;  A = whiten(D)

    whiten(x) = m * (x - mu) / sqrt(sigma^2 + 1e-8), mu and the unbiased sigma^2 over the m = 1
    tokens of the whole step (every DP rank); whiten(x) = m * x when fewer than 2 such tokens.

On-policy distillation (use_opd, after the estimator): A' = A - opd_kl_coef * (log pi_s(y) - log pi_T(y)),
pi_s the loss's old policy, pi_T the frozen teacher. REINFORCE++: Hu 2025 (arXiv:2501.03262);
GAE: Schulman et al. 2016; RLOO: Ahmadian et al. 2024 (arXiv:2402.14740)."""

from __future__ import annotations

import array
import inspect
import math
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from vime_core.algo.registry import get_adv_estimator, register_adv_est

if TYPE_CHECKING:
    import torch

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


# ---- group normalisation (scalar rewards) ---------------------------------------------------


def normalize_group(rewards: Sequence[float], std_normalization: bool) -> list[float]:
    """One group: r - mean(r), divided by std_unbiased(r) + 1e-6 when asked and n > 1."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if std_normalization and n > 1:
        std = (sum(c * c for c in centred) / (n - 1)) ** 0.5
        centred = [c / (std + GROUP_STD_EPS) for c in centred]
    return centred


def leave_one_out_group(rewards: Sequence[float]) -> list[float]:
    """One group: r_i - (sum_j r_j - r_i) / (n - 1); zeros when n = 1 (no other sample)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def postprocess_rewards(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    advantage_estimator: str,
    grpo_std_normalization: bool = True,
) -> list[float]:
    """Rewards after the estimator's group normalisation (module docstring), in input order.

    Samples of one group share a `group_ids` value; they need not be contiguous.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    normalisation = get_adv_estimator(advantage_estimator).group_normalisation
    if normalisation == "none":
        return [float(r) for r in rewards]
    std_normalization = grpo_std_normalization and normalisation == "mean_std"
    positions: dict[int, list[int]] = {}
    for pos, gid in enumerate(group_ids):
        positions.setdefault(gid, []).append(pos)
    out = [0.0] * len(rewards)
    for group in positions.values():
        values = [float(rewards[p]) for p in group]
        if normalisation == "leave_one_out":
            normalised = leave_one_out_group(values)
        else:
            normalised = normalize_group(values, std_normalization)
        for pos, value in zip(group, normalised, strict=True):
            out[pos] = value
    return out


# ---- whitening --------------------------------------------------------------------------------

# sums (a 1-D float64 tensor of this process's partial sums) -> the same sums over every DP rank
ReduceSums = Callable[["torch.Tensor"], "torch.Tensor"]


def masked_whiten(
    values: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor], reduce_sums: Optional[ReduceSums] = None
) -> list[torch.Tensor]:
    """whiten(x) of the module docstring over the loss_mask == 1 tokens of all samples together and,
    with `reduce_sums`, of every DP rank: (n, sum m x) then sum m (x - mu)^2, float64, each passed
    through `reduce_sums` (so every rank calls it twice, or once when the step has n < 2).
    A token outside the mask gets 0. float32 out.

    Centred two-pass sums (not slime's one-pass sum m x^2 - n mu^2 in float32, which cancels
    catastrophically on flat rewards); whitening over every DP rank together keeps the advantages
    independent of the DP layout."""
    import torch  # boundary: the driver imports this module; torch only in the trainer

    lengths = [len(v) for v in values]
    flat = torch.cat(list(values)).double() if values else torch.zeros(0, dtype=torch.float64)
    mask = torch.cat(list(loss_masks)) != 0 if loss_masks else torch.zeros(0, dtype=torch.bool)
    masked = torch.where(mask, flat, 0.0)
    sums = torch.stack([mask.sum(dtype=torch.float64), masked.sum()])
    count, total = (sums if reduce_sums is None else reduce_sums(sums)).tolist()
    if count < 2:
        return list(masked.float().split(lengths))
    centred = torch.where(mask, flat - total / count, 0.0)
    square_sum = (centred * centred).sum().reshape(1)
    if reduce_sums is not None:
        square_sum = reduce_sums(square_sum)
    whitened = centred * (1.0 / math.sqrt(square_sum.item() / (count - 1) + WHITEN_EPS))
    return list(whitened.float().split(lengths))


def _token_rewards(
    reward: torch.Tensor, kl: Optional[torch.Tensor], kl_coef: float, loss_mask: torch.Tensor
) -> torch.Tensor:
    """r_t = m_t * (-kl_coef * kl_t) + [t = t_K] * reward: the KL penalty on model tokens only, the
    sequence reward at the last model token t_K (none without model tokens)."""
    import torch  # boundary: the driver imports this module; torch only in the trainer

    model = loss_mask != 0
    if kl is None:
        r = torch.zeros(len(loss_mask), dtype=torch.float32)
    else:
        r = torch.where(model, -kl_coef * kl.float(), 0.0)
    model_positions = model.nonzero()
    if len(model_positions):
        r[int(model_positions[-1])] += reward
    return r


def _float32(xs: list[float]) -> torch.Tensor:
    """torch.tensor(xs, dtype=float32), through array("f"): the same rounding, faster."""
    import torch  # boundary: the driver imports this module; torch only in the trainer

    return torch.frombuffer(array.array("f", xs), dtype=torch.float32) if xs else torch.zeros(0)


def _model_positions(loss_mask: Optional[torch.Tensor], length: int) -> list[int]:
    """t_1 < ... < t_K: the tokens with loss_mask != 0 (every token when None)."""
    return list(range(length)) if loss_mask is None else loss_mask.nonzero().flatten().tolist()


def discounted_returns(
    token_rewards: torch.Tensor, gamma: float, loss_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """G_{t_k} = r_{t_k} + gamma * G_{t_{k+1}}, G_{t_{K+1}} = 0, over the model tokens t_1 < ... < t_K
    (loss_mask != 0; every token when None); G = 0 on the others."""
    # A loop over Python floats: far faster than indexing a tensor per token, and exact for any
    # gamma (the closed form gamma^-t * cumsum(gamma^k r_k) underflows on long responses).
    r = token_rewards.tolist()
    returns = [0.0] * len(r)
    running = 0.0
    for t in reversed(_model_positions(loss_mask, len(r))):
        running = r[t] + gamma * running
        returns[t] = running
    return _float32(returns)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lambd: float,
    loss_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the model tokens t_1 < ... < t_K only (loss_mask != 0; every token when None):
    delta_k = r_{t_k} + gamma V_{t_{k+1}} - V_{t_k};  D_k = delta_k + gamma lambd D_{k+1};
    returns = D + V. The values of other tokens are never read; their D and returns are 0."""
    import torch  # boundary: the driver imports this module; torch only in the trainer

    r, v = token_rewards.tolist(), values.float().tolist()
    advantages = [0.0] * len(r)
    next_value, running = 0.0, 0.0
    for t in reversed(_model_positions(loss_mask, len(r))):
        running = r[t] + gamma * next_value - v[t] + gamma * lambd * running
        advantages[t] = running
        next_value = v[t]
    adv = _float32(advantages)
    returns = adv + values.float()
    return adv, returns if loss_mask is None else torch.where(loss_mask != 0, returns, 0.0)


# ---- per-token estimators ---------------------------------------------------------------------

TokenTensors = Optional[Sequence["torch.Tensor"]]
AdvantagesAndReturns = tuple[list["torch.Tensor"], list["torch.Tensor"]]
# Common signature: (rewards[B] post-processed, loss_masks: list[T_i], *, kl, values, gamma,
# lambd, kl_coef[, reduce_sums]) -> (advantages: list[T_i], returns: list[T_i]); reduce_sums: the
# whitening's sums over every DP rank of the step (masked_whiten), None on one rank. An estimator
# that whitens declares it (compute_advantages passes it only to those that do).


def _check(
    rewards: torch.Tensor, loss_masks: Sequence[torch.Tensor], **named: Optional[Sequence[torch.Tensor]]
) -> None:
    if len(rewards) != len(loss_masks):
        raise ValueError(f"{len(rewards)} rewards but {len(loss_masks)} loss masks")
    for name, seqs in named.items():
        if seqs is None:
            continue
        if len(seqs) != len(loss_masks):
            raise ValueError(f"{len(seqs)} {name} tensors but {len(loss_masks)} samples")
        for i, (s, m) in enumerate(zip(seqs, loss_masks, strict=True)):
            if len(s) != len(m):
                raise ValueError(f"sample {i}: {name} has {len(s)} tokens, loss_mask {len(m)}")


@register_adv_est("grpo", group_normalisation="mean_std", policy_loss="ppo", summary="Shao et al. 2024")
@register_adv_est(
    "gspo", group_normalisation="mean_std", policy_loss="gspo", reuse_log_probs=False, summary="Zheng et al. 2025"
)
@register_adv_est("cispo", group_normalisation="mean_std", policy_loss="cispo", summary="MiniMax-M1 2025")
@register_adv_est("rloo", group_normalisation="leave_one_out", policy_loss="ppo", summary="Ahmadian et al. 2024")
def group_broadcast_advantages(
    rewards: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    *,
    kl: TokenTensors = None,
    values: TokenTensors = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    kl_coef: float = 0.0,
) -> AdvantagesAndReturns:
    """A_{i,t} = A_i for every response token t of sample i; returns = advantages."""
    import torch  # boundary: the driver imports this module; torch only in the trainer

    _check(rewards, loss_masks)
    advantages = [torch.full((len(m),), float(r), dtype=torch.float32) for r, m in zip(rewards.tolist(), loss_masks)]
    return advantages, advantages


@register_adv_est("reinforce_plus_plus", policy_loss="ppo", token_rewards=True, summary="Hu 2025")
def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    *,
    kl: TokenTensors = None,
    values: TokenTensors = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    kl_coef: float = 0.0,
    reduce_sums: Optional[ReduceSums] = None,
) -> AdvantagesAndReturns:
    """A = whiten(G), G_{t_k} = r_{t_k} + gamma G_{t_{k+1}} over the model tokens,
    r_t = m_t (-kl_coef kl_t) + [t = t_K] A_i (module docstring); returns = G."""
    _check(rewards, loss_masks, kl=kl)
    returns = [
        discounted_returns(_token_rewards(rewards[i], None if kl is None else kl[i], kl_coef, m), gamma, m)
        for i, m in enumerate(loss_masks)
    ]
    return masked_whiten(returns, loss_masks, reduce_sums), returns


@register_adv_est("reinforce_plus_plus_baseline", group_normalisation="mean", policy_loss="ppo", token_rewards=True)
def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    *,
    kl: TokenTensors = None,
    values: TokenTensors = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    kl_coef: float = 0.0,
    reduce_sums: Optional[ReduceSums] = None,
) -> AdvantagesAndReturns:
    """A = whiten(m_t (A_i - kl_coef * kl_t)) (A_i already group-centred); returns = A."""
    import torch  # boundary: the driver imports this module; torch only in the trainer

    _check(rewards, loss_masks, kl=kl)
    raw = []
    for i, m in enumerate(loss_masks):
        a = torch.full((len(m),), float(rewards[i]), dtype=torch.float32)
        raw.append(torch.where(m != 0, a if kl is None else a - kl_coef * kl[i].float(), 0.0))
    advantages = masked_whiten(raw, loss_masks, reduce_sums)
    return advantages, advantages


@register_adv_est(
    "ppo", policy_loss="ppo", token_rewards=True, critic=True, summary="Schulman et al. 2017, GAE with a critic"
)
def gae_advantages(
    rewards: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    *,
    kl: TokenTensors = None,
    values: TokenTensors = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    kl_coef: float = 0.0,
    reduce_sums: Optional[ReduceSums] = None,
) -> AdvantagesAndReturns:
    """GAE over the model tokens on r_t = m_t (-kl_coef kl_t) + [t = t_K] r_i with the value head's V
    (module docstring); advantages whitened."""
    if values is None:
        raise ValueError("advantage_estimator=ppo needs values (a critic's per-token value estimates)")
    _check(rewards, loss_masks, kl=kl, values=values)
    advantages, returns = [], []
    for i, m in enumerate(loss_masks):
        a, g = gae(_token_rewards(rewards[i], None if kl is None else kl[i], kl_coef, m), values[i], gamma, lambd, m)
        advantages.append(a)
        returns.append(g)
    return masked_whiten(advantages, loss_masks, reduce_sums), returns


def apply_opd_kl(
    advantages: Sequence[torch.Tensor],
    student_log_probs: Sequence[torch.Tensor],
    teacher_log_probs: Sequence[torch.Tensor],
    opd_kl_coef: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On-policy distillation (module docstring): (A' = A - opd_kl_coef * rkl, rkl) per sample,
    rkl = log pi_s - log pi_T of the sampled tokens; float32 on the CPU.

    A token the teacher finds likelier than the student is pushed up; with rewards constant within
    each group A = 0 and this is pure on-policy distillation (Agarwal et al. 2024; slime's
    apply_opd_kl_to_advantages)."""

    for name, seqs in (("student_log_probs", student_log_probs), ("teacher_log_probs", teacher_log_probs)):
        if len(seqs) != len(advantages):
            raise ValueError(f"{len(seqs)} {name} tensors but {len(advantages)} samples")
    shaped, reverse_kls = [], []
    for i, (a, s, t) in enumerate(zip(advantages, student_log_probs, teacher_log_probs)):
        if not len(a) == len(s) == len(t):
            raise ValueError(f"sample {i}: {len(a)} advantages, {len(s)} student and {len(t)} teacher log-probs")
        rkl = s.detach().float().cpu() - t.detach().float().cpu()
        shaped.append(a.float() - opd_kl_coef * rkl)
        reverse_kls.append(rkl)
    return shaped, reverse_kls


def compute_advantages(
    advantage_estimator: str,
    rewards: Sequence[float] | torch.Tensor,
    loss_masks: Sequence[Sequence[int] | torch.Tensor],
    *,
    kl: Optional[Sequence[torch.Tensor]] = None,
    values: Optional[Sequence[torch.Tensor]] = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    kl_coef: float = 0.0,
    reduce_sums: Optional[ReduceSums] = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Look up the estimator by name and run it; accepts plain lists for rewards and masks.
    `reduce_sums`: sums -> the same sums over every DP rank of the step (the whitening's; None: one
    process holds the whole step). It reaches the estimators that declare the parameter (those
    that whiten, and must whiten over the step); a registered estimator without it, whose
    advantages depend on its own sample only, is called with the other arguments as before."""
    import torch  # boundary: the driver imports this module; torch only in the trainer

    fn = get_adv_estimator(advantage_estimator).fn
    rewards_t = torch.as_tensor(rewards, dtype=torch.float32)
    masks = [torch.as_tensor(m, dtype=torch.float32) for m in loss_masks]
    extra = {"reduce_sums": reduce_sums} if "reduce_sums" in inspect.signature(fn).parameters else {}
    return fn(rewards_t, masks, kl=kl, values=values, gamma=gamma, lambd=lambd, kl_coef=kl_coef, **extra)
