"""The whole algorithm in one process, without Ray: searcher -> buffer -> trainer -> weights -> searcher.

A readable view of what ``runtime/`` runs across actors (docs/architecture.md, "One step in code"), and a
fast whole-algorithm test on the real 2-layer SmolLM2 with the hf engine: one searcher batch per trainer
step, weights published every k = 2 steps, the buffer synced at each publication as the driver does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from tba.buffer import ReplayBuffer
from tba.config import Config
from tba.runtime.build import build_searcher, build_trainer, generation_dtype
from tba.scoring import token_logprobs

STEPS, K_SYNC = 4, 2


def test_reference_loop(model_path):
    cfg = Config.model_validate({
        "model": {"num_hidden_layers": 2, "dtype": "float32", "device": "cpu"},
        "task": {"options": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "train_size": 4, "eval_size": 1},
        "searcher": {"prompts_per_batch": 2, "samples_per_prompt": 4, "max_new_tokens": 8},
        "trainer": {"prompts_per_step": 2, "group_size": 4, "sync_period": K_SYNC, "max_steps": STEPS,
                    "lr": 1e-4, "lr_schedule": "constant"},
        "buffer": {"on_policy_prob": 1.0}})
    searcher = build_searcher(cfg, model_path, model_path, searcher_id=0)  # policy copy in its engine, pi_ref
    searcher.task.reward = lambda text, problem: min(len(text), 24) / 24  # dense: the tiny model's groups differ
    trainer, _ = build_trainer(cfg, model_path)
    buffer = ReplayBuffer(cfg.buffer, cfg.run.seed)

    # --- one step in code ---------------------------------------------------------------------------
    buffer.add(searcher.step()[0])  # the fill: a first batch with the initial policy (version 0) ...
    buffer.sync(0)  # ... is the first recent set
    drawn, recent = [], []
    for _ in range(STEPS):
        batch = buffer.sample(cfg.trainer.prompts_per_step, cfg.trainer.group_size, step=trainer.step_count)
        trainer.step(batch)  # log pi_theta -> TB loss -> AdamW
        if trainer.step_count % K_SYNC == 0:  # publish every k steps (Cadence.publish_due)
            version, weights = trainer.step_count, trainer.publish_weights(generation_dtype(cfg))
            recent.append(buffer.sync(version - K_SYNC))  # what arrived since, of versions >= v - k, is recent
            searcher.load_weights(version, weights)  # BufferActor.add's reply hands the newer weights over
        samples, _ = searcher.step()  # generate -> reward -> pi_ref log-probs, tagged searcher.version
        buffer.add(samples)
        drawn.append(({s.policy_version for s in batch.samples}, batch.metrics["buffer/staleness_max"]))
    # ------------------------------------------------------------------------------------------------

    # by hand: batch b_i (2 prompts) is generated after step i - 1 (b_0 is the fill) with version 2 * (i // 2);
    # steps 0-1 draw b_0, steps 2-3 b_1 (recent from the sync at v2): staleness 0, 1, 2, 3, up to 2k - 1
    assert drawn == [({0}, 0), ({0}, 1), ({0}, 2), ({0}, 3)]
    assert recent == [2, 4]  # recent prompts after each sync: b_1's 2, then b_2 + b_3 (one epoch) = all 4
    assert searcher.version == trainer.step_count == STEPS and {s.policy_version for s in samples} == {STEPS}
    # the last batch was sampled with the published weights: its behaviour log-probs are the trainer policy's,
    # and that policy has moved away from pi_ref (the searcher's reference model, i.e. the initial weights)
    with torch.no_grad():
        lp, mask = token_logprobs(trainer.model, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                  cfg.searcher.temperature, searcher.tokenizer.pad_token_id)
    policy = (lp * mask).sum(-1)
    behaviour = torch.tensor([sum(s.logprobs) for s in samples])
    ref = torch.tensor([s.ref_logprob for s in samples])
    assert torch.allclose(behaviour, policy, atol=1e-3)
    assert (ref - policy).abs().max() > 0.5


def test_architecture_doc_quotes_the_loop_verbatim():
    """docs/architecture.md's "One step in code" is this file's loop, character for character."""
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "architecture.md").read_text().split("## One step in code", 1)[1]
    quoted = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert textwrap.indent(quoted, "    ") in Path(__file__).read_text()
