"""Headroom pilot (issue 25, item 2): the base model's greedy accuracy on candidate reasoning-gym tasks.

A task with room to learn starts SmolLM2-135M at 5-30% greedy accuracy: below 5% the searchers rarely see a
reward (TB's log Z and every baseline's advantage are then zero for almost every group); above 30% the
quickstart's 2-term chain_sum shows what follows, a plateau within 2-10 steps. This script measures the
first half of the criterion, the start, for each candidate on the same held-out problems a run would use
(the task's own eval split, ``task.eval_size``), with the config's prompt template and response cap, on the
engine ``run.eval_engine`` picks (vLLM's CPU backend where installed). Whether a candidate then keeps
improving for 150 steps takes a training run each (``tba train configs/quickstart.yaml --task.name ...``);
the candidates in range are the ones to try.

Each candidate is ``NAME`` or ``NAME:OPTIONS`` with OPTIONS a YAML mapping, e.g.
``chain_sum:{min_terms: 3, max_terms: 3, max_digits: 2}``. Results (accuracy with its 95% Wilson interval,
n, seconds, the machine load) go to ``--out`` as JSON, one record per candidate, and a table is printed.

    python benchmarks/headroom_pilot.py --out benchmarks/results/headroom_pilot.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

DEFAULT_CANDIDATES = [
    "chain_sum:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",  # the quickstart's, for reference
    "chain_sum:{min_terms: 3, max_terms: 3, min_digits: 1, max_digits: 2}",
    "chain_sum:{min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 3}",
    "basic_arithmetic:{min_terms: 2, max_terms: 3, min_digits: 1, max_digits: 2}",
    "products:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    "leg_counting:{min_animals: 2, max_animals: 3}",
    "gcd:{min_numbers: 2, max_numbers: 2, min_value: 1, max_value: 100}",
    "decimal_chain_sum:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    # second round (2026-12-04): answers with no constant shortcut (gcd's answer is 1 or 2 for about half its
    # problems), and the quickstart's task with harder terms
    "chain_sum:{min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}",
    "chain_sum:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 3}",
    "basic_arithmetic:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    "simple_equations:{min_terms: 2, max_terms: 2, min_value: 1, max_value: 10}",
    "letter_counting:{min_words: 3, max_words: 5}",
    "lcm:{min_numbers: 2, max_numbers: 2, min_value: 1, max_value: 20}",
    "products:{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    # four of them as one task, in equal shares (configs/arithmetic_mix.yaml)
    "composite:{datasets: [{name: chain_sum, weight: 1, config: {min_terms: 2, max_terms: 2, min_digits: 2, "
    "max_digits: 2}}, {name: basic_arithmetic, weight: 1, config: {min_terms: 2, max_terms: 3, min_digits: 1, "
    "max_digits: 2}}, {name: lcm, weight: 1, config: {min_numbers: 2, max_numbers: 2, min_value: 1, max_value: 20}}, "
    "{name: simple_equations, weight: 1, config: {min_terms: 2, max_terms: 2, min_value: 1, max_value: 10}}]}",
]


def wilson(k: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial rate k/n (better than the normal one near 0 and 1):
    scipy's ``binomtest(...).proportion_ci(method="wilson")``."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(0.95, method="wilson")
    return float(ci.low), float(ci.high)


def parse_candidate(text: str) -> tuple[str, dict]:
    """``NAME`` or ``NAME:OPTIONS`` (a YAML mapping) -> (reasoning-gym dataset name, options)."""
    name, _, options = text.partition(":")
    return name.strip(), (yaml.safe_load(options) if options else {}) or {}


def evaluate(cfg, policy_path: str) -> dict:
    """Greedy accuracy of the base policy on ``cfg``'s task (its eval split), through the run's eval engine."""
    from tba.models import load_causal_lm, load_tokenizer, pick_dtype
    from tba.runtime.build import build_eval_engine
    from tba.tasks import build_task

    task = build_task(cfg)
    tok = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path, pick_dtype(cfg.model.dtype)).eval()
    engine = build_eval_engine(cfg, policy_path, model, tok, task)
    try:
        return task.evaluate(engine, tok, cfg.run.eval_batch_size, cfg.searcher.max_new_tokens, policy=model)
    finally:
        getattr(engine, "close", lambda: None)()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--candidates", nargs="+", default=DEFAULT_CANDIDATES)
    p.add_argument("--eval-size", type=int, default=200, help="held-out problems per candidate")
    p.add_argument("--out", default="benchmarks/results/headroom_pilot.json")
    args = p.parse_args(argv)

    from tba.config import load_config
    from tba.models import prepare_model
    from tba.placement import resolve_placement

    records = []
    for cand in args.candidates:
        name, options = parse_candidate(cand)
        cfg = resolve_placement(load_config(args.config, {"task.name": f"reasoning_gym:{name}", "task.options": options,
                                                          "task.eval_size": args.eval_size}), 0)
        load_before, t0 = os.getloadavg()[0], time.monotonic()
        result = evaluate(cfg, prepare_model(cfg.model.policy, cfg.model.cache_dir))
        n, acc = result["n"], result["accuracy"]
        lo, hi = wilson(round(acc * n), n)
        rec = {"candidate": cand, "task": name, "options": options, "accuracy": acc, "ci95": [lo, hi], "n": n,
               "eval_engine": cfg.run.eval_engine, "seconds": round(time.monotonic() - t0, 1),
               "load_before": load_before, "load_after": os.getloadavg()[0], "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d"), "examples": result.get("examples", [])[:2]}
        records.append(rec)
        print(f"{cand:80s} {acc:.3f} [{lo:.3f}, {hi:.3f}] n={n} ({rec['seconds']:.0f} s)", flush=True)
        write_json(Path(args.out), records)  # after every candidate: a stop keeps the rest
    return 0


if __name__ == "__main__":
    sys.exit(main())
