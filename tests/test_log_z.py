"""The learned log Z of trajectory balance (``loss.log_z: learned``): one trained scalar per training prompt
(Malkin et al. 2022), against the VarGrad estimate the TBA paper uses. The loss's hand values are in
tests/test_losses.py; here the trainer: micro-batching, checkpoints, and the table's own learning rate."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LAYERS

from tba.checkpoint import load_trainer, save_trainer
from tba.config import LossConfig, TrainerConfig
from tba.models import load_causal_lm
from tba.trainer import Trainer
from tba.types import Batch, Sample

NUM_PROMPTS = 5


def _batch(tokenizer, k=4) -> Batch:
    """Two groups (prompts 3 and 1 of 5) of K fixed random responses, rewards 0/1, reference log-probs."""
    prompts = [tokenizer(q)["input_ids"] for q in ("What is 2 + 3?", "Name a colour.")]
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(2 * k):
        r = torch.randint(10, 2000, (3 + i % k,), generator=g).tolist()
        samples.append(Sample((3, 1)[i // k], prompts[i // k], r, float(i % 2), [0.0] * len(r),
                              [-2.0] * len(r), 0))
    return Batch(samples, k)


def _trainer(model_path, micro_batch_size=8, log_z="learned") -> Trainer:
    torch.manual_seed(0)
    model = load_causal_lm(model_path, torch.float32, TINY_LAYERS)
    return Trainer(model, 0, TrainerConfig(lr=1e-4, lr_schedule="wsd", warmup_steps=5, grad_clip=1.0,
                                           micro_batch_size=micro_batch_size),
                   LossConfig(log_z=log_z, log_z_lr=0.05), temperature=1.0, num_prompts=NUM_PROMPTS)


def test_learned_log_z_trains_its_prompts_rows_at_its_own_rate(model_path, tokenizer):
    """One step moves exactly the rows of the batch's prompts (3 and 1), by AdamW's first step: lr x sign of
    the gradient = 0.05 nats, at the table's constant rate while the policy's warms up (its lr is 1e-4 / 5
    on step 1); a micro-batched step (micro batch 2) gives the same table and weights as one pass."""
    a, b = _trainer(model_path), _trainer(model_path, micro_batch_size=2)
    batch = _batch(tokenizer)
    a.step(batch), b.step(batch)
    moved = a.log_z.detach()
    assert moved[[0, 2, 4]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(moved[[1, 3]].abs(), torch.tensor(0.05), atol=1e-6)
    assert a.optimizer.param_groups[1]["lr"] == 0.05 and a.optimizer.param_groups[0]["lr"] < 1e-4
    assert torch.allclose(b.log_z, a.log_z, atol=1e-6)
    for (n, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.allclose(x, y, atol=1e-6), n


def test_learned_log_z_survives_a_checkpoint_exactly(model_path, tokenizer, tmp_path):
    """Saved (the table in the trainer's extra state, its AdamW moments with the optimizer) and loaded into
    a fresh trainer, the next step gives the same table bit for bit; a checkpoint without a table (VarGrad)
    is refused with one line."""
    batch = _batch(tokenizer)
    a = _trainer(model_path)
    for _ in range(2):
        a.step(batch)
    save_trainer(tmp_path, a.model, a.optimizer, a.scheduler, a.extra_state())
    b = _trainer(model_path)
    b.load_extra_state(load_trainer(tmp_path, b.model, b.optimizer, b.scheduler))
    assert b.step_count == 2 and torch.equal(b.log_z, a.log_z)
    a.step(batch), b.step(batch)
    assert torch.equal(b.log_z, a.log_z)
    vargrad = _trainer(model_path, log_z="vargrad")
    assert vargrad.log_z is None
    with pytest.raises(ValueError, match="no learned log Z table of 5 prompts"):
        b.load_extra_state(vargrad.extra_state())
