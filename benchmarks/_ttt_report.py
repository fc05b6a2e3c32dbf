"""The time-to-target report: first passage per target (Kaplan-Meier over censored runs), paired ratios with
bootstrap intervals, accuracy at fixed training-clock budgets, the table and the plot.

Everything is computed from the runs' eval points after the fact, so a target can be added to a finished
study without re-running it. A run that never reaches a target is right-censored at its last eval.
"""

from __future__ import annotations

import math
import statistics

from _common import pyplot, save_figure
from _stats import km_median, mean_ci, paired_difference_ci, paired_ratio_ci

LABELS = {"async": "tba async (TBA)", "sync": "tba sync (on-policy)", "trl": "TRL GRPOTrainer",
          "async-vllm": "tba async (TBA), vLLM searchers", "sync-vllm": "tba sync (on-policy), vLLM searchers"}
COLORS = {"async": "tab:blue", "sync": "tab:orange", "trl": "tab:green", "async-vllm": "tab:purple",
          "sync-vllm": "tab:brown"}
#: (numerator, denominator) of the ratios the README's speed claims rest on: how many times sooner the
#: denominator reaches the target
RATIOS = [("trl", "async"), ("sync", "async"), ("async", "async-vllm")]


def first_passage(run: dict, target: float, with_setup: bool = False) -> tuple[float, bool]:
    """(seconds, reached): training clock at the first eval with accuracy >= ``target``, or the clock of the
    run's last eval if none (censored there). ``with_setup`` adds the run's setup time."""
    pts = run["points"]
    hit = _first_hit(run, target)
    t = hit["train_s"] if hit else (pts[-1]["train_s"] if pts else run.get("train_s", 0.0))
    return t + (run["setup_s"] if with_setup else 0.0), hit is not None


def first_step(run: dict, target: float) -> int | None:
    """Trainer step of the first eval with accuracy >= ``target`` (None if none): a target that the fastest
    method reaches in a handful of steps measures start-up, not learning speed."""
    hit = _first_hit(run, target)
    return hit["step"] if hit else None


def _first_hit(run: dict, target: float) -> dict | None:
    """The run's first eval point with accuracy >= ``target`` (float slack 1e-12), or None."""
    return next((p for p in run["points"] if p["accuracy"] >= target - 1e-12), None)


def accuracy_at(run: dict, budget_s: float, base: float) -> float:
    """Accuracy of the last eval at or before ``budget_s`` of training clock (the base accuracy before the
    first); a run that stopped earlier keeps its last accuracy."""
    acc = base
    for p in run["points"]:
        if p["train_s"] <= budget_s + 1e-9:
            acc = p["accuracy"]
    return acc


def _by_seed(runs: list[dict], method: str) -> dict[int, dict]:
    return {r["seed"]: r for r in runs if r.get("method") == method and "error" not in r and r.get("points")}


def summarize(runs: list[dict], methods: list[str], targets: dict[str, float], budgets: list[float],
              base: float) -> dict:
    """Per method: per target (KM median without and with setup, share reached, per-seed times), accuracy at
    each budget (mean, 95% CI), the plateau (best accuracy per run), steps and seconds per step, threads."""
    out = {}
    for m in methods:
        rs = _by_seed(runs, m)
        seeds = sorted(rs)
        per_target = {}
        for name, tgt in targets.items():
            cells = {}
            for clock in ("train", "with_setup"):
                tr = [first_passage(rs[s], tgt, clock == "with_setup") for s in seeds]
                cells[clock] = {"km_median_s": km_median([t for t, _ in tr], [r for _, r in tr]) if tr else math.nan,
                                "per_seed_s": [round(t, 1) if r else None for t, r in tr]}
            per_target[name] = {**cells, "reached": sum(first_passage(rs[s], tgt)[1] for s in seeds),
                                "per_seed_step": [first_step(rs[s], tgt) for s in seeds]}
        out[m] = {
            "seeds": seeds, "failed": sum(1 for r in runs if r.get("method") == m and "error" in r),
            "targets": per_target,
            "budget_accuracy": {str(b): mean_ci([accuracy_at(rs[s], b, base) for s in seeds]) for b in budgets},
            "best_accuracy": [max(p["accuracy"] for p in rs[s]["points"]) for s in seeds],
            "s_per_step": [rs[s]["train_s"] / max(1, rs[s]["steps"]) for s in seeds],
            "setup_s": [rs[s]["setup_s"] for s in seeds],
            "threads": rs[seeds[0]].get("threads") if seeds else None,
            "when": [f"{rs[s].get('started_utc', '?')} {rs[s].get('load_before', '?')}/{rs[s].get('load_after', '?')}"
                     for s in seeds],
            "errors": [r["error"] for r in runs if r.get("method") == m and "error" in r],
        }
    return out


def compare(runs: list[dict], targets: dict[str, float], budgets: list[float], base: float) -> list[dict]:
    """Paired comparisons over the seeds both methods finished: time-to-target ratio (KM medians, bootstrap
    95% CI) per target and clock, and the accuracy difference at each budget (t interval)."""
    out = []
    for num, den in RATIOS:
        a, b = _by_seed(runs, num), _by_seed(runs, den)
        seeds = sorted(set(a) & set(b))
        if len(seeds) < 1:
            continue
        row = {"num": num, "den": den, "seeds": seeds, "ratio": {}, "budget_difference": {}}
        for name, tgt in targets.items():
            for clock in ("train", "with_setup"):
                ta = [first_passage(a[s], tgt, clock == "with_setup") for s in seeds]
                tb = [first_passage(b[s], tgt, clock == "with_setup") for s in seeds]
                row["ratio"][f"{name}/{clock}"] = paired_ratio_ci(
                    [t for t, _ in ta], [r for _, r in ta], [t for t, _ in tb], [r for _, r in tb])
        for bud in budgets:
            row["budget_difference"][str(bud)] = paired_difference_ci(
                [accuracy_at(b[s], bud, base) for s in seeds], [accuracy_at(a[s], bud, base) for s in seeds])
        out.append(row)
    return out


def _s(x: float) -> str:
    return "not reached" if math.isinf(x) else ("-" if math.isnan(x) else f"{x:.0f}")


def _ci(d: dict, f: str = "{:.2f}") -> str:
    def one(x):
        return "inf" if math.isinf(x) else ("?" if math.isnan(x) else f.format(x))

    key = "ratio" if "ratio" in d else "mean"
    return f"{one(d[key])} [{one(d['low'])}, {one(d['high'])}]"


def format_table(summary: dict, comparisons: list[dict], meta: dict) -> str:
    """The markdown report: the setup, one row per method, the paired ratios and differences, the command."""
    names = list(meta["targets"])
    budgets = meta["budgets"]
    head = ["method", "seeds"] + [f"time to {n} (s, KM median; reached)" for n in names] + \
        [f"same, setup included ({n})" for n in names] + [f"accuracy at {b:g} s" for b in budgets] + \
        ["best accuracy (median)", "s/step (median)", "setup s (median)"]
    lines = [f"# Time to target ({meta['time']})", "", meta["desc"], "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in summary.items():
        t = s["targets"]
        cells = [LABELS[m], str(len(s["seeds"]))]
        cells += [f"{_s(t[n]['train']['km_median_s'])} ({t[n]['reached']}/{len(s['seeds'])})" for n in names]
        cells += [_s(t[n]["with_setup"]["km_median_s"]) for n in names]
        cells += [_ci(s["budget_accuracy"][str(b)], "{:.3f}") for b in budgets]
        med = (lambda xs, f: f.format(statistics.median(xs)) if xs else "-")  # noqa: E731
        cells += [med(s["best_accuracy"], "{:.3f}"), med(s["s_per_step"], "{:.2f}"), med(s["setup_s"], "{:.0f}")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for c in comparisons:
        lab = f"{LABELS[c['num']]} / {LABELS[c['den']]}"
        ratios = "; ".join(f"{k}: {_ci(v)}" for k, v in c["ratio"].items())
        diffs = "; ".join(f"{b} s: {_ci(v, '{:+.3f}')}" for b, v in c["budget_difference"].items())
        lines.append(f"- time-to-target ratio {lab} (paired over seeds {c['seeds']}, bootstrap 95% CI): {ratios}")
        lines.append(f"- accuracy {LABELS[c['den']]} minus {LABELS[c['num']]} at fixed budgets (paired t 95% CI): "
                     f"{diffs}")
    for m, s in summary.items():
        per = "; ".join(f"{n}: {s['targets'][n]['train']['per_seed_s']} s, step {s['targets'][n]['per_seed_step']}"
                        for n in names)
        lines.append(f"- {LABELS[m]} per seed {s['seeds']} (training clock and trainer step at the target, None = "
                     f"not reached): {per}; threads {s['threads']}; started (UTC) and 1-min load average before "
                     f"/ after: {s['when']}")
        lines += [f"- {LABELS[m]} run failed: {e[:200]}" for e in s["errors"]]
    lines += ["", "Command: `" + meta["command"] + "`", ""]
    return "\n".join(lines)


def plot(runs: list[dict], meta: dict, path) -> object:
    """Accuracy vs training clock: every run faint, the median over seeds per method bold; targets dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    base = meta["base"]["accuracy"]
    horizon = max((p["train_s"] for r in runs if "error" not in r for p in r.get("points", [])), default=1.0)
    grid = [horizon * i / 200 for i in range(201)]
    for m in meta["methods"]:
        rs = [r for r in runs if r.get("method") == m and "error" not in r and r.get("points")]
        for r in rs:
            ax.step([0.0] + [p["train_s"] for p in r["points"]], [base] + [p["accuracy"] for p in r["points"]],
                    where="post", color=COLORS[m], alpha=0.25, linewidth=0.8)
        if rs:
            med = [statistics.median(accuracy_at(r, t, base) for r in rs) for t in grid]
            ax.step(grid, med, where="post", color=COLORS[m], linewidth=2.2, label=f"{LABELS[m]} (median of {len(rs)})")
    for name, tgt in meta["targets"].items():
        ax.axhline(tgt, color="black", linestyle="--", linewidth=0.8)
        ax.text(0, tgt, f" {name}", fontsize=7, va="bottom")
    ax.axhline(base, color="gray", linestyle=":", linewidth=1, label=f"base {base:.3f}")
    ax.set_xlabel("training wall-clock seconds (setup and evals excluded)")
    ax.set_ylabel(f"greedy eval accuracy ({meta['base']['n']} problems)")
    ax.set_title(f"Accuracy vs wall-clock: {meta['short']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)
