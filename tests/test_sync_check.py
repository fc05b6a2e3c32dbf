"""The sync check (docs/architecture.md, "The sync check") with the hf engine on the real 2-layer SmolLM2, no
mocks: engine scoring, the probe a publication carries, the searcher's gap and warning on a working sync and
on an engine left on old weights (full weights and a LoRA adapter), and the trainer's staleness-0 behaviour
gap. The vLLM engine's side is in tests/test_vllm_engine.py; the metrics' way to metrics.jsonl in
tests/test_e2e.py."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from tba.adapters import add_adapter
from tba.config import Config, LoraSettings, LossConfig, SearcherConfig, TaskConfig, TrainerConfig
from tba.engines.base import Engine
from tba.engines.hf import HFEngine
from tba.models import load_causal_lm
from tba.searcher import TRAINER_MOVE_MIN, Searcher, engine_moved
from tba.tasks import build_task
from tba.trainer import PROBE_SAMPLES, Trainer
from tba.types import Batch

K = 4
BOUND = SearcherConfig().sync_gap_bound  # the default


def _task():
    return build_task(Config(task=TaskConfig(
        name="reasoning_gym:chain_sum", options={"min_terms": 2, "max_terms": 2, "max_digits": 1}, train_size=8,
        eval_size=1, prompt_template="{question} Answer with just the number.")))


def _searcher(engine, ref, tokenizer) -> Searcher:
    cfg = SearcherConfig(prompts_per_batch=2, samples_per_prompt=K, max_new_tokens=8)
    searcher = Searcher(engine, ref, _task(), tokenizer, list(range(8)), 0, cfg, score_micro_batch=16, seed=0)
    # dense: the 2-layer model's answers all score 0, and a batch of tied groups leaves a float32 policy as it is
    searcher.task.reward = lambda text, problem: min(len(text), 24) / 24
    return searcher


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tba.searcher"]


def test_hf_engine_scores_what_it_samples(tiny_model, tokenizer):
    """``HFEngine.score`` gives the log-probs the engine sampled with, at the sampling temperature."""
    engine = HFEngine(tiny_model.eval(), tokenizer)
    assert isinstance(engine, Engine)
    prompts = [_task().encode(tokenizer, p) for p in _task().train[:2]]
    gens = engine.generate(prompts, 3, 10, 0.7, seed=0)
    flat = [(p, g) for p, grp in zip(prompts, gens) for g in grp]
    scored = engine.score([p for p, _ in flat], [g.response_ids for _, g in flat], 0.7)
    for (_, g), lp in zip(flat, scored):
        assert len(lp) == len(g.response_ids)
        assert torch.allclose(torch.tensor(lp), torch.tensor(g.logprobs), atol=1e-4)
    assert engine.score([], [], 1.0) == []


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sync_check_passes_and_fires_when_the_engine_keeps_old_weights(model_path, tokenizer, caplog, monkeypatch,
                                                                        lora):
    """float32 on both sides: after a load the probe gap is float noise (< 1e-4 nats per token), reported in
    the next batch's metrics with no warning; an engine whose load silently does nothing (the bug the check is
    for) gives a gap above the default bound, a warning naming searcher, version and gap, and a count."""
    torch.manual_seed(0)
    policy, engine_model = (load_causal_lm(model_path, torch.float32, 2) for _ in range(2))
    if lora:  # the trainer trains an adapter; the engine holds one that publications are copied into
        policy, engine_model = (add_adapter(m, LoraSettings(r=4)) for m in (policy, engine_model))
    ref = load_causal_lm(model_path, torch.float32, 2)
    searcher = _searcher(HFEngine(engine_model.eval(), tokenizer), ref, tokenizer)
    trainer = Trainer(policy, tokenizer.pad_token_id, TrainerConfig(lr=1e-2 if lora else 1e-3, lr_schedule="constant"),
                      LossConfig(), temperature=0.7)
    assert trainer.publish_weights().probe is None  # no batch yet: nothing to probe with
    samples, metrics = searcher.step()
    assert "sync/logprob_gap" not in metrics and metrics["sync/gap_warnings"] == 0  # no load, no check
    batch = Batch(samples, K)
    trainer.step(batch)
    packed = trainer.publish_weights()
    probe = packed.probe
    assert (packed.adapter is not None) == lora
    assert len(probe.response_ids) == PROBE_SAMPLES and probe.temperature == 1.0
    # one response of each prompt first: the two prompts' first and second samples
    assert [r for r in probe.response_ids] == [s.response_ids for s in (samples[0], samples[K], samples[1],
                                                                          samples[K + 1])]
    assert [len(lp) for lp in probe.logprobs] == [len(r) for r in probe.response_ids]

    caplog.set_level(logging.WARNING, logger="tba.searcher")
    searcher.load_weights(1, packed)
    assert searcher.sync_gap < 1e-4
    _, metrics = searcher.step()
    assert metrics["sync/logprob_gap"] < 1e-4 and metrics["sync/gap_warnings"] == 0
    assert not _warnings(caplog)

    for _ in range(2):  # the policy moves on: versions 2 and 3
        trainer.step(batch)
    monkeypatch.setattr(searcher.engine, "load_weights", lambda packed: None)  # the load is skipped
    searcher.load_weights(3, trainer.publish_weights())
    gap = searcher.sync_gap
    assert gap > BOUND, gap
    assert searcher.sync_moved == 0  # the engine's log-probs did not move at all
    assert _warnings(caplog) == [
        f"searcher 0: policy version 3: the engine's log-probs differ from the trainer's by {gap:.3f} nats per "
        f"token on the probe responses (searcher.sync_gap_bound {BOUND:g}): the published weights may not have "
        "reached the engine",
        "searcher 0: policy version 3: since version 1 the engine's log-probs of the probe responses moved 0.00x as "
        "far as the trainer's (a fresh engine about 1, one that kept its weights 0): the published weights may not "
        "have reached the engine"]
    _, metrics = searcher.step()
    assert metrics["sync/logprob_gap"] == gap and metrics["sync/engine_moved"] == 0
    assert metrics["sync/gap_warnings"] == 2
    _, metrics = searcher.step()  # reported once: the next batch had no new check
    assert "sync/logprob_gap" not in metrics and "sync/engine_moved" not in metrics
    assert metrics["sync/gap_warnings"] == 0


def test_engine_moved_worked_by_hand():
    """Trainer change d = (1, 2), engine change g = (1, 1): sqrt((1 + 1) / (1 + 4)) = sqrt(0.4). A second
    response the engine scored only a prefix of counts its scored token only: d = (1, 2, 2), g = (1, 1, 3),
    sqrt(11 / 9)."""
    assert engine_moved([[-1.0, -2.0]], [[0.0, -1.0]], [[-1.0, -2.0]], [[0.0, 0.0]]) == pytest.approx(0.4 ** 0.5)
    assert engine_moved([[-1.0, -2.0], [-4.0]], [[0.0, -1.0], [-1.0]], [[-1.0, -2.0], [-3.0, -4.0]],
                        [[0.0, 0.0], [-1.0, -9.0]]) == pytest.approx((11 / 9) ** 0.5)
    assert engine_moved([[-1.0, -2.0]], [[-1.0, -2.0]], [[-1.0, -2.0]], [[0.0, 0.0]]) == 0.0  # unchanged engine
    assert engine_moved([[-1.0, -2.0]], [[0.0, 0.0]], [[-1.0, -2.0]], [[0.0, 0.0]]) == 1.0  # moved with it
    assert engine_moved([[-1.0, -2.0]], [[0.0, 0.0]], [[-1.0, -2.0]], [[-1.0, -2.0]]) is None  # trainer still
    assert engine_moved([[]], [[]], [[-1.0]], [[0.0]]) is None  # nothing scored
    small = TRAINER_MOVE_MIN / 2  # the trainer moved less than bf16 rounding may show: not judged
    assert engine_moved([[-1.0, -2.0]], [[-1.0, -2.0]], [[-1.0, -2.0]], [[-1.0 + small, -2.0 - small]]) is None


def test_sync_check_sees_a_stale_adapter_inside_bf16_precision(model_path, tokenizer, caplog, monkeypatch):
    """The case the gap cannot see (benchmarks/README.md, "Sync check"): a young LoRA adapter at a small lr
    moves the policy less than a bf16 engine's precision, so an engine that skipped its load is within the
    gap bound. The engine's move still warns, because a skipped load leaves the engine's log-probs exactly
    where they were; correct bf16 loads do not warn."""
    torch.manual_seed(0)
    policy = add_adapter(load_causal_lm(model_path, torch.float32, 2), LoraSettings(r=4))
    engine = HFEngine(add_adapter(load_causal_lm(model_path, torch.bfloat16, 2), LoraSettings(r=4)).eval(),
                      tokenizer)
    searcher = _searcher(engine, load_causal_lm(model_path, torch.float32, 2), tokenizer)
    trainer = Trainer(policy, tokenizer.pad_token_id, TrainerConfig(lr=3e-4, lr_schedule="constant"), LossConfig(),
                      temperature=0.7)
    batch = Batch(searcher.step()[0], K)
    caplog.set_level(logging.WARNING, logger="tba.searcher")
    for version in (1, 2, 3):
        trainer.step(batch)
        searcher.load_weights(version, trainer.publish_weights(torch.bfloat16))
        assert searcher.sync_gap < BOUND
    assert not _warnings(caplog) and searcher.sync_moved > 0.5  # correct loads
    trainer.step(batch)
    monkeypatch.setattr(searcher.engine, "load_weights", lambda packed: None)  # the load is skipped
    searcher.load_weights(4, trainer.publish_weights(torch.bfloat16))
    assert searcher.sync_gap < BOUND, "the gap alone would catch this stale adapter: the case is not the hard one"
    assert searcher.sync_moved == 0
    assert [w.split(" (")[0] for w in _warnings(caplog)] == [
        "searcher 0: policy version 4: since version 3 the engine's log-probs of the probe responses moved 0.00x as "
        "far as the trainer's"]


def test_sync_check_that_cannot_score_warns_and_reports_no_gap(tiny_model, model_path, tokenizer, caplog):
    """An engine that cannot score (here: it returns no log-prob) skips the check with a warning."""

    class NoScores(HFEngine):
        def score(self, prompts, responses, temperature=1.0):
            return [[] for _ in prompts]

    searcher = _searcher(NoScores(tiny_model.eval(), tokenizer), None, tokenizer)
    trainer = Trainer(load_causal_lm(model_path, torch.float32, 2), tokenizer.pad_token_id, TrainerConfig(),
                      LossConfig(), temperature=0.7, ref_model=tiny_model)
    trainer.step(Batch(searcher.step()[0], K))
    caplog.set_level(logging.WARNING, logger="tba.searcher")
    searcher.load_weights(1, trainer.publish_weights())
    assert searcher.sync_gap is None and "sync/logprob_gap" not in searcher.step()[1]
    assert "sync check of policy version 1 skipped" in caplog.text


def test_fresh_behaviour_gap(model_path, tokenizer):
    """``train/fresh_behaviour_gap``: float noise for an on-policy float32 batch (samples of the weights being
    trained), the offset when the behaviour log-probs are off by one, absent without a staleness-0 sample."""
    torch.manual_seed(0)
    engine_model, ref = (load_causal_lm(model_path, torch.float32, 2) for _ in range(2))
    samples, _ = _searcher(HFEngine(engine_model.eval(), tokenizer), ref, tokenizer).step()
    batch = Batch(samples, K)
    off = Batch([replace(s, logprobs=[x + 0.3 for x in s.logprobs]) for s in samples], K)

    def trainer():
        return Trainer(load_causal_lm(model_path, torch.float32, 2), tokenizer.pad_token_id,
                       TrainerConfig(lr=1e-3, lr_schedule="constant"), LossConfig(), temperature=0.7)

    on_policy = trainer()
    assert on_policy.step(batch)["train/fresh_behaviour_gap"] < 1e-4
    assert "train/fresh_behaviour_gap" not in on_policy.step(batch)  # step 1: every sample is 1 step stale
    assert trainer().step(off)["train/fresh_behaviour_gap"] == pytest.approx(0.3, abs=1e-4)
