"""Trainer: batch from the replay buffer -> log pi_theta -> loss -> AdamW step (docs/algorithm.md section 2).

Owns the policy's float32 master weights, the optimizer and the beta / learning-rate schedules.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from tba import parallel
from tba.adapters import adapter_off, has_adapter, merged_tensors, pack_adapter
from tba.config import LossConfig, TrainerConfig
from tba.losses import LOSSES, LossInputs
from tba.scoring import forward_calls, token_logprobs, unpadded
from tba.types import Batch, PackedWeights, Probe
from tba.weights import pack_tensors, pack_weights

#: responses in the sync check's probe (:meth:`Trainer.probe`): one per prompt of the first batch, in order
PROBE_SAMPLES = 4


def linear_beta(step: int, beta_start: float, beta_end: float, anneal_steps: int) -> float:
    """KL coefficient at ``step``: linear from ``beta_start`` to ``beta_end`` over ``anneal_steps``, then flat.

    Source: TBA reference code, GSM8K 0.012 -> 0.004 over 500 steps (docs/algorithm.md section 4).
    """
    if anneal_steps <= 0 or step >= anneal_steps:
        return beta_end
    return beta_start + (beta_end - beta_start) * step / anneal_steps


def build_scheduler(optimizer, kind: str, total_steps: int, warmup_steps: int, decay_steps: int):
    """Learning-rate schedule from transformers (docs/algorithm.md section 4), one optimizer update per step.

    ``wsd``: warmup-stable-decay (GSM8K: 50 warmup, 450 stable, 500 decay); ``linear``: warmup then linear
    decay to 0 (TL;DR); ``constant``: warmup then flat.

    Update i (1-based) runs at transformers' schedule value for step i of a schedule one step longer: the
    scheduler steps after each update, so transformers' own step-0 value (0 during warmup) would make the
    first update a no-op, and the one-step-longer schedule keeps the last update's lr above 0 too. With
    warmup W the updates run at lr x 1/W, 2/W, ...; a linear decay over T updates at (T - i + 1) / (T + 1).
    """
    from transformers import optimization as opt

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # only its lr function is kept
    total = total_steps + 1
    if kind == "wsd":
        decay = min(decay_steps, max(0, total - warmup_steps))
        inner = opt.get_wsd_schedule(dummy, num_warmup_steps=warmup_steps, num_decay_steps=decay,
                                     num_stable_steps=total - warmup_steps - decay, decay_type="linear")
    elif kind == "linear":
        inner = opt.get_linear_schedule_with_warmup(dummy, warmup_steps, total)
    else:
        inner = opt.get_constant_schedule_with_warmup(dummy, warmup_steps)
    lr_at = inner.lr_lambdas[0]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step + 1))


class Trainer:
    """One optimizer step per :meth:`step` on a B x K batch, with gradient accumulation.

    Args:
        model: the policy (float32 master weights; trained under bf16 autocast when ``autocast_dtype``); a
            peft model (:func:`tba.adapters.add_adapter`) trains its adapter only.
        pad_id: tokenizer pad id.
        cfg: the ``trainer`` config section (lr and its schedule, the beta anneal, clipping, micro batch).
        loss: the ``loss`` config section (objective name and its hyper-parameters).
        temperature: divides logits before log-softmax (the searchers' ``searcher.temperature``).
        autocast_dtype: e.g. torch.bfloat16; None computes in float32.
        ref_model: frozen reference model pi_ref (eval mode, on the policy's device) when the trainer scores
            it (``model.reference_on: trainer``): samples that arrive without ``ref_logprobs`` are scored
            here, once per draw. ``model`` itself when it holds an adapter: pi_ref is then its base, scored
            with the adapter off under the policy's autocast (so an untrained adapter scores pi_ref exactly).
            None: every sample must carry them.
        publish_merged: with an adapter, :meth:`publish_weights` packs it merged into full weights
            (``model.lora.publish``) instead of the adapter alone.
        num_prompts: training prompts (``Sample.prompt_id`` < this): the size of the learned log Z table
            (``loss.log_z: learned``, :attr:`log_z`); needed only then.

    Inside a process group (:func:`tba.parallel.init_group`, one trainer per rank: ``trainer.num_workers``)
    every rank gets the same whole batch, trains its B/N prompt groups and all ranks take the same update,
    that of one process on the whole batch (:meth:`step`); ``model`` may then be sharded with FSDP2
    (:func:`tba.parallel.fully_shard_model`, before this constructor). Replicas start from rank 0's weights.
    ``unsharded``: with a sharded model, rank 0's unsharded copy of it (CPU), which :meth:`full_model` fills
    with the gathered weights for publication, evals and saving.

    Raises:
        ValueError: ``loss.name`` is not a key of :data:`tba.losses.LOSSES`; a learned log Z without
            ``num_prompts``.
    """

    def __init__(self, model, pad_id: int, cfg: TrainerConfig, loss: LossConfig, temperature: float,
                 autocast_dtype: torch.dtype | None = None, ref_model=None, publish_merged: bool = False,
                 num_prompts: int | None = None, unsharded=None):
        if loss.name not in LOSSES:
            raise ValueError(f"loss.name '{loss.name}' is unknown; allowed: {', '.join(LOSSES)}")
        self.model = model.train()
        self.pad_id = pad_id
        self.cfg, self.loss = cfg, loss
        self.loss_fn = LOSSES[loss.name]
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype
        self.ref_model = ref_model
        self.publish_merged = publish_merged
        self.rank, self.world = parallel.rank_and_world()
        self.distributed = parallel.active()  # collectives on: also with N = 1 (the NCCL check)
        self.sharded = parallel.is_sharded(model)
        self.unsharded = unsharded
        if self.distributed and not self.sharded:
            parallel.broadcast_parameters(model)  # replicas start bit-identical
        # a peft model's base is frozen: AdamW holds state for the adapter only
        self.params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": self.params}]
        self.log_z: torch.nn.Parameter | None = None  # [num_prompts] nats, loss.log_z learned only
        if loss.name == "tb" and loss.log_z == "learned":
            if not num_prompts:
                raise ValueError("loss.log_z learned: the trainer needs num_prompts (the log Z table's size)")
            self.log_z = torch.nn.Parameter(torch.zeros(num_prompts, device=next(model.parameters()).device))
            groups.append({"params": [self.log_z], "lr": loss.log_z_lr, "weight_decay": 0.0})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_schedule, cfg.max_steps, cfg.warmup_steps,
                                         cfg.decay_steps)
        if self.log_z is not None:  # the log Z table keeps its constant rate
            self.scheduler.lr_lambdas[1] = lambda step: 1.0
            self.optimizer.param_groups[1]["lr"] = loss.log_z_lr
        self.step_count = 0
        self.skipped_steps = 0
        # (prompt ids, response ids) of the sync check's probe responses, fixed at the first step (checkpointed)
        self.probe_tokens: list[tuple[list[int], list[int]]] | None = None

    def extra_state(self) -> dict:
        """The trainer's state besides weights, optimizer and scheduler, JSON-safe, for checkpoints: step,
        skipped steps, the sync check's probe responses and the learned log Z table (float32 values, exact
        through JSON's float64)."""
        return {"step": self.step_count, "skipped_steps": self.skipped_steps, "probe": self.probe_tokens,
                "log_z": None if self.log_z is None else self.log_z.tolist()}

    def load_extra_state(self, extra: dict) -> None:
        """Restore :meth:`extra_state` (a checkpoint from before the sync check has no probe).

        Raises:
            ValueError: the trainer learns log Z and the checkpoint has no table (it was written with
                ``loss.log_z: vargrad``), or one of another size.
        """
        self.step_count, self.skipped_steps = extra["step"], extra["skipped_steps"]
        self.probe_tokens = extra.get("probe")
        if self.log_z is not None:
            table = extra.get("log_z")
            if table is None or len(table) != len(self.log_z):
                raise ValueError(f"checkpoint has no learned log Z table of {len(self.log_z)} prompts: was "
                                 "loss.log_z or the task changed since?")
            with torch.no_grad():
                self.log_z.copy_(torch.tensor(table, dtype=torch.float32))

    def beta_at(self, step: int) -> float:
        """KL coefficient beta at trainer ``step`` (:func:`linear_beta` over the config's anneal)."""
        c = self.cfg
        return linear_beta(step, c.beta_start, c.beta_end, c.beta_anneal_steps)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.model.device.type, dtype=self.autocast_dtype)

    def _share_flags(self, model, prompts: list[list[int]], responses: list[list[int]]) -> list[bool]:
        """Whether each micro batch may share its prompts' pass (:func:`tba.scoring.token_logprobs`). A sharded
        model's forward is a collective, so its ranks agree on the number of forward calls: a micro batch
        shares only where every rank's would make two (:func:`tba.scoring.forward_calls`); else all True."""
        mb = self.cfg.micro_batch_size
        flags = [forward_calls(model, prompts[i:i + mb], responses[i:i + mb]) == 2 for i in range(0, len(prompts), mb)]
        return parallel.agree_all(flags) if self.sharded else [True] * len(flags)

    def _logprobs(self, prompts: list[list[int]], responses: list[list[int]], width: int,
                  grad: bool, share: list[bool]) -> torch.Tensor:
        """Per-token log pi_theta of every response, micro batch by micro batch: [N, width] float32."""
        mb = self.cfg.micro_batch_size
        with torch.set_grad_enabled(grad), self._autocast():
            return torch.cat([self._pad(token_logprobs(self.model, prompts[i:i + mb], responses[i:i + mb],
                                                       self.temperature, self.pad_id, share[i // mb])[0], width)
                              for i in range(0, len(prompts), mb)]).float()

    def _backward_micro(self, prompts, responses, grad_logp: torch.Tensor, share: list[bool]) -> None:
        """Backpropagate a whole-batch dLoss/dlogp ([N, T]) micro batch by micro batch (exact: the loss
        depends on the parameters only through logp)."""
        mb = self.cfg.micro_batch_size
        for i in range(0, len(prompts), mb):
            with self._autocast():
                lp, _ = token_logprobs(self.model, prompts[i:i + mb], responses[i:i + mb], self.temperature,
                                       self.pad_id, share[i // mb])
            (lp.float() * grad_logp[i:i + mb, : lp.shape[1]]).sum().backward()

    @torch.no_grad()
    def _score_reference(self, samples: list) -> None:
        """Fill ``ref_logprobs`` of the samples that lack them with the trainer's reference model.

        Raises:
            ValueError: a sample lacks them and the trainer holds no reference model.
        """
        todo = [s for s in samples if s.ref_logprobs is None]
        if not todo:
            return
        if self.ref_model is None:
            raise ValueError("samples arrived without reference log-probs and the trainer has no reference model "
                             "(model.reference_on must be the same for searchers and trainer)")
        mb = self.cfg.micro_batch_size
        own = self.ref_model is self.model  # the policy's base, with the adapter off
        share = self._share_flags(self.ref_model, [s.prompt_ids for s in todo], [s.response_ids for s in todo]) \
            if own else [True] * -(-len(todo) // mb)  # a separate reference is never sharded
        with adapter_off(self.ref_model) as ref, self._autocast() if own else contextlib.nullcontext():
            parts = [todo[i:i + mb] for i in range(0, len(todo), mb)]
            scored = [token_logprobs(ref, [s.prompt_ids for s in part], [s.response_ids for s in part],
                                     self.temperature, self.pad_id, flag) for part, flag in zip(parts, share)]
        for part, (lp, mask) in zip(parts, scored):
            for s, row in zip(part, unpadded(lp, mask)):
                s.ref_logprobs = row

    def _inputs(self, batch: Batch, logp: torch.Tensor, beta: float,
                ref_logp: torch.Tensor | None = None) -> LossInputs:
        """The loss inputs of ``batch``: behaviour and reference log-probs padded to ``logp``'s [N, T], on its
        device (``ref_logp``: the reference's, when given already [N, T])."""
        samples, width, dev = batch.samples, logp.shape[1], logp.device
        if ref_logp is None:
            ref_logp = _pad_rows([s.ref_logprobs for s in samples], width)
        return LossInputs(
            logp=logp, ref_logp=ref_logp.to(dev),
            behaviour_logp=_pad_rows([s.logprobs for s in samples], width).to(dev),
            mask=_pad_rows([[1.0] * len(s.response_ids) for s in samples], width).to(dev),
            reward=torch.tensor([s.reward for s in samples], dtype=torch.float32, device=dev),
            group_size=batch.group_size, beta=beta,
            log_z=None if self.log_z is None else self.log_z[[s.prompt_id for s in samples[::batch.group_size]]],
        )

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns ``loss/*``, ``train/*`` and ``perf/*`` metrics.

        The loss couples the K responses of a prompt (VarGrad log Z, docs/algorithm.md section 1), so with
        several micro batches it is evaluated on the whole batch from no-grad log-probs first, then
        dLoss/dlogp is backpropagated micro batch by micro batch. With one micro batch a single forward with
        grad suffices. A non-finite loss or gradient norm skips the update (``train/skipped`` = 1).

        The first batch also fixes the sync check's probe responses (:meth:`probe`).

        In a process group of N ranks every rank is given the same whole ``batch`` and runs the forward and
        backward passes of its own B/N prompt groups only (:func:`tba.parallel.shard_groups`). The ranks then
        exchange their per-token log-probs (an [N_rows, T] all-gather, no gradients), so each evaluates the
        loss of the whole batch, exactly the single process's value for every objective (TB's per-prompt log Z,
        the baselines' group advantages, Dr. GRPO's padded width, online DPO's pair count), and backpropagates
        its own rows of dLoss/dlogp, the micro-batching rule above across ranks. The gradients are then summed
        over the ranks (:func:`tba.parallel.sum_gradients`, or FSDP2's reduce-scatter as a sum), which gives
        the whole batch's gradient; clipping, the skip rule and AdamW see the same numbers on every rank.
        Metrics are the whole batch's (rank 0 reports them).
        """
        t0 = time.perf_counter()
        step = self.step_count  # a sample's staleness at this step is step - policy_version
        if self.probe_tokens is None:
            self.probe_tokens = pick_probe(batch)
        whole = batch
        if self.distributed:
            batch = parallel.shard_groups(whole, self.rank, self.world)
        self._score_reference(batch.samples)
        beta = self.beta_at(self.step_count)
        prompts = [s.prompt_ids for s in batch.samples]
        responses = [s.response_ids for s in batch.samples]
        width = max(1, max(len(s.response_ids) for s in whole.samples))  # the whole batch's T, on every rank
        single = len(prompts) <= self.cfg.micro_batch_size
        share = self._share_flags(self.model, prompts, responses)
        self.optimizer.zero_grad(set_to_none=True)
        logp = self._logprobs(prompts, responses, width, grad=single, share=share)
        ref_logp = None
        if self.distributed:  # every rank's rows: the loss is the whole batch's
            lo = self.rank * len(prompts)
            logp = parallel.gather_rows(logp if single else logp.requires_grad_(True))
            own_ref = _pad_rows([s.ref_logprobs for s in batch.samples], width).to(logp.device)
            ref_logp = parallel.gather_rows(own_ref)
        inp = self._inputs(whole, logp if single or self.distributed else logp.requires_grad_(True), beta, ref_logp)
        loss, metrics = self.loss_fn(inp, self.loss)
        if single:
            loss.backward()
        else:
            grads = torch.autograd.grad(loss, [logp] + ([self.log_z] if self.log_z is not None else []))
            if self.log_z is not None:  # every rank's loss is the whole batch's: its log Z gradient too
                self.log_z.grad = grads[1]
            rows = grads[0][lo:lo + len(prompts)] if self.distributed else grads[0]  # this rank's rows of dLoss/dlogp
            self._backward_micro(prompts, responses, rows, share)
        if self.distributed and not self.sharded:
            parallel.sum_gradients(self.params)
        # max_norm inf measures the norm and scales nothing
        grad_norm = parallel.total_norm(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf))
        skipped = not (math.isfinite(loss.item()) and math.isfinite(grad_norm))
        if skipped:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # free the gradients between steps (evals, checkpoints)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step_count += 1
        dt = time.perf_counter() - t0
        n_tokens = int(inp.mask.sum()) + sum(len(s.prompt_ids) for s in whole.samples)
        # how far the policy's log-probs are from the reference's on these tokens; at step 0, with the
        # policy equal to the reference, anything but 0 is precision (bf16 autocast vs the bf16 reference)
        gap = (inp.logp.detach() - inp.ref_logp) * inp.mask  # [N, T] nats
        # staleness 0: generated with the weights being trained, so behaviour and trainer log-probs are the same
        # distribution and differ by precision only (a larger gap: the sync, or the searchers' log-probs, broke)
        fresh = torch.tensor([s.policy_version == step for s in whole.samples], device=inp.mask.device)
        if fresh.any():
            fresh_mask = inp.mask[fresh]
            fresh_gap = (inp.logp.detach()[fresh] - inp.behaviour_logp[fresh]).abs() * fresh_mask
            metrics["train/fresh_behaviour_gap"] = float(fresh_gap.sum() / fresh_mask.sum().clamp(min=1))
        metrics.update({
            "train/abs_logratio_token_mean": float(gap.abs().sum() / inp.mask.sum().clamp(min=1)),
            "train/abs_logratio_seq_mean": float(gap.sum(-1).abs().mean()),
            "train/reward_mean": inp.reward.mean().item(), "train/beta": beta, "train/lr": lr,
            "train/grad_norm": grad_norm, "train/skipped": float(skipped),
            "train/clipped": float(self.cfg.grad_clip is not None and grad_norm > self.cfg.grad_clip),
            "train/response_len_mean": float(inp.mask.sum(-1).mean()),
            "perf/train_step_s": dt, "perf/train_tokens_per_s": n_tokens / dt,
        })
        metrics.update(whole.metrics)
        return metrics

    @staticmethod
    def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    def full_model(self):
        """The policy as one unsharded module: the trained model itself, or, when it is sharded, rank 0's
        :attr:`unsharded` copy loaded with the gathered weights (the adapter only, with LoRA: the base never
        changes). Every rank of a sharded trainer must call it (it gathers); the others get None."""
        if not self.sharded:
            return self.model
        full = parallel.full_state_dict(self.model, trainable_only=has_adapter(self.model))
        if self.rank != 0:
            return None
        self.unsharded.load_state_dict(full, strict=not has_adapter(self.model))
        return self.unsharded

    def publish_weights(self, dtype: torch.dtype | None = None, probe: bool = True) -> PackedWeights | None:
        """The policy weights for the searchers, packed in one CPU buffer and cast to ``dtype`` (see
        :func:`tba.weights.pack_weights`; bf16 halves the bytes); with an adapter, the adapter only
        (:func:`tba.adapters.pack_adapter`), or with ``publish_merged`` base + adapter as full weights
        (:func:`tba.adapters.merged_tensors`). The pack carries the sync check's :meth:`probe` unless ``probe``
        is False (a pack no searcher checks: the eval engine's). A sharded trainer's ranks all call it (the
        probe's forward and :meth:`full_model` are collectives); rank 0 packs, the others get None."""
        probed = self.probe() if probe else None
        model = self.full_model()
        if model is None:
            return None
        packed = pack_policy(model, dtype, self.publish_merged)
        packed.probe = probed
        return packed

    @torch.no_grad()
    def probe(self) -> Probe | None:
        """The probe responses (:attr:`probe_tokens`) with their per-token log-probs under the current policy as
        the trainer scores it (master weights under its autocast, eval mode) at temperature 1 (which vLLM's
        scoring needs); a searcher scores the same responses with its engine after loading these weights
        (``Searcher.load_weights``). None before the first step has fixed them."""
        if not self.probe_tokens:
            return None
        prompts, responses = [list(p) for p, _ in self.probe_tokens], [list(r) for _, r in self.probe_tokens]
        training = self.model.training
        self.model.eval()  # no dropout (a LoRA adapter's): the engines score without it
        try:
            with self._autocast():
                lp, mask = token_logprobs(self.model, prompts, responses, 1.0, self.pad_id)
        finally:
            self.model.train(training)
        return Probe(prompts, responses, unpadded(lp, mask), temperature=1.0)


def pack_policy(model, dtype: torch.dtype | None = None, merged: bool = False) -> PackedWeights:
    """An unsharded policy packed for the searchers: its LoRA adapter (:func:`tba.adapters.pack_adapter`), or
    with ``merged`` base + adapter as full weights (:func:`tba.adapters.merged_tensors`,
    ``model.lora.publish``), or all its weights (:func:`tba.weights.pack_weights`), cast to ``dtype``; no
    probe."""
    if not has_adapter(model):
        return pack_weights(model, dtype)
    return pack_tensors(merged_tensors(model), dtype) if merged else pack_adapter(model, dtype)


def pick_probe(batch: Batch, n: int = PROBE_SAMPLES) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of ``n`` samples of ``batch`` for the sync check: the first response of each
    prompt in batch order, then the second of each, ... (distinct prompts first)."""
    k, groups = batch.group_size, batch.num_prompts
    order = [batch.samples[g * k + j] for j in range(k) for g in range(groups)]
    return [(list(s.prompt_ids), list(s.response_ids)) for s in order[:n]]


def _pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out
