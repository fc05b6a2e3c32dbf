"""GPU-only checks (marker ``gpu``): skipped where no CUDA GPU is visible; ``benchmarks/gpu_check.sh`` runs them
on one. Models are placed on the GPU, the trainer steps there, vLLM generates there with its weights swapped
in place, and a whole run through the CLI and Ray places its actors on GPU shares."""

from __future__ import annotations

import json

import pytest
import torch
from test_e2e import TINY

from tba.config import Config
from tba.models import load_causal_lm
from tba.runtime.build import build_searcher, build_trainer
from tba.scoring import token_logprobs
from tba.types import Batch
from tba.weights import pack_weights

pytestmark = pytest.mark.gpu

TASK = {"options": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "train_size": 20, "eval_size": 4}


def _cfg(engine: str = "hf", **model) -> Config:
    return Config.model_validate({
        "model": {"device": "cuda", "num_hidden_layers": 2, **model}, "task": TASK,
        "searcher": {"engine": engine, "prompts_per_batch": 2, "samples_per_prompt": 4, "max_new_tokens": 12},
        "trainer": {"group_size": 4, "prompts_per_step": 2, "lr": 1e-4, "lr_schedule": "constant"},
    })


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_searcher_and_trainer_on_the_gpu(model_path, engine):
    """A searcher generates on the GPU, the trainer steps there (float32 master weights, bf16 autocast) and
    its published weights reach the searcher's engine."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    cfg = _cfg(engine)
    searcher = build_searcher(cfg, model_path, model_path, 0)
    trainer, _ = build_trainer(cfg, model_path, model_path)
    assert all(p.is_cuda and p.dtype == torch.float32 for p in trainer.model.parameters())
    assert searcher.ref_model.device.type == "cuda"
    samples, metrics = searcher.step()
    assert len(samples) == 8 and metrics["searcher/gen_tokens_per_s"] > 0
    m = trainer.step(Batch(samples, 4))
    assert m["train/skipped"] == 0.0 and torch.isfinite(torch.tensor(m["loss/tb"]))
    searcher.load_weights(1, trainer.publish_weights(torch.bfloat16))
    after, _ = searcher.step()
    assert all(s.policy_version == 1 for s in after)
    searcher.engine.close()


def test_vllm_logprobs_on_the_gpu_match_transformers(model_path, tokenizer):
    """float32 on the GPU: vLLM's sampled-token log-probs equal a transformers forward pass to 1e-2 (GPU
    kernels sum in another order than the CPU's; the CPU test holds them to 1e-3)."""
    pytest.importorskip("vllm")
    from tba.engines.vllm import VLLMEngine
    from tba.models import truncated_copy

    folder = truncated_copy(model_path, 2)
    prompts = [tokenizer.encode("What is 2 + 3?"), tokenizer.encode("Name a colour.")]
    with VLLMEngine(folder, dtype=torch.float32, device="cuda", max_model_len=128,
                    gpu_memory_utilization=0.2) as engine:
        gens = engine.generate(prompts, 3, 12, 0.7, seed=0)
    hf = load_causal_lm(folder, torch.float32).to("cuda")
    flat_p = [p for p, grp in zip(prompts, gens) for _ in grp]
    flat = [g for grp in gens for g in grp]
    with torch.no_grad():
        lp, _ = token_logprobs(hf, flat_p, [g.response_ids for g in flat], 0.7, tokenizer.pad_token_id)
    for row, g in zip(lp.cpu(), flat):
        assert torch.allclose(row[: len(g.logprobs)], torch.tensor(g.logprobs), atol=1e-2)


def test_cli_run_places_actors_on_gpu_shares(tmp_path, cli):
    """One GPU shared by the trainer and a vLLM searcher (0.5 each), through the CLI and Ray."""
    pytest.importorskip("vllm")
    out = tmp_path / "gpu"
    r = cli.run([*TINY, "--model.device", "cuda", "--searcher.engine", "vllm", "--trainer.num_gpus", "0.5",
                 "--searcher.num_gpus", "0.5", "--max-steps", "4", "--trainer.sync_period", "1",
                 "--run.eval_before", "false", "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "placement: CUDA; trainer 0.5 GPU, 1 searcher(s) x 0.5 GPU, engine vllm" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["searcher_max_version"] >= 1
    cli.assert_nothing_left()


def test_packed_weights_from_the_gpu_round_trip(model_path):
    """The trainer packs GPU tensors into one CPU buffer (what Ray ships); a CPU copy loads them exactly."""
    from tba.weights import load_packed_weights

    model = load_causal_lm(model_path, torch.float32, 2).to("cuda")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    cpu = load_causal_lm(model_path, torch.bfloat16, 2)
    load_packed_weights(cpu, pack_weights(model, torch.bfloat16))
    want = model.model.layers[0].mlp.up_proj.weight.to("cpu", torch.bfloat16)
    assert torch.equal(cpu.model.layers[0].mlp.up_proj.weight, want)


def test_data_parallel_trainer_with_one_rank_on_nccl(model_path, tokenizer):
    """The data-parallel trainer (``trainer.num_workers``) as one rank of an NCCL process group on the GPU: its
    path (log-probs gathered over the ranks, gradients summed with NCCL all-reduces, bf16 autocast, micro
    batches of 3) takes the plain trainer's step on the same batch. No Ray: the group is this process."""
    import copy

    from test_parallel import make_batch

    from tba import parallel

    cfg = _cfg()
    cfg.trainer.micro_batch_size, cfg.trainer.prompts_per_step = 3, 4
    batch = make_batch(load_causal_lm(model_path, torch.float32, 2), tokenizer)
    after = []
    for distributed in (False, True):
        if distributed:
            assert parallel.init_group(0, 1, parallel.free_port(), "cuda", timeout_s=60) == "nccl"
        try:
            trainer, _ = build_trainer(cfg, model_path, model_path)
            assert trainer.distributed is distributed
            m = trainer.step(copy.deepcopy(batch))
            assert m["train/skipped"] == 0.0 and m["train/grad_norm"] > 0
            after.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).cpu())
        finally:
            parallel.close_group()
    assert (after[0] - after[1]).abs().max() < 1e-6
