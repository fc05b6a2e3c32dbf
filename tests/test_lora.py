"""LoRA adapters (``model.lora``, :mod:`tba.adapters`) on the 2-layer SmolLM2, in float32 (exact comparisons).

The trainer's gradient against an independently built peft model, the untrained adapter as the reference,
publication to the hf engine, checkpoints and the final adapter folder.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LAYERS
from safetensors.torch import load_file

from tba.adapters import adapter_off, adapter_tensors, add_adapter, load_adapter, merged_tensors, pack_adapter
from tba.checkpoint import load_trainer, save_trainer
from tba.config import LoraSettings, LossConfig, TrainerConfig
from tba.engines.hf import HFEngine
from tba.losses import LOSSES
from tba.models import load_causal_lm
from tba.scoring import token_logprobs
from tba.trainer import Trainer
from tba.types import Batch, Sample
from tba.weights import load_packed_weights, pack_weights, unique_tensors

LORA = LoraSettings(r=4, alpha=8)
TEMP = 0.7


def _peft(model_path, seed=0, random_b=False):
    """The 2-layer model with a fresh adapter; ``random_b``: B filled with small random values, so the
    adapter changes the outputs (an untrained one, B = 0, does not)."""
    torch.manual_seed(seed)
    model = add_adapter(load_causal_lm(model_path, torch.float32, TINY_LAYERS), LORA)
    if random_b:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def _batch(tokenizer, rewards, k=4):
    """B x K samples of fixed random responses to two prompts, behaviour log-probs 0 and no reference
    log-probs (the trainer scores pi_ref)."""
    prompts = [tokenizer(q)["input_ids"] for q in ("What is 2 + 3?", "Name a colour.")]
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(len(prompts) * k):
        r = torch.randint(10, 2000, (3 + i % k,), generator=g).tolist()
        samples.append(Sample(i // k, prompts[i // k], r, rewards[i], [0.0] * len(r), None, 0))
    return Batch(samples, k)


def _trainer(model, micro_batch_size=8, loss="tb"):
    return Trainer(model, 0, TrainerConfig(lr=1e-3, lr_schedule="constant", grad_clip=None,
                                           micro_batch_size=micro_batch_size),
                   LossConfig(name=loss), temperature=TEMP, ref_model=model)


def _logp(model, batch):
    return token_logprobs(model, [s.prompt_ids for s in batch.samples], [s.response_ids for s in batch.samples],
                          TEMP, 0)[0]


def test_untrained_adapter_is_the_reference_and_tb_loss_is_zero(model_path, tokenizer):
    """B = 0: the policy's log-probs equal the base's (adapter off) bit for bit, so with equal rewards every
    TB residual log Z + log pi - log pi_ref - r / beta is the same and the VarGrad loss is 0 up to float32
    rounding: the terms (r / beta = 1 / 0.05 = 20 at the default beta, plus sequence log-probs of tens of nats)
    stay below 2^8, where a float32 ulp is 3.1e-5, so each residual is a few ulps and the loss below 1e-9.
    With rewards 0, 1, 0, 1 in each group, log Z is the group mean, the residuals are +-0.5 / beta = +-10 and
    the loss their mean square, (0.5 / beta)^2 = 100."""
    model = _peft(model_path)
    batch = _batch(tokenizer, [1.0] * 8)
    with torch.no_grad(), adapter_off(model):
        ref = _logp(model, batch)
    with torch.no_grad():
        assert torch.equal(_logp(model, batch), ref)
    m = _trainer(model).step(batch)
    assert m["loss/tb"] < 1e-9 and m["train/abs_logratio_token_mean"] == 0.0
    tr = _trainer(_peft(model_path))
    assert tr.beta_at(0) == 0.05
    assert tr.step(_batch(tokenizer, [0.0, 1.0] * 4))["loss/tb"] == pytest.approx(100.0, rel=1e-4)


@pytest.mark.parametrize("micro_batch_size", [8, 3])
def test_tb_gradient_on_the_adapter_equals_an_independent_peft_models(model_path, tokenizer, tmp_path,
                                                                      micro_batch_size):
    """The trainer's gradient of the TB loss with respect to the adapter (one pass, and accumulated over
    micro batches) equals the gradient computed on a peft model loaded independently from the same adapter
    (``PeftModel.from_pretrained``) with the reference scored by a plain copy of the base."""
    from peft import PeftModel

    model = _peft(model_path, random_b=True)
    model.save_pretrained(tmp_path / "adapter")
    batch = _batch(tokenizer, [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    tr = _trainer(model, micro_batch_size)
    seen = {}

    def record(*args, _step=tr.optimizer.step, **kwargs):  # the gradients the optimizer sees
        seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return _step(*args, **kwargs)

    tr.optimizer.step = record
    tr.step(batch)

    other = PeftModel.from_pretrained(load_causal_lm(model_path, torch.float32, TINY_LAYERS), tmp_path / "adapter",
                                      is_trainable=True)
    base = load_causal_lm(model_path, torch.float32, TINY_LAYERS)
    with torch.no_grad():
        ref = _logp(base, batch)
    inp = tr._inputs(batch, _logp(other, batch), tr.beta_at(0))
    inp.ref_logp = ref * inp.mask
    LOSSES["tb"](inp, tr.loss)[0].backward()
    want = {n: p.grad for n, p in other.named_parameters() if p.grad is not None}
    assert set(seen) == set(want) and all("lora_" in n for n in seen)  # the base gets no gradient
    # float32 summation order differs between micro-batch layouts: compare relative to the gradient norm
    got, ref_grad = (torch.cat([g[n].flatten() for n in sorted(want)]) for g in (seen, want))
    assert ref_grad.norm() > 0 and (got - ref_grad).norm() / ref_grad.norm() < 1e-5


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_objective_trains_the_adapter_only(model_path, tokenizer, loss):
    """One step of each objective moves the adapter and leaves the base weights as they were."""
    model = _peft(model_path, random_b=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = _batch(tokenizer, [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    for s in batch.samples:  # PPO-style losses read the behaviour log-probs: make them the policy's own
        s.logprobs = [0.0] * len(s.response_ids)
    m = _trainer(model, loss=loss).step(batch)
    assert m["train/skipped"] == 0.0
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)


def test_publication_sends_the_adapter_and_the_hf_engine_applies_it(model_path, tokenizer):
    """A published adapter is a few percent of the full weights; loaded into the hf engine's own (fresh)
    adapter, the engine's log-probs equal the trainer's; a pack of the wrong kind is refused."""
    trainer_model = _peft(model_path, seed=0, random_b=True)
    engine = HFEngine(_peft(model_path, seed=1).eval(), tokenizer)
    batch = _batch(tokenizer, [0.0] * 8)
    with torch.no_grad():
        want = _logp(trainer_model, batch)
        assert (_logp(engine.model, batch) - want).abs().max() > 1e-3  # differs before the load
        packed = pack_adapter(trainer_model)
        full = pack_weights(load_causal_lm(model_path, torch.float32, TINY_LAYERS))
        assert packed.adapter["r"] == 4 and packed.data.nbytes < 0.05 * full.data.nbytes
        engine.load_weights(packed)
        assert torch.allclose(_logp(engine.model, batch), want, atol=1e-5)
    with pytest.raises(ValueError, match="disagree on LoRA"):
        engine.load_weights(full)
    with pytest.raises(ValueError, match="a LoRA adapter, but this model has none"):
        HFEngine(load_causal_lm(model_path, torch.float32, TINY_LAYERS), tokenizer).load_weights(packed)
    wrong_rank = add_adapter(load_causal_lm(model_path, torch.float32, TINY_LAYERS), LoraSettings(r=2))
    with pytest.raises(ValueError, match="does not match"):
        load_adapter(wrong_rank, packed)


def test_merged_publication_equals_peft_merge_and_loads_into_the_base(model_path, tokenizer):
    """``merged_tensors`` (the adapter merged into full weights, the model untouched) equals peft's
    ``merge_and_unload`` tensor for tensor under the base's names; the trainer's merged pack loads into a
    plain model of the base architecture (a full-weight engine's), whose log-probs then equal the peft
    model's; the trainer's adapter is unchanged by packing."""
    import copy

    trainer_model = _peft(model_path, seed=0, random_b=True)
    before = {n: p.clone() for n, p in trainer_model.named_parameters()}
    merged = dict(merged_tensors(trainer_model))
    want = dict(unique_tensors(copy.deepcopy(trainer_model).merge_and_unload()))
    assert merged.keys() == want.keys() and all(torch.equal(merged[n], want[n]) for n in want)
    trainer = Trainer(trainer_model, tokenizer.pad_token_id, TrainerConfig(), LossConfig(), 1.0, publish_merged=True)
    packed = trainer.publish_weights(probe=False)
    assert packed.adapter is None
    plain = load_causal_lm(model_path, torch.float32, TINY_LAYERS).eval()
    batch = _batch(tokenizer, [0.0] * 8)
    with torch.no_grad():
        assert (_logp(plain, batch) - _logp(trainer_model.eval(), batch)).abs().max() > 1e-3
        load_packed_weights(plain, packed)
        assert torch.allclose(_logp(plain, batch), _logp(trainer_model, batch), atol=1e-4)
    assert all(torch.equal(p, before[n]) for n, p in trainer_model.named_parameters())


def test_checkpoint_restores_adapter_and_optimizer_exactly_and_final_folder_reloads(model_path, tokenizer, tmp_path):
    """A checkpoint holds the adapter only; a fresh trainer that loads it continues bit for bit as the one
    that saved it. The final folder (``save_pretrained``) reloads with peft to the same log-probs, and
    merged into the base (``trainer.save_merged``) to the same log-probs within float32 rounding."""
    from peft import PeftModel

    batch = _batch(tokenizer, [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    a = _trainer(_peft(model_path, seed=0, random_b=True))
    for _ in range(2):
        a.step(batch)
    save_trainer(tmp_path, a.model, a.optimizer, a.scheduler, {"step": a.step_count})
    saved = set(load_file(tmp_path / "policy.safetensors"))
    assert saved == {n for n, p in a.model.named_parameters() if p.requires_grad}  # no base weights
    b = _trainer(_peft(model_path, seed=5, random_b=True))
    b.step_count = load_trainer(tmp_path, b.model, b.optimizer, b.scheduler)["step"]  # as TrainerActor does
    assert b.step_count == 2
    a.step(batch), b.step(batch)
    for (n, x), (_, y) in zip(adapter_tensors(a.model), adapter_tensors(b.model)):
        assert torch.equal(x, y), n

    a.model.save_pretrained(tmp_path / "final")
    reloaded = PeftModel.from_pretrained(load_causal_lm(model_path, torch.float32, TINY_LAYERS), tmp_path / "final")
    merged = PeftModel.from_pretrained(load_causal_lm(model_path, torch.float32, TINY_LAYERS),
                                       tmp_path / "final").merge_and_unload()
    with torch.no_grad():
        want = _logp(a.model.eval(), batch)
        assert torch.equal(_logp(reloaded.eval(), batch), want)
        assert torch.allclose(_logp(merged, batch), want, atol=1e-4)
