"""Losses against numbers worked out by hand (arithmetic in the comments), plus the gradient identities.

Conventions: N = B*K responses, group-major; per-token tensors are [N, T]; "s" is a sequence log-prob
(sum over real tokens). PAD marks padded positions: their values are deliberately wild and must not matter.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tba.config import LossConfig
from tba.losses import (
    LOSSES,
    LossInputs,
    dr_grpo,
    grpo,
    online_dpo,
    ppo_clip,
    rloo,
    trajectory_balance,
)

PAD = 50.0  # exp(PAD - (-PAD)) = exp(100) overflows float32: padding must never reach an exp
LN2 = math.log(2.0)
F64 = torch.float64


def make(logp, ref, mask, reward, k, beta, ratios=None) -> LossInputs:
    """LossInputs from nested lists; ``ratios`` [N, T] sets behaviour_logp = logp - log(ratio) (None: on-policy)."""
    logp_t = torch.tensor(logp, dtype=F64, requires_grad=True)
    if ratios is None:
        beh = logp_t.detach().clone()
    else:
        beh = logp_t.detach() - torch.tensor(ratios, dtype=F64).log()
    return LossInputs(
        logp=logp_t,
        ref_logp=torch.tensor(ref, dtype=F64),
        behaviour_logp=beh,
        mask=torch.tensor(mask, dtype=F64),
        reward=torch.tensor(reward, dtype=F64),
        group_size=k,
        beta=beta,
    )


def grad(loss: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    loss.backward()
    return inp.logp.grad


def close(a, b, atol=1e-6) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------------ TB


def _tb_batch(beta: float, pad: float) -> LossInputs:
    # B=1, K=2, T=2. resp0 tokens [-1, -2] -> s0 = -3; resp1 [-0.5, PAD] -> s1 = -0.5 (PAD masked).
    # ref: resp0 [-1.5, -1] -> rho0 = -2.5; resp1 [-1, PAD] -> rho1 = -1. reward [1, 0].
    return make([[-1.0, -2.0], [-0.5, pad]], [[-1.5, -1.0], [-1.0, -pad]], [[1, 1], [1, 0]], [1.0, 0.0], 2, beta)


def test_tb_hand_values_and_padding_ignored():
    # beta = 0.5: r/beta = [2, 0]; target = r/beta + rho = [-0.5, -1]; target - s = [2.5, -0.5]
    # log Z = mean = 1.0; resid = logZ + s - target = [1 - 3 + 0.5, 1 - 0.5 + 1] = [-1.5, 1.5]
    # loss = (2.25 + 2.25) / 2 = 2.25; kl_mean = mean(s - rho) = mean(-0.5, 0.5) = 0
    inp = _tb_batch(0.5, PAD)
    loss, m = trajectory_balance(inp, LossConfig())
    assert close(loss, 2.25)
    assert m["loss/tb"] == pytest.approx(2.25) and m["loss/log_z_mean"] == pytest.approx(1.0)
    assert m["loss/kl_mean"] == pytest.approx(0.0)
    # d loss / d s_j = 2/(B*K) * resid_j = [-1.5, 1.5], on every real token; padding gets nothing
    assert close(grad(loss, inp), [[-1.5, -1.5], [1.5, 0.0]])
    # a different padded value changes nothing
    loss_other_pad, _ = trajectory_balance(_tb_batch(0.5, -3.0), LossConfig())
    assert close(loss_other_pad, 2.25)


def test_tb_learned_log_z_hand_values():
    # the batch above with a learned log Z = 0.5 instead of the VarGrad 1.0:
    # resid = logZ + s - target = [0.5 - 3 + 0.5, 0.5 - 0.5 + 1] = [-2, 1]; loss = (4 + 1) / 2 = 2.5
    # d loss / d s = 2/(B*K) * resid = [-2, 1]; d loss / d logZ = sum_j 2/(B*K) * resid_j = -2 + 1 = -1
    inp = _tb_batch(0.5, PAD)
    inp.log_z = torch.tensor([0.5], dtype=F64, requires_grad=True)
    loss, m = trajectory_balance(inp, LossConfig(log_z="learned"))
    assert close(loss, 2.5) and m["loss/log_z_mean"] == pytest.approx(0.5)
    loss.backward()
    assert close(inp.logp.grad, [[-2.0, -2.0], [1.0, 0.0]]) and close(inp.log_z.grad, [-1.0])


def test_tb_applies_the_current_beta():
    # beta = 1: r/beta = [1, 0]; target = [-1.5, -1]; target - s = [1.5, -0.5]; log Z = 0.5
    # resid = [0.5 - 3 + 1.5, 0.5 - 0.5 + 1] = [-1, 1]; loss = 1  (2.25 at beta = 0.5, same raw rewards)
    loss, m = trajectory_balance(_tb_batch(1.0, PAD), LossConfig())
    assert close(loss, 1.0) and m["loss/log_z_mean"] == pytest.approx(0.5)


def _seq_to_tokens(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token logps [N, T] whose masked sum is exactly s [N] (split evenly over real tokens, PAD after)."""
    frac = mask / mask.sum(-1, keepdim=True)  # [N, T], rows sum to 1 over real tokens
    return s[:, None] * frac + PAD * (1 - mask)


def _identity_batch(k: int, beta: float):
    s = torch.tensor([-3.0, -1.0, -2.0, -4.0, -2.5, -0.5][: 2 * k], dtype=F64, requires_grad=True)  # [N]
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 1]][: 2 * k], dtype=F64)  # [N, 2]
    ref = torch.tensor([[-1.0, -1.5], [-0.5, 0.0], [-2.0, -0.2], [-3.0, 0.0], [-1.0, -1.0], [-0.1, -0.2]][: 2 * k],
                       dtype=F64)
    reward = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.3][: 2 * k], dtype=F64)
    logp = _seq_to_tokens(s, mask)
    inp = LossInputs(logp=logp, ref_logp=ref, behaviour_logp=logp.detach(), mask=mask, reward=reward,
                     group_size=k, beta=beta)
    return s, inp


def test_tb_gradient_is_kl_regularised_reinforce_with_mean_baseline():
    # docs/algorithm.md section 1. With d_ij = s_ij - rho_ij - r_ij/beta and log Z_i = -mean_j d_ij:
    #   resid_ij = d_ij - mean_j d_ij = (KL_ij - mean_j KL) - (r_ij - mean_j r)/beta = -A_ij / beta
    #   dL_TB/ds_ij = 2/(B*K) * resid_ij = -2/(beta*B*K) * A_ij      (log Z carries no gradient)
    # REINFORCE  L_R = -1/(B*K) * sum A_ij * s_ij  (A held fixed)  has  dL_R/ds_ij = -A_ij/(B*K), so
    #   grad TB = (2/beta) * grad REINFORCE: same direction, positive factor.
    beta, k, b = 0.25, 3, 2
    s, inp = _identity_batch(k, beta)
    loss, _ = trajectory_balance(inp, LossConfig())
    (g_tb,) = torch.autograd.grad(loss, s)

    rho = (inp.ref_logp * inp.mask).sum(-1)  # [N]
    kl = (s - rho).detach().view(b, k)  # [B, K]
    r = inp.reward.view(b, k)  # [B, K]
    adv = (r - r.mean(-1, keepdim=True)) - beta * (kl - kl.mean(-1, keepdim=True))  # [B, K]
    s2 = s.detach().clone().requires_grad_(True)
    (g_reinforce,) = torch.autograd.grad(-(adv.reshape(-1) * s2).mean(), s2)

    assert torch.allclose(g_tb, -2.0 / (beta * b * k) * adv.reshape(-1))
    assert torch.allclose(g_tb, (2.0 / beta) * g_reinforce)
    assert g_tb.abs().sum() > 0  # not trivially zero


@pytest.mark.parametrize("k", [2, 3])
def test_rloo_gradient_is_proportional_to_tb_on_the_same_batch(k):
    # rloo: A_j = r'_j - mean_{i!=j} r'_i = K/(K-1) * (r'_j - mean r'), r' = r - beta*KL, so
    #   dL_rloo/ds = -K/((K-1)*N) * (r' - mean r');  TB (above): dL_TB/ds = -2/(beta*N) * (r' - mean r')
    #   => grad TB = 2(K-1)/(beta*K) * grad rloo  (K=2: 1/beta; K=3: 4/(3 beta)); cosine similarity 1.
    beta = 0.5
    s, inp = _identity_batch(k, beta)
    (g_tb,) = torch.autograd.grad(trajectory_balance(inp, LossConfig())[0], s)
    s, inp = _identity_batch(k, beta)
    (g_rloo,) = torch.autograd.grad(rloo(inp, LossConfig())[0], s)
    assert torch.nn.functional.cosine_similarity(g_tb, g_rloo, dim=0) > 0.999
    assert torch.allclose(g_tb, 2 * (k - 1) / (beta * k) * g_rloo)


# ------------------------------------------------------------------------------------------------ RLOO


def _rloo_batch(beta: float) -> LossInputs:
    # B=1, K=3, T=2.  s = [-2, -2, -1];  rho = [-3, -2, -2];  KL = s - rho = [1, 0, 1];  r = [1, 0, 2]
    return make([[-1.0, -1.0], [-2.0, PAD], [-0.5, -0.5]], [[-1.0, -2.0], [-2.0, -PAD], [-1.0, -1.0]],
                [[1, 1], [1, 0], [1, 1]], [1.0, 0.0, 2.0], 3, beta)


def test_rloo_hand_values():
    # beta = 0.5: r' = r - 0.5*KL = [0.5, 0, 1.5]
    # A = [0.5 - (0 + 1.5)/2, 0 - (0.5 + 1.5)/2, 1.5 - (0.5 + 0)/2] = [-0.25, -1, 1.25]
    # loss = -mean(A*s) = -((-0.25)(-2) + (-1)(-2) + (1.25)(-1))/3 = -(0.5 + 2 - 1.25)/3 = -1.25/3
    # d loss/d token = -A_j/3 on real tokens: [1/12, 1/12], [1/3, 0], [-5/12, -5/12]
    inp = _rloo_batch(0.5)
    loss, m = rloo(inp, LossConfig())
    assert close(loss, -1.25 / 3)
    assert close(grad(loss, inp), [[1 / 12, 1 / 12], [1 / 3, 0.0], [-5 / 12, -5 / 12]])
    assert m["loss/rloo"] == pytest.approx(-1.25 / 3)
    assert m["loss/advantage_mean"] == pytest.approx(0.0, abs=1e-12)
    assert m["loss/advantage_abs_mean"] == pytest.approx(2.5 / 3)  # (0.25 + 1 + 1.25)/3
    assert m["loss/kl_mean"] == pytest.approx(2 / 3)


def test_rloo_kl_penalty_uses_beta():
    # beta = 0: r' = r = [1, 0, 2]; A = [1 - 1, 0 - 1.5, 2 - 0.5] = [0, -1.5, 1.5]
    # loss = -(0 + 3 - 1.5)/3 = -0.5   (vs -1.25/3 with beta = 0.5)
    loss, _ = rloo(_rloo_batch(0.0), LossConfig())
    assert close(loss, -0.5)


# ------------------------------------------------------------------------------------------------ GRPO


def _grpo_batch(reward, padded: bool, beta: float = 0.0) -> LossInputs:
    # B=1, K=3, T=2; every real logp = -1, ref = logp (k3 = 0). Ratios per token:
    #   resp0 [1.5, 0.5]   resp1 [1, 1]   resp2 [1.1, 1] (or [1.1, PAD] when padded)
    mask = [[1, 1], [1, 1], [1, 0 if padded else 1]]
    logp = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, PAD if padded else -1.0]]
    ratios = [[1.5, 0.5], [1.0, 1.0], [1.1, math.exp(2 * PAD) if padded else 1.0]]  # pad ratio = inf in fp32
    return make(logp, logp, mask, reward, 3, beta, ratios=ratios)


HP_EXACT = LossConfig(clip_eps=0.2, std_eps=1e-12)  # std_eps ~ 0 so hand values are exact


def test_grpo_hand_values_and_clipped_token_has_no_gradient():
    # r = [0, 2, 4]: mean 2, unbiased std sqrt((4 + 0 + 4)/2) = 2 -> A = [-1, 0, 1]
    # resp0 (A=-1): ratio 1.5 > 1.2 but A<0 -> min(-1.5, -1.2) = -1.5, NOT clipped (pessimistic branch);
    #   ratio 0.5 < 0.8 with A<0 -> clipped: min(-0.5, -0.8) = -0.8
    #   per-token loss [1.5, 0.8], mean over its 2 tokens = 1.15
    # resp1 (A=0): 0.   resp2 (A=1, 1 real token): ratio 1.1 in [0.8, 1.2] -> obj 1.1, loss -1.1
    # loss = (1.15 + 0 - 1.1)/3 = 0.05/3
    # grads: d(-ratio*A)/dlogp = -ratio*A, weight 1/(len*N): resp0 t0 = 1.5/(2*3) = 0.25, t1 = 0 (clipped)
    #   resp2 t0 = -1.1/(1*3); padding 0
    inp = _grpo_batch([0.0, 2.0, 4.0], padded=True)
    loss, m = grpo(inp, HP_EXACT)
    assert close(loss, 0.05 / 3)
    g = grad(loss, inp)
    assert g[0, 1] == 0.0  # the clipped token
    assert close(g, [[0.25, 0.0], [0.0, 0.0], [-1.1 / 3, 0.0]])
    assert m["loss/clip_frac"] == pytest.approx(1 / 5)  # 1 of 5 real tokens (not the 1.5 one)
    assert m["loss/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1 + 1 + 1.1) / 5)
    assert m["loss/advantage_mean"] == pytest.approx(0.0, abs=1e-9)


def test_grpo_k3_kl_term_and_tied_group_has_zero_advantage():
    # B=1, K=2, T=2, tied rewards [1, 1]: std 0, A = 0/(0 + std_eps) = 0 (not NaN); ratios 1.
    # ref - logp = d: resp0 [0, ln2], resp1 [ln2, PAD]. k3 = e^d - d - 1: 0 at d=0, 1 - ln2 at d=ln2.
    # loss = beta * mean_j(mean_t k3) = 0.5 * ((1-ln2)/2 + (1-ln2)/1)/2 = 0.375 (1 - ln2)
    # d k3/d logp = -(e^d - 1) = -1 at d = ln2, 0 at d = 0; weight beta/(len*N):
    #   resp0 t1 = 0.5 * -1/(2*2) = -0.125; resp1 t0 = 0.5 * -1/(1*2) = -0.25
    logp = [[-1.0, -1.0], [-1.0, PAD]]
    ref = [[-1.0, -1.0 + LN2], [-1.0 + LN2, -PAD]]
    inp = make(logp, ref, [[1, 1], [1, 0]], [1.0, 1.0], 2, 0.5)
    loss, m = grpo(inp, LossConfig())
    assert close(loss, 0.375 * (1 - LN2))
    assert close(grad(loss, inp), [[0.0, -0.125], [-0.25, 0.0]])
    assert m["loss/advantage_abs_mean"] == 0.0
    assert m["loss/kl_k3_mean"] == pytest.approx(2 * (1 - LN2) / 3)  # over 3 real tokens
    # dr_grpo: same k3 tokens, summed and divided by N*T = 4: 0.5 * 2(1 - ln2)/4 = 0.25 (1 - ln2)
    inp = make(logp, ref, [[1, 1], [1, 0]], [1.0, 1.0], 2, 0.5)
    loss, _ = dr_grpo(inp, LossConfig())
    assert close(loss, 0.25 * (1 - LN2))
    assert close(grad(loss, inp), [[0.0, -0.125], [-0.125, 0.0]])  # 0.5 * -1/4 on both


def test_dr_grpo_hand_values():
    # Same batch as the grpo test, r = [0, 2, 4]: A = r - mean = [-2, 0, 2] (no std division)
    # resp0: [min(-3, -2.4) = -3, min(-1, -1.6) = -1.6] -> per-token loss [3, 1.6]; resp1: 0; resp2: [-2.2]
    # loss = (3 + 1.6 - 2.2)/(N*T = 6) = 2.4/6 = 0.4
    # grads = -ratio*A/6: resp0 t0 = 3/6, t1 = 0 (clipped); resp2 t0 = -2.2/6
    inp = _grpo_batch([0.0, 2.0, 4.0], padded=True)
    loss, m = dr_grpo(inp, HP_EXACT)
    assert close(loss, 0.4)
    assert close(grad(loss, inp), [[0.5, 0.0], [0.0, 0.0], [-2.2 / 6, 0.0]])
    assert m["loss/dr_grpo"] == pytest.approx(0.4) and m["loss/clip_frac"] == pytest.approx(1 / 5)


def test_dr_grpo_differs_from_grpo_only_through_lengths_when_std_is_one():
    # r = [0, 1, 2]: mean 1, unbiased std 1 -> both use A = [-1, 0, 1].
    # No padding: grpo = ([1.5, 0.8] -> 1.15, 0, [-1.1, -1] -> -1.05)/3 = 0.1/3
    #             dr   = (1.5 + 0.8 - 1.1 - 1)/6 = 0.2/6 = 0.1/3     (equal: every length is T)
    # resp2 padded to 1 token: grpo = (1.15 + 0 - 1.1)/3 = 0.05/3; dr = (1.5 + 0.8 - 1.1)/6 = 0.2
    full = _grpo_batch([0.0, 1.0, 2.0], padded=False)
    assert close(grpo(full, HP_EXACT)[0], 0.1 / 3) and close(dr_grpo(full, HP_EXACT)[0], 0.1 / 3)
    padded = _grpo_batch([0.0, 1.0, 2.0], padded=True)
    assert close(grpo(padded, HP_EXACT)[0], 0.05 / 3)
    assert close(dr_grpo(padded, HP_EXACT)[0], 0.2)


# ------------------------------------------------------------------------------------------------ PPO-clip


def _ppo_batch() -> LossInputs:
    # B=1, K=2, T=2, beta = 0.5. s = [-2, -1]; rho = [-3, -1]; KL = [1, 0]; r = [2, 0]
    # r' = r - 0.5*KL = [1.5, 0]; K=2 leave-one-out: A = [1.5 - 0, 0 - 1.5] = [1.5, -1.5]
    # ratios: resp0 [1.5, 1], resp1 [0.9, PAD]
    return make([[-1.0, -1.0], [-1.0, PAD]], [[-1.0, -2.0], [-1.0, -PAD]], [[1, 1], [1, 0]], [2.0, 0.0], 2, 0.5,
                ratios=[[1.5, 1.0], [0.9, 1.0]])


def test_ppo_clip_clipped_surrogate_hand_values():
    # resp0 (A=1.5): ratio 1.5 > 1.2 -> min(2.25, 1.8) = 1.8 (clipped); ratio 1 -> 1.5. Sum 3.3
    # resp1 (A=-1.5): ratio 0.9 in range -> -1.35
    # loss = -(3.3 - 1.35)/N=2 = -0.975
    # grads -ratio*A/2: resp0 t0 = 0 (clipped), t1 = -0.75; resp1 t0 = 0.9*1.5/2 = 0.675
    inp = _ppo_batch()
    loss, m = ppo_clip(inp, LossConfig(clip_eps=0.2))
    assert close(loss, -0.975)
    assert close(grad(loss, inp), [[0.0, -0.75], [0.675, 0.0]])
    assert m["loss/clip_frac"] == pytest.approx(1 / 3)
    assert m["loss/ratio_mean"] == pytest.approx(3.4 / 3)
    assert m["loss/advantage_abs_mean"] == pytest.approx(1.5) and m["loss/kl_mean"] == pytest.approx(0.5)


def test_ppo_clip_truncated_importance_weight_hand_values():
    # is_cap = 1.2: w = SG[min(ratio, 1.2)] = resp0 [1.2, 1], resp1 [0.9]; loss = -1/N sum w*A*logp
    # resp0: 1.2*1.5*(-1) + 1*1.5*(-1) = -3.3; resp1: 0.9*(-1.5)*(-1) = 1.35; loss = -(-3.3 + 1.35)/2 = 0.975
    # grads -w*A/2: resp0 t0 = -1.2*1.5/2 = -0.9 (capped, NOT zero as with clipping), t1 = -0.75; resp1 0.675
    inp = _ppo_batch()
    loss, m = ppo_clip(inp, LossConfig(is_cap=1.2))
    assert close(loss, 0.975)
    assert close(grad(loss, inp), [[-0.9, -0.75], [0.675, 0.0]])
    assert m["loss/clip_frac"] == pytest.approx(1 / 3)  # ratio 1.5 > cap


@pytest.mark.parametrize("is_cap", [None, 2.0])
def test_ppo_clip_on_policy_has_the_rloo_gradient(is_cap):
    # ratio = 1 everywhere: d/dlogp min(ratio*A, clip(ratio)*A) = A = d/dlogp (1*A*logp); tokens summed
    # per response and averaged over N, as rloo's -mean(A * s).
    _, inp = _identity_batch(3, 0.5)
    inp1 = dataclasses.replace(inp, logp=inp.logp.detach().clone().requires_grad_(True))
    g_ppo = grad(ppo_clip(inp1, LossConfig(is_cap=is_cap))[0], inp1)
    inp2 = dataclasses.replace(inp, logp=inp.logp.detach().clone().requires_grad_(True))
    g_rloo = grad(rloo(inp2, LossConfig())[0], inp2)
    assert torch.allclose(g_ppo, g_rloo) and g_rloo.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ online DPO


def _dpo_batch(reward) -> LossInputs:
    # B=2, K=3, T=2, beta = 0.5. Group 0: s = [-2, -1, -3], rho = [-1, -2, -3] -> s - rho = [-1, 1, 0]
    # Group 1: every s = -2, rho = -4 -> s - rho = 2.
    logp = [[-1.0, -1.0], [-1.0, PAD], [-1.5, -1.5], [-1.0, -1.0], [-1.0, -1.0], [-2.0, PAD]]
    ref = [[-0.5, -0.5], [-2.0, -PAD], [-1.0, -2.0], [-2.0, -2.0], [-2.0, -2.0], [-4.0, -PAD]]
    mask = [[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 0]]
    return make(logp, ref, mask, reward, 3, 0.5)


def test_online_dpo_hand_values_and_tied_group_skipped():
    # Group 0 rewards [1, 3, 2]: chosen = resp1 (s - rho = 1), rejected = resp0 (-1).
    # Group 1 rewards [1, 1, 1]: tied -> skipped.
    # m = 0.5 * (1 - (-1)) = 1; loss = -log sigmoid(1) = log(1 + e^-1)
    # d loss/dm = -sigmoid(-1); chosen tokens get 0.5 * -sigmoid(-1), rejected tokens +0.5 * sigmoid(-1)
    inp = _dpo_batch([1.0, 3.0, 2.0, 1.0, 1.0, 1.0])
    loss, m = online_dpo(inp, LossConfig())
    assert close(loss, math.log1p(math.exp(-1)))
    q = 0.5 * (1 / (1 + math.e))  # 0.5 * sigmoid(-1)
    assert close(grad(loss, inp), [[q, q], [-q, 0.0], [0, 0], [0, 0], [0, 0], [0, 0]])
    assert m["loss/pairs"] == 1.0 and m["loss/margin_mean"] == pytest.approx(1.0)
    assert m["loss/pref_acc"] == 1.0
    assert m["loss/kl_mean"] == pytest.approx(1.0)  # ([-1, 1, 0] + [2, 2, 2]) / 6


def test_online_dpo_all_groups_tied_gives_zero_loss_with_graph():
    inp = _dpo_batch([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    loss, m = online_dpo(inp, LossConfig())
    assert loss.item() == 0.0 and loss.requires_grad
    assert torch.equal(grad(loss, inp), torch.zeros(6, 2, dtype=F64))
    assert m["loss/pairs"] == 0.0 and m["loss/online_dpo"] == 0.0


# ------------------------------------------------------------------------------------------------ API and errors


def _generic(k=2, n=4, beta=0.1) -> LossInputs:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(n, 3, generator=g, dtype=F64)
    return LossInputs(logp=logp.requires_grad_(True), ref_logp=-torch.rand(n, 3, generator=g, dtype=F64),
                      behaviour_logp=logp.detach() - 0.1 * torch.randn(n, 3, generator=g, dtype=F64),
                      mask=torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]][:n], dtype=F64),
                      reward=torch.arange(n, dtype=F64), group_size=k, beta=beta)


def test_registry_names_and_metric_contract():
    assert set(LOSSES) == {"tb", "rloo", "grpo", "dr_grpo", "ppo_clip", "online_dpo"}
    for name, fn in LOSSES.items():
        inp = _generic()
        loss, m = fn(inp, LossConfig())
        assert loss.dim() == 0 and torch.isfinite(loss), name
        assert m[f"loss/{name}"] == pytest.approx(loss.item()), name
        assert "loss/kl_mean" in m, name
        assert all(key.startswith("loss/") and type(v) is float for key, v in m.items()), (name, m)
        g = grad(loss, inp)
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("pad", [PAD, -math.inf])
def test_padding_values_never_reach_loss_or_gradient(name, pad):
    # float32, padded positions with logp - behaviour = 100 and ref - logp = 100: exp(100) = inf in fp32,
    # and inf * 0 = NaN, so padding must be removed before any exp; a -inf log-prob in the padding (a masked
    # logit) gives -inf * 0 = NaN even in a plain masked sum, so it is removed with torch.where, never by
    # multiplying. The result must equal the same batch with zeros in the padding.
    def run(pad: float):
        inp = _generic(beta=0.1 if name != "online_dpo" else 0.5)
        pad_mask = inp.mask == 0
        logp = torch.where(pad_mask, pad, inp.logp.detach()).float().requires_grad_(True)
        inp = dataclasses.replace(inp, logp=logp, mask=inp.mask.float(), reward=inp.reward.float(),
                                  ref_logp=torch.where(pad_mask, 3 * pad, inp.ref_logp).float(),
                                  behaviour_logp=torch.where(pad_mask, -pad, inp.behaviour_logp).float())
        loss, _ = LOSSES[name](inp, LossConfig(is_cap=2.0) if name == "ppo_clip" else LossConfig())
        return loss, grad(loss, inp)

    loss0, g0 = run(0.0)
    loss_pad, g_pad = run(pad)
    assert torch.isfinite(loss_pad) and torch.isfinite(g_pad).all()
    assert torch.allclose(loss0, loss_pad) and torch.allclose(g0, g_pad)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_group_size_must_divide_batch(name):
    with pytest.raises(ValueError, match="3 responses is not a whole number of groups of 2"):
        LOSSES[name](_generic(k=2, n=3), LossConfig())


@pytest.mark.parametrize("name", ["rloo", "grpo", "dr_grpo", "ppo_clip", "online_dpo"])
def test_baselines_need_two_responses_per_prompt(name):
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        LOSSES[name](_generic(k=1), LossConfig())


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_tb_rejects_nonpositive_beta(beta):
    with pytest.raises(ValueError, match="beta"):
        trajectory_balance(_generic(beta=beta), LossConfig())


def test_beta_rules_of_the_baselines():
    with pytest.raises(ValueError, match="beta"):
        online_dpo(_generic(beta=0.0), LossConfig())  # DPO's margin scale: 0 makes the loss constant
    for name in ["rloo", "grpo", "dr_grpo", "ppo_clip"]:
        LOSSES[name](_generic(beta=0.0), LossConfig())  # no KL term: allowed
        with pytest.raises(ValueError, match="beta"):
            LOSSES[name](_generic(beta=-0.1), LossConfig())


def test_shape_mismatch_raises():
    inp = dataclasses.replace(_generic(), ref_logp=torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match="ref_logp"):
        trajectory_balance(inp, LossConfig())
    inp = dataclasses.replace(_generic(), reward=torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="reward"):
        grpo(inp, LossConfig())


def test_loss_config_validation():
    """The loss section rejects values the objectives cannot use, at construction and on assignment."""
    hp = LossConfig()
    with pytest.raises(ValueError, match="clip_eps"):
        hp.clip_eps = -0.3
    for bad in [dict(clip_eps=-0.1), dict(is_cap=0.0), dict(std_eps=0.0)]:
        with pytest.raises(ValueError):
            LossConfig(**bad)
