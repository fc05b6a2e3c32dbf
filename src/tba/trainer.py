"""Trainer: batch from the replay buffer -> log pi_theta -> loss -> AdamW step (TBA section 2).

Owns the policy's float32 master weights, the optimizer and the beta / learning-rate schedules.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from tba.losses import LOSSES, LossHParams, LossInputs
from tba.models import token_logprobs
from tba.types import Batch, PackedWeights
from tba.weights import pack_weights


def linear_beta(step: int, beta_start: float, beta_end: float, anneal_steps: int) -> float:
    """KL coefficient at ``step``: linear from ``beta_start`` to ``beta_end`` over ``anneal_steps``, then flat.

    Source: TBA reference code, GSM8K 0.012 -> 0.004 over 500 steps (algorithm.md section 4).
    """
    if anneal_steps <= 0 or step >= anneal_steps:
        return beta_end
    return beta_start + (beta_end - beta_start) * step / anneal_steps


def build_scheduler(optimizer, kind: str, total_steps: int, warmup_steps: int, decay_steps: int):
    """Learning-rate schedule from transformers (algorithm.md section 4).

    ``wsd``: warmup-stable-decay (GSM8K: 50 warmup, 450 stable, 500 decay); ``linear``: warmup then linear
    decay to 0 (TL;DR); ``constant``: warmup then flat.
    """
    from transformers import optimization as opt

    if kind == "wsd":
        decay = min(decay_steps, max(0, total_steps - warmup_steps))
        return opt.get_wsd_schedule(optimizer, num_warmup_steps=warmup_steps, num_decay_steps=decay,
                                    num_stable_steps=total_steps - warmup_steps - decay, decay_type="linear")
    if kind == "linear":
        return opt.get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    return opt.get_constant_schedule_with_warmup(optimizer, warmup_steps)


class Trainer:
    """One optimizer step per :meth:`step` on a B x K batch, with gradient accumulation.

    Args:
        model: the policy (float32 master weights; trained under bf16 autocast when ``autocast_dtype``).
        pad_id: tokenizer pad id.
        loss_name: key of :data:`tba.losses.LOSSES`.
        loss_hp: extra loss hyperparameters.
        temperature: divides logits before log-softmax (same as the searchers').
        lr, weight_decay, grad_clip: AdamW and clipping.
        lr_schedule, warmup_steps, decay_steps, total_steps: see :func:`build_scheduler`.
        beta_start, beta_end, beta_anneal_steps: see :func:`linear_beta`.
        micro_batch_size: responses per forward/backward.
        autocast_dtype: e.g. torch.bfloat16; None computes in float32.
    """

    def __init__(self, model, pad_id: int, *, loss_name: str = "tb", loss_hp: LossHParams | None = None,
                 temperature: float = 0.7, lr: float = 1e-5, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 lr_schedule: str = "wsd", warmup_steps: int = 0, decay_steps: int = 0, total_steps: int = 100,
                 beta_start: float = 0.012, beta_end: float = 0.004, beta_anneal_steps: int = 500,
                 micro_batch_size: int = 16, autocast_dtype: torch.dtype | None = None):
        if loss_name not in LOSSES:
            raise ValueError(f"loss.name '{loss_name}' is unknown; allowed: {', '.join(LOSSES)}")
        self.model = model.train()
        self.pad_id = pad_id
        self.loss_fn = LOSSES[loss_name]
        self.loss_hp = loss_hp or LossHParams()
        self.temperature = temperature
        self.grad_clip = grad_clip
        self.beta = (beta_start, beta_end, beta_anneal_steps)
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = autocast_dtype
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.scheduler = build_scheduler(self.optimizer, lr_schedule, total_steps, warmup_steps, decay_steps)
        self.step_count = 0
        self.skipped_steps = 0

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.model.device.type, dtype=self.autocast_dtype)

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns ``loss/*``, ``train/*`` and ``perf/*`` metrics.

        The loss is computed on the whole batch at once from per-sequence log-probs, because the VarGrad
        log Z couples the K responses of a prompt; the backward pass is then split into micro batches by
        re-running forwards with the (detached) per-sequence gradient of the loss.
        A non-finite loss or gradient norm skips the update (``train/skipped`` = 1).
        """
        t0 = time.perf_counter()
        beta = linear_beta(self.step_count, *self.beta)
        samples = batch.samples
        n = len(samples)
        prompts = [s.prompt_ids for s in samples]
        responses = [s.response_ids for s in samples]
        t_len = max(1, max(len(r) for r in responses))
        mb = self.micro_batch_size

        self.optimizer.zero_grad(set_to_none=True)
        single = n <= mb  # one micro batch: a single forward with grad suffices
        # The loss couples the K responses of a prompt (VarGrad log Z), so with several micro batches it is
        # evaluated on the whole batch from no-grad log-probs first, then dLoss/dlogp is backpropagated
        # micro batch by micro batch (exact: the loss depends on the parameters only through logp).
        with torch.set_grad_enabled(single), self._autocast():
            logp = torch.cat([self._pad(token_logprobs(self.model, prompts[i:i + mb], responses[i:i + mb],
                                                       self.temperature, self.pad_id)[0], t_len)
                              for i in range(0, n, mb)]).float()  # [N, T]
        mask = _pad_rows([[1.0] * len(r) for r in responses], t_len)
        inp = LossInputs(
            logp=logp if single else logp.requires_grad_(True),
            ref_logp=_pad_rows([s.ref_logprobs for s in samples], t_len),
            behaviour_logp=_pad_rows([s.logprobs for s in samples], t_len),
            mask=mask, reward=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            group_size=batch.group_size, beta=beta,
        )
        loss, metrics = self.loss_fn(inp, self.loss_hp)
        if single:
            loss.backward()
        else:
            (grad_logp,) = torch.autograd.grad(loss, inp.logp)  # [N, T]
            for i in range(0, n, mb):
                with self._autocast():
                    lp, _ = token_logprobs(self.model, prompts[i:i + mb], responses[i:i + mb], self.temperature,
                                           self.pad_id)
                (lp.float() * grad_logp[i:i + mb, : lp.shape[1]]).sum().backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        skipped = not (math.isfinite(loss.item()) and math.isfinite(grad_norm))
        if skipped:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # free the gradients between steps (evals, checkpoints)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step_count += 1
        n_tokens = int(mask.sum()) + sum(len(p) for p in prompts)
        dt = time.perf_counter() - t0
        rewards = inp.reward
        metrics.update({
            "train/reward_mean": rewards.mean().item(),
            "train/beta": beta,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/skipped": float(skipped),
            "train/response_len_mean": float(mask.sum(-1).mean()),
            "perf/train_step_s": dt,
            "perf/train_tokens_per_s": n_tokens / dt,
        })
        metrics.update(batch.metrics)
        return metrics

    @staticmethod
    def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    def publish_weights(self, dtype: torch.dtype | None = None) -> PackedWeights:
        """The policy weights for the searchers, packed in one CPU buffer and cast to ``dtype`` (see
        :func:`tba.weights.pack_weights`; bf16 halves the bytes)."""
        return pack_weights(self.model, dtype)


def _pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out
