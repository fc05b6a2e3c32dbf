"""Held-out evals through the Engine protocol: the vLLM eval engine (``run.eval_engine: vllm``) evaluates the
trainer's current weights, and its greedy responses equal tba's transformers engine's in float32 (real
2-layer SmolLM2, vLLM's real CPU backend, no Ray)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tba.config import Config  # noqa: E402
from tba.runtime.build import build_trainer  # noqa: E402
from tba.runtime.evaluation import PolicyEvaluator  # noqa: E402
from tba.tasks import build_task  # noqa: E402


def _cfg(eval_engine: str) -> Config:
    return Config.model_validate({
        "model": {"num_hidden_layers": 2, "dtype": "float32", "device": "cpu"},
        "task": {"options": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "train_size": 4, "eval_size": 3},
        "searcher": {"max_new_tokens": 8, "kv_cache_gib": 0.25},
        "run": {"eval_engine": eval_engine, "eval_batch_size": 3}})


def test_vllm_eval_engine_evaluates_the_trainers_current_weights(model_path):
    """Before and after the policy moves, the vLLM eval engine's greedy responses (all 3 eval problems are
    the eval's examples) equal the hf engine's; and the move changes them, so the vLLM engine really got the
    new weights and not only the ones it was built from."""
    trainer, tok = build_trainer(_cfg("hf"), model_path)
    task = build_task(_cfg("hf"))
    hf, vllm = (PolicyEvaluator(_cfg(e), model_path, tok, task) for e in ("hf", "vllm"))
    try:
        before = vllm.evaluate(trainer)
        assert before == hf.evaluate(trainer)
        torch.manual_seed(0)
        with torch.no_grad():  # a policy far from the initial one: its greedy responses differ
            for p in trainer.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        after = vllm.evaluate(trainer)
        assert after == hf.evaluate(trainer)
        responses = lambda r: [e["response"] for e in r["examples"]]  # noqa: E731
        assert responses(after) != responses(before)
        assert trainer.model.training  # the trainer's policy is left in train mode
    finally:
        vllm.close()
