"""GPU-only checks (marker ``gpu``): skipped where no CUDA GPU is visible; ``benchmarks/gpu_check.sh`` runs them
on one. Models are placed on the GPU, the trainer steps there under bf16 autocast (full weights and a LoRA
adapter), the hf engine generates there, weights are packed from GPU tensors, the trainer's MFU and the engine's
tokens/s are measured against the GPU's bf16 matmul peak, and (where vLLM and Ray are installed) vLLM generates
there with its weights swapped in place and a whole run through the CLI places its actors on GPU shares.

Nothing here imports Ray or vLLM at module level: the GPU check runs on a machine that has neither (the tests
that need them skip there, with the reason), and the task is gsm8k on the repository's sample (math-verify's
reward; reasoning-gym's compiled dependencies cannot travel there).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, load_benchmark
from test_e2e import TINY

from tba.config import Config
from tba.models import load_causal_lm
from tba.runtime.build import build_searcher, build_trainer, generation_dtype
from tba.scoring import token_logprobs
from tba.types import Batch, Sample
from tba.weights import pack_weights

pytestmark = pytest.mark.gpu

TASK = {"name": "gsm8k", "source": str(ROOT / "tests" / "data" / "gsm8k"), "train_size": 20, "eval_size": 4}


def _cfg(engine: str = "hf", lora: dict | None = None, **model) -> Config:
    return Config.model_validate({
        "model": {"device": "cuda", "num_hidden_layers": 2, **({"lora": lora} if lora else {}), **model},
        "task": TASK,
        "searcher": {"engine": engine, "prompts_per_batch": 2, "samples_per_prompt": 4, "max_new_tokens": 12},
        "trainer": {"group_size": 4, "prompts_per_step": 2, "lr": 1e-4, "lr_schedule": "constant"},
    })


def _batch(tokenizer, k: int = 4) -> Batch:
    """2 prompts x ``k`` fixed random responses, rewards 0 / 1 alternating, behaviour and reference log-probs 0."""
    prompts = [tokenizer.encode(q) for q in ("What is 2 + 3?", "Name a colour.")]
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(2 * k):
        r = torch.randint(10, 2000, (4 + i % k,), generator=g).tolist()
        samples.append(Sample(i // k, prompts[i // k], r, float(i % 2), [0.0] * len(r), [0.0] * len(r), 0))
    return Batch(samples, k)


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


def test_trainer_step_runs_under_bf16_autocast_on_the_gpu(model_path, tokenizer):
    """The trainer's forward runs in bf16 on the GPU (autocast: the LM head's logits come out bf16) while the
    master weights stay float32 on the GPU, and the step moves them."""
    trainer, _ = build_trainer(_cfg(dtype="bfloat16"), model_path, model_path)
    assert trainer.autocast_dtype == torch.bfloat16
    seen = []
    hook = trainer.model.lm_head.register_forward_hook(lambda mod, args, out: seen.append((out.dtype, out.device.type)))
    before = trainer.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    m = trainer.step(_batch(tokenizer))
    hook.remove()
    assert m["train/skipped"] == 0.0 and torch.isfinite(torch.tensor(m["loss/tb"]))
    assert seen and set(seen) == {(torch.bfloat16, "cuda")}
    after = trainer.model.model.layers[0].mlp.up_proj.weight
    assert after.dtype == torch.float32 and after.is_cuda and not torch.equal(after, before)


def test_hf_engine_generates_on_the_gpu_with_the_models_logprobs(model_path, tokenizer):
    """The hf engine samples on the GPU (float32), and the behaviour log-prob it records for each token equals
    a full forward pass of the same model over prompt + response (its KV-cached decoding is exact)."""
    from tba.engines.hf import HFEngine

    model = load_causal_lm(model_path, torch.float32, 2).to("cuda")
    engine = HFEngine(model, tokenizer)
    prompts = [tokenizer.encode("What is 2 + 3?"), tokenizer.encode("Name a colour.")]
    gens = engine.generate(prompts, 3, 16, 0.7, seed=0)
    flat_p = [p for p, grp in zip(prompts, gens) for _ in grp]
    flat = [g for grp in gens for g in grp]
    assert len(flat) == 6 and all(1 <= len(g.response_ids) <= 16 for g in flat)
    with torch.no_grad():
        lp, _ = token_logprobs(model, flat_p, [g.response_ids for g in flat], 0.7, tokenizer.pad_token_id)
    for row, g in zip(lp.cpu(), flat):
        assert torch.allclose(row[: len(g.logprobs)], torch.tensor(g.logprobs), atol=1e-3)


def test_lora_trains_on_the_gpu_and_reaches_the_searcher(model_path, tokenizer):
    """model.lora on the GPU: a step moves the adapter only (the base stays), the publication is the adapter
    (a few hundred KB, not the model), and the searcher's engine holds the trainer's adapter after loading it."""
    from tba.adapters import adapter_tensors

    cfg = _cfg(lora={"r": 4, "alpha": 8})
    trainer, _ = build_trainer(cfg, model_path, model_path)
    searcher = build_searcher(cfg, model_path, model_path, 0)
    named = dict(trainer.model.named_parameters())
    base = {n: p.detach().clone() for n, p in named.items() if "lora_" not in n}
    lora_b = {n: p.detach().clone() for n, p in named.items() if "lora_B" in n}
    assert base and lora_b and all(p.is_cuda for p in named.values())
    m = trainer.step(_batch(tokenizer))
    assert m["train/skipped"] == 0.0
    assert all(torch.equal(named[n], p) for n, p in base.items())
    assert any(not torch.equal(named[n], p) for n, p in lora_b.items())
    gen = generation_dtype(cfg)
    packed = trainer.publish_weights(gen)
    assert packed.adapter is not None and packed.data.nbytes < 5e6
    searcher.load_weights(1, packed)
    want = dict(adapter_tensors(trainer.model))
    got = dict(adapter_tensors(searcher.engine.model))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name].cpu(), t.to("cpu", gen).to(got[name].dtype)), name
    samples, _ = searcher.step()
    assert all(s.policy_version == 1 for s in samples)


def test_trainer_mfu_and_engine_tokens_per_s_against_the_gpus_bf16_peak(model_path, tokenizer):
    """The throughput benchmark's GPU figures (``benchmarks/throughput.py``, sections a-c) are sane: the bf16
    matmul peak is a GPU's (a CPU gives under 5 TFLOP/s), the trainer's MFU against it lies in (0, 1), and the
    hf engine generates tokens at a positive rate. ``gpu_check.sh`` reports the figures themselves."""
    thr = load_benchmark("throughput")
    peak = thr.PeakSampler(4096, torch.bfloat16, "cuda")
    for _ in range(3):
        peak.sample(1)
    assert peak.since(0) > 10e12
    cfg = _cfg()
    prompts = [tokenizer.encode(f"What is {i} + {i + 1}?") for i in range(8)]
    res = thr.bench_trainer(model_path, 2, prompts, cfg, 2, 4, 8, 16, "cuda", torch.bfloat16, peak)
    for name in ("shared", "full"):
        assert 0 < res[name]["mfu"] < 1 and res[name]["tokens_per_s"] > 0, res[name]
    model = load_causal_lm(model_path, torch.bfloat16, 2).to("cuda")
    params = sum(p.numel() for p in model.parameters())
    rows = thr.bench_generation(model, tokenizer, prompts, [16], 4, 8, 0.7, 2, "cuda", params, peak, 2,
                                engines=("engine",))
    assert {r["mode"] for r in rows} == {"forced", "natural", "continuous"}
    assert all(r["engine_tokens_per_s"] > 0 for r in rows)


def test_data_parallel_trainer_with_one_rank_on_nccl(model_path):
    """The data-parallel trainer (``trainer.num_workers``) as one rank of an NCCL process group on the GPU: its
    path (log-probs gathered over the ranks, gradients summed with NCCL all-reduces, bf16 autocast, micro
    batches of 3) takes the plain trainer's step on the same batch. No Ray: the group is this process."""
    import copy

    from test_parallel import make_batch

    from tba import parallel

    cfg = _cfg()
    cfg.trainer.micro_batch_size, cfg.trainer.prompts_per_step = 3, 4
    batch = make_batch(load_causal_lm(model_path, torch.float32, 2))
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
