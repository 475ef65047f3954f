"""Reward post-processing per group and per-token advantages.

Group normalisation (done once per rollout, on scalar rewards r_i of one group g, |g| = n), the
estimator's registered `group_normalisation`:

    mean_std (grpo / gspo / cispo):          A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6)
                                             when grpo_std_normalization and n > 1, else r_i - mean_g(r)
                                             std_g is the unbiased (n - 1) standard deviation
    mean (reinforce_plus_plus_baseline):     A_i = r_i - mean_g(r)
    leave_one_out (rloo):                    A_i = r_i - 1/(n - 1) * sum_{j in g, j != i} r_j
                                             (= n/(n - 1) * (r_i - mean_g(r))); A_i = 0 when n = 1
    none (reinforce_plus_plus, ppo):         A_i = r_i            (no group baseline)

Per-token advantages (done by the trainer on its partition; T_i response tokens of sample i,
kl_t = per-token KL to the reference policy, zero when kl_coef = 0):

    grpo / gspo / cispo / rloo:     A_{i,t} = A_i                        (broadcast; returns = A)
    reinforce_plus_plus:            r_{i,t} = -kl_coef * kl_{i,t} + [t = T_i - 1] * A_i
                                    G_{i,t} = r_{i,t} + gamma * G_{i,t+1},  G_{i,T_i} = 0
                                    A_{i,t} = whiten(G)_{i,t}            (returns = G)
    reinforce_plus_plus_baseline:   A_{i,t} = whiten(A_i - kl_coef * kl_{i,t})   (returns = A)
    ppo (GAE, value V):             delta_t = r_{i,t} + gamma * V_{t+1} - V_t,  V_{T_i} = 0
                                    A_t = delta_t + gamma * lambd * A_{t+1},    A_{T_i} = 0
                                    returns = A + V;  advantages = whiten(A)

    whiten(x) = (x - mean_m(x)) / sqrt(var_m(x) + 1e-8), mean and unbiased variance over the
    loss_mask == 1 tokens of every sample passed in (the caller passes one whole step).

On-policy distillation (use_opd; slime's --use-opd, applied after the estimator, whitening
included, so on top of any of them): for sample i and response token t, with y_{i,t} the sampled
token, pi_s the student's old policy (the loss's pi_old: the engine's log-probs when
use_rollout_logprobs, else the recomputed ones) and pi_T the frozen teacher,

    rkl_{i,t} = log pi_s(y_{i,t}) - log pi_T(y_{i,t})           (one-sample estimate of the
                                                                 reverse KL(pi_s || pi_T) at t)
    A'_{i,t}  = A_{i,t} - opd_kl_coef * rkl_{i,t}
              = A_{i,t} + opd_kl_coef * (log pi_T(y_{i,t}) - log pi_s(y_{i,t}))

so a token the teacher finds likelier than the student does is pushed up. With rewards of 0 (or a
constant within each group, which the group normalisation zeroes) A = 0 and it is pure on-policy
distillation (Agarwal et al. 2024; Thinking Machines' tinker cookbook; slime's
apply_opd_kl_to_advantages, whose formula this is).

REINFORCE++: Hu 2025 (arXiv:2501.03262). GAE: Schulman et al. 2016. RLOO: Ahmadian et al. 2024
(arXiv:2402.14740), as verl's `rloo` (whose group of one keeps r_i: here it is 0, as GRPO's
r_i - mean, and the configuration refuses rloo with n_samples_per_prompt < 2; a group shrinks to
one only when its other samples failed).

Each estimator is one `register_adv_est` below, carrying its group normalisation, its policy loss
and what the gates and the configuration's checks need (vime_core/algo/registry.py). torch is
imported inside the functions: the configuration reads the registered names without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

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


def masked_whiten(values: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """whiten(x) = (x - mean_m(x)) / sqrt(var_m(x) + 1e-8) over loss_mask == 1 tokens of all
    samples together (unbiased variance). Masked tokens are shifted/scaled too; they carry no loss."""
    import torch

    flat = torch.cat([v.float() for v in values])
    mask = torch.cat([m.float() for m in loss_masks])
    count = mask.sum()
    if count < 2:
        return [v.float().clone() for v in values]
    mean = (flat * mask).sum() / count
    var = (((flat - mean) ** 2) * mask).sum() / (count - 1)
    whitened = (flat - mean) * torch.rsqrt(var + WHITEN_EPS)
    return list(whitened.split([len(v) for v in values]))


def _token_rewards(reward: torch.Tensor, kl: Optional[torch.Tensor], kl_coef: float, length: int) -> torch.Tensor:
    """r_t = -kl_coef * kl_t + [t = T - 1] * reward."""
    import torch

    r = torch.zeros(length, dtype=torch.float32) if kl is None else -kl_coef * kl.float()
    if length:
        r[length - 1] = r[length - 1] + reward
    return r


def discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, G_T = 0."""
    # A loop over Python floats: ~50x faster than indexing a tensor per token, and exact for any
    # gamma (the closed form gamma^-t * cumsum(gamma^k r_k) underflows on long responses).
    import torch

    returns = [0.0] * len(token_rewards)
    running = 0.0
    for t, r in zip(range(len(returns) - 1, -1, -1), reversed(token_rewards.tolist())):
        running = r + gamma * running
        returns[t] = running
    return torch.tensor(returns, dtype=torch.float32)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lambd A_{t+1};  returns = A + V."""
    import torch

    r, v = token_rewards.tolist(), values.float().tolist()
    advantages = [0.0] * len(r)
    next_value, running = 0.0, 0.0
    for t in range(len(r) - 1, -1, -1):
        delta = r[t] + gamma * next_value - v[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
        next_value = v[t]
    adv = torch.tensor(advantages, dtype=torch.float32)
    return adv, adv + values.float()


# ---- per-token estimators ---------------------------------------------------------------------

TokenTensors = Optional[Sequence["torch.Tensor"]]
AdvantagesAndReturns = tuple[list["torch.Tensor"], list["torch.Tensor"]]
# Common signature: (rewards[B] post-processed, loss_masks: list[T_i], *, kl, values, gamma,
# lambd, kl_coef) -> (advantages: list[T_i], returns: list[T_i]).


def _check(rewards: torch.Tensor, loss_masks: Sequence[torch.Tensor], **named: Optional[Sequence[torch.Tensor]]) -> None:
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
@register_adv_est("gspo", group_normalisation="mean_std", policy_loss="gspo", reuse_log_probs=False, summary="Zheng et al. 2025")
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
    import torch

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
) -> AdvantagesAndReturns:
    """A = whiten(G), G_t = r_t + gamma G_{t+1}, r_t = -kl_coef kl_t + [t = T-1] A_i."""
    _check(rewards, loss_masks, kl=kl)
    returns = [
        discounted_returns(_token_rewards(rewards[i], None if kl is None else kl[i], kl_coef, len(m)), gamma)
        for i, m in enumerate(loss_masks)
    ]
    return masked_whiten(returns, loss_masks), returns


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
) -> AdvantagesAndReturns:
    """A = whiten(A_i - kl_coef * kl_t) (A_i already group-centred); returns = A."""
    import torch

    _check(rewards, loss_masks, kl=kl)
    raw = [
        torch.full((len(m),), float(rewards[i]), dtype=torch.float32) - (0.0 if kl is None else kl_coef * kl[i].float())
        for i, m in enumerate(loss_masks)
    ]
    advantages = masked_whiten(raw, loss_masks)
    return advantages, advantages


@register_adv_est("ppo", policy_loss="ppo", token_rewards=True, critic=True, summary="Schulman et al. 2017, GAE with a critic")
def gae_advantages(
    rewards: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    *,
    kl: TokenTensors = None,
    values: TokenTensors = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    kl_coef: float = 0.0,
) -> AdvantagesAndReturns:
    """GAE on r_t = -kl_coef kl_t + [t = T-1] r_i with the value head's V; advantages whitened."""
    if values is None:
        raise ValueError("advantage_estimator=ppo needs values (a critic's per-token value estimates)")
    _check(rewards, loss_masks, kl=kl, values=values)
    advantages, returns = [], []
    for i, m in enumerate(loss_masks):
        a, g = gae(_token_rewards(rewards[i], None if kl is None else kl[i], kl_coef, len(m)), values[i], gamma, lambd)
        advantages.append(a)
        returns.append(g)
    return masked_whiten(advantages, loss_masks), returns


def apply_opd_kl(
    advantages: Sequence[torch.Tensor],
    student_log_probs: Sequence[torch.Tensor],
    teacher_log_probs: Sequence[torch.Tensor],
    opd_kl_coef: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On-policy distillation (module docstring): (A' = A - opd_kl_coef * rkl, rkl) per sample,
    rkl = log pi_s - log pi_T of the sampled tokens; float32 on the CPU."""
    import torch

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
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Look up the estimator by name and run it; accepts plain lists for rewards and masks."""
    import torch

    fn = get_adv_estimator(advantage_estimator).fn
    rewards_t = torch.as_tensor(rewards, dtype=torch.float32)
    masks = [torch.as_tensor(m, dtype=torch.float32) for m in loss_masks]
    return fn(rewards_t, masks, kl=kl, values=values, gamma=gamma, lambd=lambd, kl_coef=kl_coef)
