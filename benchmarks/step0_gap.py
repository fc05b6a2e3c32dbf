"""Step-0 precision gap: how far the trainer's policy log-probs are from the searcher's reference log-probs
when the policy still equals the reference (docs/algorithm.md section 1: on such a batch every TB residual
should be 0, and on a group of equal rewards that residual is all the gradient there is).

The trainer scores with float32 master weights under bf16 autocast; the searcher's reference is a bf16 copy.
This script builds both exactly as a run does (``tba.runtime.build``), generates one searcher batch, takes one
trainer step on it and reports ``train/abs_logratio_token_mean`` / ``_seq_mean`` (nats) and the TB loss, for
each ``model.dtype`` asked for (float32 makes both sides float32: the control). It then takes the same step from
a fresh trainer on the same responses with every reward set to 0 (``tied``): every group is tied, so the TB
gradient is the precision gap's alone, and ``tied/grad_norm`` over ``train/grad_norm`` is the share of a real
step's gradient that the gap can make.

    python benchmarks/step0_gap.py --dtypes bfloat16 float32 --out benchmarks/results/step0-gap.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import quiet_env, write_json


def measure(config: str, dtype: str, seed: int) -> dict:
    """One searcher batch and one trainer step at step 0 with ``model.dtype`` = ``dtype``."""
    from tba.config import load_config
    from tba.models import prepare_model
    from tba.runtime.build import build_searcher, build_trainer
    from tba.types import Batch

    cfg = load_config(config, {"model.dtype": dtype, "run.seed": seed})
    path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    searcher = build_searcher(cfg, path, path, 0)
    trainer, _ = build_trainer(cfg, path, path)
    samples, _ = searcher.step()
    k = cfg.trainer.group_size
    samples = samples[: len(samples) // k * k]
    m = trainer.step(Batch(samples, k))
    tied_trainer, _ = build_trainer(cfg, path, path)  # the same step-0 weights
    tied = tied_trainer.step(Batch([replace(s, reward=0.0) for s in samples], k))
    return {"dtype": dtype, "seed": seed, "samples": len(samples),
            **{key: m[key] for key in ("train/abs_logratio_token_mean", "train/abs_logratio_seq_mean", "loss/tb",
                                       "train/grad_norm", "train/reward_mean")},
            "tied/loss_tb": tied["loss/tb"], "tied/grad_norm": tied["train/grad_norm"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="benchmarks/results/step0-gap.json")
    args = p.parse_args(argv)
    quiet_env()
    rows = [measure(args.config, d, s) for d in args.dtypes for s in args.seeds]
    for r in rows:
        print(r, flush=True)
    write_json(Path(args.out), {"rows": rows, "command": " ".join(["python", *sys.argv])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
