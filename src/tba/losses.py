"""Training objectives as pure tensor functions.

Every objective takes the same :class:`LossInputs` (B prompts x K responses, group-major) and
:class:`tba.config.LossConfig` (the ``loss`` config section: clip_eps, is_cap, std_eps), and returns
``(loss, metrics)``; the trainer picks one by name from :data:`LOSSES`, so objectives differ only here.
``trajectory_balance`` is TBA's loss; the others are the baselines of docs/algorithm.md section 6, which use
the same groups of K responses, so one buffer and trainer serve all.

Conventions shared by all objectives:

- Sequence log-probs are sums over unmasked tokens (no length normalisation) unless a loss says otherwise.
- Padding is excluded with ``torch.where`` rather than multiplication before any ``exp``, so arbitrary
  values in padded positions (even ones that overflow) cannot leak into the loss or its gradient.
- Advantages carry no gradient; only ``inp.logp`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tba.config import LossConfig


@dataclass
class LossInputs:
    """Per-token quantities for N = B*K responses, padded to T tokens, group-major.

    Attributes:
        logp: [N, T] policy log-probs of the response tokens (temperature-scaled logits), with grad.
        ref_logp: [N, T] frozen reference model log-probs, same temperature, no grad.
        behaviour_logp: [N, T] log-probs of the policy that sampled the response, recorded at
            generation time (for importance ratios), no grad.
        mask: [N, T] 1.0 for real response tokens, 0.0 for padding after EOS.
        reward: [N] raw rewards r(x, y).
        group_size: K, responses per prompt; N must be divisible by K.
        beta: KL coefficient in effect now (docs/algorithm.md section 1: the current beta also rescales
            old samples).
        log_z: [B] learned log Z of each group's prompt, with grad (``loss.log_z: learned``); None: TB
            estimates it from the group (VarGrad). Only ``tb`` reads it.
    """

    logp: torch.Tensor
    ref_logp: torch.Tensor
    behaviour_logp: torch.Tensor
    mask: torch.Tensor
    reward: torch.Tensor
    group_size: int
    beta: float
    log_z: torch.Tensor | None = None


_DEFAULT_HP = LossConfig()  # pydantic sections are validated once and never mutated here


# ---------------------------------------------------------------------------------------------- helpers


def _check(inp: LossInputs, name: str, fields: tuple[str, ...], min_group: int = 1) -> int:
    """Validate shapes and grouping; return K. Raises ValueError (messages name the loss and the field)."""
    if inp.logp.dim() != 2:
        raise ValueError(f"{name}: logp must be [N, T], got shape {tuple(inp.logp.shape)}")
    n, k = inp.logp.shape[0], inp.group_size
    for field in fields:
        shape = tuple(getattr(inp, field).shape)
        if shape != tuple(inp.logp.shape):
            raise ValueError(f"{name}: {field} has shape {shape}, logp has {tuple(inp.logp.shape)}")
    if tuple(inp.reward.shape) != (n,):
        raise ValueError(f"{name}: reward must be [N] = ({n},), got {tuple(inp.reward.shape)}")
    if k <= 0 or n % k:
        raise ValueError(f"batch of {n} responses is not a whole number of groups of {k}")
    if k < min_group:
        raise ValueError(f"{name} needs at least {min_group} responses per prompt, got group_size={k}")
    if inp.beta < 0:
        raise ValueError(f"{name}: beta must be >= 0, got {inp.beta}")
    return k


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x on real tokens, exactly 0 (value and gradient) on padding. [N, T] -> [N, T]."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


def _seq(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence log-prob: sum over real tokens. [N, T] -> [N]."""
    return _masked(x, mask).sum(-1)


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over real tokens of the whole batch, as a float (for metrics)."""
    return (_masked(x.float(), mask).sum() / (mask > 0).sum().clamp(min=1)).item()


def _rloo_advantage(reward: torch.Tensor, k: int) -> torch.Tensor:
    """Leave-one-out advantage A_j = r_j - mean_{i != j} r_i within each group. [N] -> [N]; needs K >= 2."""
    r = reward.detach().view(-1, k)  # [B, K]
    baseline = (r.sum(-1, keepdim=True) - r) / (k - 1)  # [B, K], mean of the other K-1
    return (r - baseline).reshape(-1)  # [N]


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO objective min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) per token, and where it is clipped.

    ratio: [N, T]; adv: [N, 1]. Returns (objective [N, T], clipped [N, T] bool): clipped marks the tokens
    whose clipped branch is active, i.e. that get zero gradient.
    """
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)  # [N, T]
    clipped = ((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))  # [N, T]
    return obj, clipped


# ---------------------------------------------------------------------------------------------- losses


def trajectory_balance(
    inp: LossInputs, hp: LossConfig = _DEFAULT_HP
) -> tuple[torch.Tensor, dict[str, float]]:
    """Trajectory balance loss with the VarGrad log Z estimate (docs/algorithm.md section 1).

    resid_ij = SG[log Zhat(x_i)] + log pi_theta(y_ij|x_i) - log pi_ref(y_ij|x_i) - r_ij / beta
    log Zhat(x_i) = mean_j [ r_ij / beta + log pi_ref(y_ij|x_i) - log pi_theta(y_ij|x_i) ]
    loss = mean_ij resid_ij ** 2

    With ``inp.log_z`` (a learned log Z per prompt, Malkin et al. 2022 eq. 14) it replaces SG[log Zhat],
    and the loss trains it too: d loss / d log Z(x_i) = 2 / (B K) sum_j resid_ij.

    Log-probs are sequence sums over unmasked tokens (no length normalisation). Valid for samples from any
    behaviour policy, so ``behaviour_logp`` and ``hp`` are not used. On-policy its gradient w.r.t. the
    sequence log-prob is -2 / (beta * B * K) * A_ij, with A_ij the KL-regularised REINFORCE advantage
    (r_ij - mean_j r) - beta * (KL_ij - mean_j KL) (TBA paper appendix A; docs/algorithm.md section 1).

    Shapes: logp, ref_logp, mask [N, T]; reward [N]; loss scalar.

    Returns:
        (scalar loss, metrics with ``loss/tb``, ``loss/log_z_mean``, ``loss/kl_mean``).

    Raises:
        ValueError: if N is not a multiple of ``group_size``, shapes disagree, or beta <= 0.
    """
    k = _check(inp, "tb", ("ref_logp", "mask"))
    if inp.beta <= 0:
        raise ValueError(f"beta must be > 0 for trajectory balance, got {inp.beta}")
    logp = _seq(inp.logp, inp.mask)  # [N]
    ref_logp = _seq(inp.ref_logp, inp.mask)  # [N]
    target = inp.reward / inp.beta + ref_logp  # [N], log of the unnormalised optimum pi_ref * exp(r/beta)
    if inp.log_z is None:
        log_z = (target - logp).detach().view(-1, k).mean(-1, keepdim=True)  # [B, 1], stop-gradient
    else:
        log_z = inp.log_z.view(-1, 1)  # [B, 1], trained
    resid = log_z + logp.view(-1, k) - target.view(-1, k)  # [B, K]
    loss = resid.pow(2).mean()
    metrics = {
        "loss/tb": loss.item(),
        "loss/log_z_mean": log_z.mean().item(),
        "loss/kl_mean": (logp - ref_logp).mean().item(),
    }
    return loss, metrics


def rloo(inp: LossInputs, hp: LossConfig = _DEFAULT_HP) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE leave-one-out on the KL-regularised reward (Ahmadian et al. 2024, "Back to Basics").

    r'_j = r_j - beta * SG[log pi_theta(y_j|x) - log pi_ref(y_j|x)]    (sequence-level K1 KL in the reward)
    A_j  = r'_j - 1/(K-1) * sum_{i != j} r'_i
    loss = -mean_j A_j * log pi_theta(y_j|x)

    On-policy estimator: ``behaviour_logp`` and ``hp`` are not used. Since A_j = K/(K-1) * (r'_j - mean r'),
    its gradient is exactly (beta * K) / (2 * (K-1)) times the TB gradient on the same batch.

    Shapes: logp, ref_logp, mask [N, T]; reward [N]; loss scalar.

    Returns:
        (loss, metrics ``loss/rloo``, ``loss/advantage_mean``, ``loss/advantage_abs_mean``, ``loss/kl_mean``).

    Raises:
        ValueError: N not a multiple of K, K < 2, shapes disagree, or beta < 0.
    """
    k = _check(inp, "rloo", ("ref_logp", "mask"), min_group=2)
    logp = _seq(inp.logp, inp.mask)  # [N]
    kl = (logp - _seq(inp.ref_logp, inp.mask)).detach()  # [N]
    adv = _rloo_advantage(inp.reward - inp.beta * kl, k)  # [N]
    loss = -(adv * logp).mean()
    metrics = {
        "loss/rloo": loss.item(),
        "loss/advantage_mean": adv.mean().item(),
        "loss/advantage_abs_mean": adv.abs().mean().item(),
        "loss/kl_mean": kl.mean().item(),
    }
    return loss, metrics


def _group_relative_ppo(
    inp: LossInputs, hp: LossConfig, name: str, dr: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    """Shared body of grpo (dr=False) and dr_grpo (dr=True); see their docstrings."""
    k = _check(inp, name, ("ref_logp", "behaviour_logp", "mask"), min_group=2)
    mask = inp.mask
    r = inp.reward.detach().view(-1, k)  # [B, K]
    adv = r - r.mean(-1, keepdim=True)  # [B, K]
    if not dr:
        adv = adv / (r.std(-1, keepdim=True) + hp.std_eps)  # [B, K], unbiased std as TRL's GRPOTrainer
    adv = adv.reshape(-1, 1)  # [N, 1]
    ratio = _masked(inp.logp - inp.behaviour_logp, mask).exp()  # [N, T], 1 on padding
    obj, clipped = _clipped_surrogate(ratio, adv, hp.clip_eps)  # [N, T]
    d = _masked(inp.ref_logp - inp.logp, mask)  # [N, T], log(pi_ref / pi_theta), 0 on padding
    k3 = d.exp() - d - 1  # [N, T], >= 0; unbiased estimate of KL(pi_theta || pi_ref) per token
    per_token = _masked(-(obj - inp.beta * k3), mask)  # [N, T]
    if dr:
        loss = per_token.sum() / per_token.numel()  # / (N * T): constant, no length bias
    else:
        lengths = (mask > 0).sum(-1).clamp(min=1)  # [N]
        loss = (per_token.sum(-1) / lengths).mean()  # per-response token mean, then mean over responses
    metrics = {
        f"loss/{name}": loss.item(),
        "loss/advantage_mean": adv.mean().item(),
        "loss/advantage_abs_mean": adv.abs().mean().item(),
        "loss/clip_frac": _token_mean(clipped, mask),
        "loss/ratio_mean": _token_mean(ratio.detach(), mask),
        "loss/kl_k3_mean": _token_mean(k3.detach(), mask),
        "loss/kl_mean": (_seq(inp.logp, mask) - _seq(inp.ref_logp, mask)).mean().item(),
    }
    return loss, metrics


def grpo(inp: LossInputs, hp: LossConfig = _DEFAULT_HP) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO (Shao et al. 2024, DeepSeekMath, eq. 3 with outcome supervision).

    A_j      = (r_j - mean_group r) / (std_group r + hp.std_eps)        (unbiased std, as TRL)
    rho_jt   = exp(logp_jt - behaviour_logp_jt)
    obj_jt   = min(rho_jt * A_j, clip(rho_jt, 1 - clip_eps, 1 + clip_eps) * A_j)
    kl3_jt   = exp(ref_jt - logp_jt) - (ref_jt - logp_jt) - 1          (k3 estimator, in the loss)
    loss     = mean_j [ 1/|y_j| * sum_t -(obj_jt - beta * kl3_jt) ]

    Each response is length-normalised (mean over its own real tokens), then responses are averaged.

    Shapes: logp, ref_logp, behaviour_logp, mask [N, T]; reward [N]; loss scalar.

    Returns:
        (loss, metrics ``loss/grpo``, ``loss/advantage_mean``, ``loss/advantage_abs_mean``,
        ``loss/clip_frac`` (fraction of real tokens with the clipped branch active, i.e. zero gradient),
        ``loss/ratio_mean``, ``loss/kl_k3_mean`` (per token), ``loss/kl_mean`` (sequence K1)).

    Raises:
        ValueError: N not a multiple of K, K < 2 (no group std), shapes disagree, or beta < 0.
    """
    return _group_relative_ppo(inp, hp, "grpo", dr=False)


def dr_grpo(inp: LossInputs, hp: LossConfig = _DEFAULT_HP) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like Training: A Critical Perspective").

    GRPO without its two biases: no division by the group reward std, and no per-response length
    normalisation. With obj_jt and kl3_jt as in :func:`grpo`:

    A_j  = r_j - mean_group r
    loss = 1 / (N * T) * sum_j sum_t -(obj_jt - beta * kl3_jt)

    T, the padded width of the batch, stands in for the fixed generation budget Dr. GRPO divides by
    (as TRL's ``loss_type="dr_grpo"`` divides by ``max_completion_length``): a constant, so long and short
    responses weigh each token equally. With no padding and std 1 it equals grpo.

    Shapes: logp, ref_logp, behaviour_logp, mask [N, T]; reward [N]; loss scalar.

    Returns:
        (loss, metrics as :func:`grpo`, with ``loss/dr_grpo``).

    Raises:
        ValueError: N not a multiple of K, K < 2, shapes disagree, or beta < 0.
    """
    return _group_relative_ppo(inp, hp, "dr_grpo", dr=True)


def ppo_clip(inp: LossInputs, hp: LossConfig = _DEFAULT_HP) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance-weighted REINFORCE against the behaviour policy, per token, with an RLOO baseline.

    The usual off-policy correction of asynchronous RL systems (docs/algorithm.md section 6). The advantage is
    :func:`rloo`'s, a sequence-level constant A_j on every token of y_j:

    A_j    = r'_j - mean_{i != j} r'_i,   r'_j = r_j - beta * SG[log pi_theta(y_j|x) - log pi_ref(y_j|x)]
    rho_jt = exp(logp_jt - behaviour_logp_jt)

    hp.is_cap is None (PPO clipped surrogate, Schulman et al. 2017):
        loss = -1/N * sum_j sum_t min(rho_jt * A_j, clip(rho_jt, 1 - clip_eps, 1 + clip_eps) * A_j)
        A token clipped in the direction of its advantage gets no gradient.
    hp.is_cap = c (truncated importance sampling, IMPALA, Espeholt et al. 2018):
        loss = -1/N * sum_j sum_t SG[min(rho_jt, c)] * A_j * logp_jt
        Every token gets gradient; a large ratio is capped at c instead of being dropped.

    Tokens are summed per response (like the sequence log-prob) and responses averaged, so on-policy
    (rho = 1) both forms have exactly the gradient of :func:`rloo`.

    Shapes: logp, ref_logp, behaviour_logp, mask [N, T]; reward [N]; loss scalar.

    Returns:
        (loss, metrics ``loss/ppo_clip``, ``loss/advantage_mean``, ``loss/advantage_abs_mean``,
        ``loss/clip_frac`` (fraction of real tokens clipped, or with ratio > c when capping),
        ``loss/ratio_mean``, ``loss/kl_mean``).

    Raises:
        ValueError: N not a multiple of K, K < 2, shapes disagree, or beta < 0.
    """
    k = _check(inp, "ppo_clip", ("ref_logp", "behaviour_logp", "mask"), min_group=2)
    mask = inp.mask
    kl = (_seq(inp.logp, mask) - _seq(inp.ref_logp, mask)).detach()  # [N]
    adv = _rloo_advantage(inp.reward - inp.beta * kl, k).unsqueeze(-1)  # [N, 1]
    ratio = _masked(inp.logp - inp.behaviour_logp, mask).exp()  # [N, T], 1 on padding
    if hp.is_cap is None:
        obj, clipped = _clipped_surrogate(ratio, adv, hp.clip_eps)  # [N, T]
    else:
        obj = ratio.clamp(max=hp.is_cap).detach() * adv * inp.logp  # [N, T]
        clipped = ratio > hp.is_cap  # [N, T]
    loss = -_masked(obj, mask).sum(-1).mean()
    metrics = {
        "loss/ppo_clip": loss.item(),
        "loss/advantage_mean": adv.mean().item(),
        "loss/advantage_abs_mean": adv.abs().mean().item(),
        "loss/clip_frac": _token_mean(clipped, mask),
        "loss/ratio_mean": _token_mean(ratio.detach(), mask),
        "loss/kl_mean": kl.mean().item(),
    }
    return loss, metrics


def online_dpo(inp: LossInputs, hp: LossConfig = _DEFAULT_HP) -> tuple[torch.Tensor, dict[str, float]]:
    """Online DPO: one preference pair per group, judged by the reward (Rafailov et al. 2023, DPO;
    Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback").

    In group i, chosen c = argmax_j r_ij and rejected l = argmin_j r_ij (ties: first index). Groups whose
    rewards are all equal carry no preference and are skipped. With sequence log-probs:

    m_i  = beta * ((logp_ic - ref_ic) - (logp_il - ref_il))
    loss = mean over used groups of -log sigmoid(m_i)

    If every group is tied the loss is 0, still connected to ``logp`` (backward gives zero gradients).
    ``behaviour_logp`` and ``hp`` are not used.

    Shapes: logp, ref_logp, mask [N, T]; reward [N]; loss scalar.

    Returns:
        (loss, metrics ``loss/online_dpo``, ``loss/pairs`` (used groups), ``loss/margin_mean`` (mean m_i),
        ``loss/pref_acc`` (fraction of pairs with m_i > 0), ``loss/kl_mean``; margin/acc are 0 without pairs).

    Raises:
        ValueError: N not a multiple of K, K < 2, shapes disagree, or beta <= 0.
    """
    k = _check(inp, "online_dpo", ("ref_logp", "mask"), min_group=2)
    if inp.beta <= 0:
        raise ValueError(f"online_dpo: beta must be > 0, got {inp.beta}")
    logp = _seq(inp.logp, inp.mask)  # [N]
    implicit = (logp - _seq(inp.ref_logp, inp.mask)).view(-1, k)  # [B, K], log pi_theta / pi_ref
    r = inp.reward.detach().view(-1, k)  # [B, K]
    used = r.max(-1).values > r.min(-1).values  # [B]
    chosen = implicit.gather(-1, r.argmax(-1, keepdim=True)).squeeze(-1)  # [B]
    rejected = implicit.gather(-1, r.argmin(-1, keepdim=True)).squeeze(-1)  # [B]
    margin = (inp.beta * (chosen - rejected))[used]  # [P], P = number of used groups
    kl_mean = implicit.mean().item()
    if margin.numel() == 0:
        loss = (logp * 0).sum()  # no preference anywhere: zero, but keeps the graph for backward
        return loss, {"loss/online_dpo": 0.0, "loss/pairs": 0.0, "loss/margin_mean": 0.0,
                      "loss/pref_acc": 0.0, "loss/kl_mean": kl_mean}
    loss = -F.logsigmoid(margin).mean()
    metrics = {
        "loss/online_dpo": loss.item(),
        "loss/pairs": float(margin.numel()),
        "loss/margin_mean": margin.mean().item(),
        "loss/pref_acc": (margin > 0).float().mean().item(),
        "loss/kl_mean": kl_mean,
    }
    return loss, metrics


LossFn = Callable[[LossInputs, LossConfig], "tuple[torch.Tensor, dict[str, float]]"]

#: Objectives by config name (``loss.name``).
LOSSES: dict[str, LossFn] = {
    "tb": trajectory_balance,
    "rloo": rloo,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "ppo_clip": ppo_clip,
    "online_dpo": online_dpo,
}
