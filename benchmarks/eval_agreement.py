"""Eval engines: do tba's transformers engine and vLLM give the same greedy evals? (``run.eval_engine``)

Both engines are built as a run builds them (``tba.runtime.build.build_eval_engine``) on the same policy
weights, in each ``model.dtype`` asked for, and greedy-decode the config's held-out problems. Reported per
dtype: the share of problems whose greedy responses are token-for-token identical, each engine's accuracy
with its binomial standard error, the paired accuracy difference (vLLM - hf) with its 95% interval over
problems, and the wall time of each engine's pass (one pass each, interleaved; the machine load is recorded).

    python benchmarks/eval_agreement.py --config configs/quickstart.yaml --dtypes bfloat16 float32 \
        --out benchmarks/results/eval-agreement.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, quiet_env, write_json
from _stats import paired_difference_ci


def measure(config: str, dtype: str) -> dict:
    """Greedy responses of both eval engines on the config's eval problems, in ``dtype``."""
    from tba.config import load_config
    from tba.models import load_causal_lm, load_tokenizer, pick_dtype, prepare_model
    from tba.runtime.build import build_eval_engine
    from tba.tasks import build_task

    out: dict = {"dtype": dtype}
    gens = {}
    for engine_name in ("hf", "vllm"):
        cfg = load_config(config, {"model.dtype": dtype, "model.device": "cpu", "run.eval_engine": engine_name})
        path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
        tok, task = load_tokenizer(path), build_task(cfg)
        policy = load_causal_lm(path, pick_dtype(dtype), cfg.model.num_hidden_layers).eval()
        engine = build_eval_engine(cfg, path, policy, tok, task)
        prompts = [task.encode(tok, p) for p in task.eval]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        gens[engine_name] = [g for (g,) in engine.generate(prompts, 1, cfg.searcher.max_new_tokens, greedy=True)]
        out[f"{engine_name}_s"] = time.perf_counter() - t0
        out[f"{engine_name}_load"] = load
        correct = [float(task.is_correct(tok.decode(g.response_ids, skip_special_tokens=True), p))
                   for g, p in zip(gens[engine_name], task.eval)]
        out[f"{engine_name}_correct"] = correct
        engine.close()
    n = len(gens["hf"])
    out["n"] = n
    out["identical"] = sum(a.response_ids == b.response_ids for a, b in zip(gens["hf"], gens["vllm"])) / n
    for e in ("hf", "vllm"):
        acc = sum(out[f"{e}_correct"]) / n
        out[f"{e}_accuracy"], out[f"{e}_stderr"] = acc, (acc * (1 - acc) / n) ** 0.5
    out["difference"] = paired_difference_ci(out["vllm_correct"], out["hf_correct"])
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure each dtype, print one line per dtype, write the JSON (every problem's correctness kept)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/eval-agreement.json"))
    args = p.parse_args(argv)
    quiet_env()
    rows = [measure(args.config, d) for d in args.dtypes]
    for r in rows:
        d = r["difference"]
        print(f"{r['dtype']}: n {r['n']}, identical greedy responses {r['identical']:.3f}, accuracy hf "
              f"{r['hf_accuracy']:.3f} ± {r['hf_stderr']:.3f}, vllm {r['vllm_accuracy']:.3f} ± {r['vllm_stderr']:.3f}, "
              f"vllm - hf {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}], time vllm / hf "
              f"{r['vllm_s'] / r['hf_s']:.2f} (load {r['hf_load']:.1f} / {r['vllm_load']:.1f})")
    write_json(args.out, {"command": command_line(sys.argv[1:]), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
