"""Data-parallel and FSDP2 trainer steps (``trainer.num_workers``, ``trainer.fsdp``) against one process.

Real gloo process groups of 2 ranks (torch.multiprocessing spawn, loopback rendezvous) on the 2-layer SmolLM2
with its vocabulary cut to the first 2048 tokens: the tied embedding and head hold 80% of the 2-layer model's
parameters and most of a step's work, and the sharding, gradient sums and checkpoints tested here do not depend
on the vocabulary's size (docs/testing.md gives the time saved). No Ray. One spawn runs every scenario in turn
(data-parallel and FSDP2, TB and RLOO, micro-batched; FSDP2 with a LoRA adapter and with the reference scored by
the trainer; a data-parallel and a sharded checkpoint round trip) and writes each rank-0 result to a file, and a
1-rank spawn reloads the sharded checkpoint; the tests compare them with a single process's step on the same
whole batch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tba.config import LossConfig, TrainerConfig
from tba.types import Batch, Sample

B, K, MICRO = 4, 4, 3  # 2 prompt groups x 4 responses per rank: micro batches of 3, 3 and 2
VOCAB = 2048  # token ids of the tests' models (see the module docstring)
LR = 1e-4
SCENARIOS = [("dp", "tb"), ("dp", "rloo"), ("fsdp", "tb"), ("fsdp", "rloo"), ("dp", "dr_grpo"),
             ("dp", "online_dpo"), ("dp", "tb-logz"), ("fsdp", "tb-lora"), ("fsdp", "tb-ref")]
# tb-logz: TB with a learned log Z (loss.log_z); tb-lora: a LoRA adapter, the reference scored by the trainer as
# the sharded base with the adapter off; tb-ref: the reference scored by the trainer with its own (unsharded) model


def make_batch(model) -> Batch:
    """B x K responses of different lengths to B prompts (random token ids below :data:`VOCAB`), behaviour and
    reference log-probs from ``model`` (tied rewards in group 0, so online DPO uses fewer pairs on rank 0 than on
    rank 1)."""
    from tba.scoring import token_logprobs

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, VOCAB, (4 + i,), generator=g).tolist() for i in range(B)]
    flat_p, flat_r = [], []
    for i, p in enumerate(prompts):
        for j in range(K):
            flat_p.append(p)
            flat_r.append(torch.randint(10, VOCAB, (2 + (3 * i + j) % 6,), generator=g).tolist())
    with torch.no_grad():
        lp, _ = token_logprobs(model, flat_p, flat_r, 0.7, 0)
    rewards = [0.0] * K + [float((i * 7) % 3) for i in range(K, B * K)]
    samples = [Sample(i // K, p, r, rewards[i], (lp[i, : len(r)] + 0.05).tolist(), (lp[i, : len(r)] - 0.1).tolist(), 0)
               for i, (p, r) in enumerate(zip(flat_p, flat_r))]
    return Batch(samples, K)


def policy_for(model_path, loss: str):
    """The scenario's policy: the 2-layer model, with a rank-4 LoRA adapter for tb-lora."""
    from tba.adapters import add_adapter
    from tba.config import LoraSettings

    model = _load(model_path)
    return add_adapter(model, LoraSettings(r=4)) if loss == "tb-lora" else model


def batch_for(batch: Batch, loss: str) -> Batch:
    """A copy of ``batch``; without reference log-probs where the trainer scores them (tb-lora, tb-ref)."""
    import copy

    out = copy.deepcopy(batch)
    if loss in ("tb-lora", "tb-ref"):
        for s in out.samples:
            s.ref_logprobs = None
    return out


def trainer_for(model, loss: str, model_path=None):
    from tba.trainer import Trainer

    if loss in ("tb-lora", "tb-ref"):
        ref = model if loss == "tb-lora" else _load(model_path).eval()
        cfg = TrainerConfig(micro_batch_size=MICRO, lr=LR, lr_schedule="constant", grad_clip=1e9,
                            prompts_per_step=B, group_size=K)
        return Trainer(model, 0, cfg, LossConfig(name="tb"), temperature=0.7, ref_model=ref)
    cfg = TrainerConfig(micro_batch_size=MICRO, lr=LR, lr_schedule="constant", grad_clip=1e9, prompts_per_step=B,
                        group_size=K)
    if loss == "tb-logz":  # the learned table: every rank's loss is the whole batch's, so is its gradient
        return Trainer(model, 0, cfg, LossConfig(name="tb", log_z="learned"), temperature=0.7, num_prompts=B)
    return Trainer(model, 0, cfg, LossConfig(name=loss), temperature=0.7)


def grads_of(trainer) -> list[torch.Tensor]:
    """Records the gradients the optimizer sees at its next step (full tensors, also under FSDP2)."""
    seen: list[torch.Tensor] = []

    def record(optimizer, args, kwargs):
        seen.extend(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                    for p in trainer.params)

    trainer.optimizer.register_step_pre_hook(record)
    return seen


def _load(model_path):
    from tba.models import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(model_path, torch.float32, 2)
    model.resize_token_embeddings(VOCAB)  # keeps the first VOCAB rows; the head stays tied to them
    return model


def _worker(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    """One rank: every scenario in turn; rank 0 saves parameters, gradients and metrics per scenario."""
    import copy

    from tba import checkpoint, parallel

    torch.set_num_threads(1)
    parallel.init_group(rank, world, port, "cpu", timeout_s=120)
    batch = make_batch(_load(model_path))
    for kind, loss in SCENARIOS:
        model = policy_for(model_path, loss)
        unsharded = None
        if kind == "fsdp":
            unsharded = copy.deepcopy(model) if rank == 0 else None
            parallel.fully_shard_model(model)
        tr = trainer_for(model, loss, model_path)
        tr.unsharded = unsharded
        grads = grads_of(tr)
        metrics = tr.step(batch_for(batch, loss))
        full = tr.full_model()
        if rank == 0:
            torch.save({"params": {n: p.detach().clone() for n, p in full.named_parameters()}, "grads": grads,
                        "metrics": metrics, "log_z": tr.log_z}, f"{out}/{kind}-{loss}.pt")
        if kind == "dp" and loss == "tb":  # rank 0's checkpoint (today's format), read by both ranks: the same
            ckpt = Path(out) / "dp-ckpt"
            if rank == 0:
                ckpt.mkdir(exist_ok=True)
                checkpoint.save_trainer(ckpt, tr.model, tr.optimizer, tr.scheduler, tr.extra_state())
            torch.distributed.barrier()
            tr.step(copy.deepcopy(batch))
            tr2 = trainer_for(_load(model_path), loss)
            tr2.load_extra_state(checkpoint.load_trainer(ckpt, tr2.model, tr2.optimizer, tr2.scheduler))
            tr2.step(copy.deepcopy(batch))
            torch.save({"continued": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
                        "resumed": {n: p.detach().clone() for n, p in tr2.model.named_parameters()},
                        "step": tr2.step_count}, f"{out}/dp-resume-{rank}.pt")  # each rank's own replica
        if kind == "fsdp" and loss == "tb":  # a sharded checkpoint, a second step, and the step again resumed
            ckpt = Path(out) / "ckpt"
            if rank == 0:
                ckpt.mkdir(exist_ok=True)
            torch.distributed.barrier()
            checkpoint.save_trainer_sharded(ckpt, tr.model, tr.optimizer, tr.scheduler, {"step": tr.step_count})
            saved = _state(tr)
            if rank == 0:
                torch.save(saved, f"{out}/at-checkpoint.pt")
            tr.step(copy.deepcopy(batch))
            after = tr.full_model()
            model2 = _load(model_path)
            parallel.fully_shard_model(model2)
            tr2 = trainer_for(model2, loss)
            tr2.unsharded = copy.deepcopy(unsharded) if rank == 0 else None
            extra = checkpoint.load_trainer_sharded(ckpt, tr2.model, tr2.optimizer, tr2.scheduler)
            tr2.step_count = extra["step"]
            tr2.step(copy.deepcopy(batch))
            resumed = tr2.full_model()
            if rank == 0:
                torch.save({"continued": {n: p.detach().clone() for n, p in after.named_parameters()},
                            "resumed": {n: p.detach().clone() for n, p in resumed.named_parameters()},
                            "step": extra["step"]}, f"{out}/resume.pt")
    parallel.close_group()


def _state(trainer) -> dict:
    """Full (unsharded) parameters and AdamW second moments of a sharded trainer (every rank must call)."""
    moments = [trainer.optimizer.state[p]["exp_avg_sq"] for p in trainer.params]
    full = trainer.full_model()
    return {"params": None if full is None else {n: p.detach().clone() for n, p in full.named_parameters()},
            "exp_avg_sq": [m.full_tensor() for m in moments]}


def _reshard_worker(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    """Load the 2-rank sharded checkpoint into a 1-rank FSDP2 trainer; save what it restored."""
    import copy

    from tba import checkpoint, parallel

    torch.set_num_threads(1)
    parallel.init_group(rank, world, port, "cpu", timeout_s=120)
    model = _load(model_path)
    unsharded = copy.deepcopy(model)
    parallel.fully_shard_model(model)
    tr = trainer_for(model, "tb")
    tr.unsharded = unsharded
    extra = checkpoint.load_trainer_sharded(Path(out) / "ckpt", tr.model, tr.optimizer, tr.scheduler)
    torch.save({**_state(tr), "step": extra["step"]}, f"{out}/resharded.pt")
    parallel.close_group()


@pytest.fixture(scope="module")
def ranked(model_path, tmp_path_factory):
    """Run :func:`_worker` on 2 gloo ranks once; the folder of rank 0's results."""
    import torch.multiprocessing as mp

    from tba.parallel import free_port

    out = tmp_path_factory.mktemp("ranks")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, free_port(), model_path, str(out)), nprocs=2, join=True)
    mp.spawn(_reshard_worker, args=(1, free_port(), model_path, str(out)), nprocs=1, join=True)
    return out


@pytest.fixture(scope="module")
def single(model_path):
    """One process's step on the whole batch, per objective: (parameters, gradients, metrics)."""

    batch = make_batch(_load(model_path))
    out = {}
    for loss in {loss for _, loss in SCENARIOS}:
        tr = trainer_for(policy_for(model_path, loss), loss, model_path)
        grads = grads_of(tr)
        metrics = tr.step(batch_for(batch, loss))
        trained = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}  # LoRA: A, B
        out[loss] = (trained, grads, metrics, tr.log_z)
    return out


@pytest.mark.parametrize("kind,loss", SCENARIOS)
def test_two_ranks_take_the_single_process_step(ranked, single, kind, loss):
    """2 gloo ranks (data-parallel, or FSDP2-sharded) with micro batches of 3 take the update of one process on
    the whole batch: the same gradient (relative 1e-5), the same loss metrics, parameters to 1e-6 (float32).

    Parameters are compared where the two gradients agree elementwise to 1% (over 99.89% of the elements;
    measured: at most 2.6e-7 apart there): AdamW's first update is lr x g / (|g| + 1e-8), so an element whose
    gradient is float32 rounding noise moves by up to +-lr in any two summation orders (one process
    micro-batched at 3 against 16 differs so too); those stay within AdamW's bound of 2 lr.
    """
    got = torch.load(ranked / f"{kind}-{loss}.pt")
    params, grads, metrics, log_z = single[loss]
    g1 = torch.cat([g.flatten() for g in grads])
    g2 = torch.cat([g.flatten() for g in got["grads"]])
    assert g1.norm() > 0
    assert (g1 - g2).norm() / g1.norm() < 1e-5
    names = list(params)  # the trained parameters in named_parameters order: that of trainer.params and the grads
    p1 = torch.cat([params[n].flatten() for n in names])
    p2 = torch.cat([got["params"][n].flatten() for n in names])
    agree = (g1 - g2).abs() <= 1e-2 * g1.abs()  # elementwise to 1%: AdamW's updates then differ by <= lr / 100
    assert agree.float().mean() > 0.99
    assert (p1 - p2)[agree].abs().max() < 1e-6
    assert (p1 - p2).abs().max() <= 2 * LR * 1.0001  # the rest moved at most by AdamW's bound
    name = loss.split("-")[0]
    assert got["metrics"][f"loss/{name}"] == pytest.approx(metrics[f"loss/{name}"], rel=1e-5, abs=1e-7)
    if log_z is not None:  # the learned log Z: the same table after the step (moved: AdamW's first step)
        assert log_z.detach().abs().max() > 0 and torch.allclose(got["log_z"].detach(), log_z.detach(), atol=1e-6)
    assert got["metrics"]["train/reward_mean"] == pytest.approx(metrics["train/reward_mean"])


def test_data_parallel_checkpoint_resumes_exactly(ranked):
    """A data-parallel checkpoint (rank 0 writes it; both ranks read it into fresh trainers) takes the same
    next step as the trainers that wrote it, on both ranks: bit for bit."""
    continued = torch.load(ranked / "dp-resume-0.pt")["continued"]
    for rank in (0, 1):
        got = torch.load(ranked / f"dp-resume-{rank}.pt")
        assert got["step"] == 2
        for name, p in continued.items():
            assert torch.equal(p, got["resumed"][name]), (rank, name)


def test_sharded_checkpoint_resumes_exactly(ranked):
    """A checkpoint written by 2 FSDP2 ranks (torch.distributed.checkpoint), loaded into fresh sharded
    trainers, takes the same next step as the trainers that wrote it: bit for bit."""
    got = torch.load(ranked / "resume.pt")
    assert got["step"] == 1
    for name, p in got["continued"].items():
        assert torch.equal(p, got["resumed"][name]), name


def test_sharded_checkpoint_of_two_ranks_loads_into_one(ranked):
    """DCP reshards: the 2-rank checkpoint loaded by a 1-rank FSDP2 trainer restores the same parameters and
    AdamW moments, bit for bit (so a sharded run resumes with another trainer.num_workers)."""
    saved, loaded = torch.load(ranked / "at-checkpoint.pt"), torch.load(ranked / "resharded.pt")
    assert loaded["step"] == 1
    for name, p in saved["params"].items():
        assert torch.equal(p, loaded["params"][name]), name
    assert all(torch.equal(a, b) for a, b in zip(saved["exp_avg_sq"], loaded["exp_avg_sq"]))
