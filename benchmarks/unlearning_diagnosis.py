"""Unlearning diagnosis (issue 25, item 1): the quickstart recipe at sync period 1 against TB at a constant
beta of 0.05, same seed, curves side by side.

The off-policy study's cell tb L0 seed 2 (annealed beta 0.012 -> 0.004, sync period 1, async) ended below
the base model (0.198 vs 0.262). The two runs below repeat it, and its beta-0.05 neighbour, with an eval
every 10 steps; this script plots, per run: held-out accuracy with one standard error, the searchers'
reward, KL to the reference, log Z, the gradient norm (before clipping), distinct responses per prompt and
response length, each averaged over 5-step windows, into ``--out``.

    for b in "" "--trainer.beta_start 0.05 --trainer.beta_end 0.05"; do ...  # the commands: benchmarks/README.md
    python benchmarks/unlearning_diagnosis.py benchmarks/results/diagnosis/tb-L0-s2 \\
        benchmarks/results/diagnosis/tb-beta0.05-L0-s2 --out benchmarks/results/diagnosis/diagnosis.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pyplot, save_figure  # noqa: E402

PANELS = [("searcher/reward_mean", "searcher reward"), ("loss/kl_mean", "KL(pi || pi_ref), nats"),
          ("loss/log_z_mean", "log Z"), ("train/grad_norm", "grad norm (before clip)"),
          ("searcher/distinct_frac", "distinct responses / S"), ("train/response_len_mean", "response tokens")]


def window_means(records: list[dict], key: str, width: int = 5) -> tuple[list[float], list[float]]:
    """(window centre steps, mean of ``key``) over consecutive ``width``-step windows of the records."""
    pts = [(r["step"], r[key]) for r in records if key in r]
    xs, ys = [], []
    for start in range(0, max((s for s, _ in pts), default=0), width):
        vals = [v for s, v in pts if start < s <= start + width]
        if vals:
            xs.append(start + width / 2)
            ys.append(sum(vals) / len(vals))
    return xs, ys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (metrics.jsonl, summary.json)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    plt = pyplot()

    from tba.logger import eval_series, read_metrics

    fig, axes = plt.subplots(4, 2, figsize=(10, 10), sharex=True)
    for run in args.runs:
        records = read_metrics(Path(run) / "metrics.jsonl")
        summary = json.loads((Path(run) / "summary.json").read_text())
        _, pts = eval_series(records, summary.get("eval_before"), summary.get("eval_after"), summary["trainer_steps"])
        label = Path(run).name
        axes[0, 0].errorbar([s for s, _, _ in pts], [v for _, v, _ in pts], yerr=[e or 0 for _, _, e in pts],
                            fmt="o-", ms=3, capsize=2, label=label)
        for ax, (key, title) in zip(axes.flat[2:], PANELS):
            ax.plot(*window_means(records, key), label=label)
            ax.set_title(title, fontsize=9)
        axes[0, 1].plot(*window_means(records, "train/beta"), label=label)
    axes[0, 0].set_title("held-out accuracy (± 1 s.e., 500 problems)", fontsize=9)
    axes[0, 1].set_title("beta", fontsize=9)
    axes.flat[5].set_yscale("log")  # the gradient norm
    axes[0, 0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("trainer step")
    print(save_figure(fig, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
