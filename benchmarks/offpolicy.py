"""Off-policy study: does trajectory balance hold up on stale data better than the baselines?

The paper's central claim (docs/algorithm.md sections 3 and 6) is that the TB loss stays accurate on stale and
replayed samples, where GRPO/RLOO-style objectives degrade. This study isolates staleness from reuse.

Design
------
Every *cell* trains the same base model on the same task, from the same config, for the same number of trainer
steps, and differs only in its *arm* (objective plus its settings) and its *staleness setting*:

- **lag L** (``trainer.generation_lag``) with sync period k = 1: the searchers generate with the weights of L
  publications ago and the recent set is refreshed every step, so staleness grows by about L steps while
  no sample is drawn more often for it (measured: less often, as the on-policy window widens
  with L; ``buffer/reuse_mean`` is recorded per cell);
- **k = 16** (``trainer.sync_period``), lag 0: the paper's sync period with the config's fill (the recent set
  is fixed for 16 steps; measured with the quickstart's fill: fewer draws per sample than at k = 1, not more).

Arms (:data:`ARMS`): the main four ``tb``, ``rloo``, ``grpo`` and ``ppo_clip-is2`` (importance-weighted
REINFORCE with the importance weight truncated at 2, the usual correction of async RL systems), and three
mechanism arms run at the end lags only: ``tb-beta0.05`` (a constant KL coefficient of 0.05, TB's trust
region: larger than the anneal 0.012 -> 0.004 of the quickstart the committed cells ran, smaller than its
constant 0.1 since 2026-12-07), ``tb-noclip`` (no gradient-norm clipping, as the TB authors' loop) and
``grpo-noclip`` (GRPO with its ratio clip off, so reused samples are not cut off).

Seeds ``run.seed`` are paired: every arm and setting of one seed shares its searchers' and trainer's seed,
and all cells share the training prompts and the held-out eval problems (``task.seed`` of the config). The
base accuracy is measured once (greedy decoding of the unchanged model gives the same number in every cell).
Cells run seed-major, and within a seed the cells that answer the question first: main arms at the smallest
and largest lag, then the mechanism arms, then the middle lags, then k = 16. Every finished cell is appended
to ``<out>/results.jsonl`` at once (fsync), so ``--resume`` after an interruption skips finished cells. Each
record holds the compute the cell took (wall seconds, train seconds, CPU count, threads).

Statistics (``_stats``): each cell's accuracy is the mean over seeds with a 95% Student-t interval over seeds;
the effect that answers the question is, per seed, TB's drop from the smallest to the largest lag minus a
baseline's drop, averaged over the paired seeds with its 95% t interval. A positive value means TB lost more.
The same paired effect is reported from the smallest lag to each lag in between (L = 4), and from k = 1 to
k = 16 (both at lag 0): the paper's sync period.

Outputs: ``<out>/table.md`` (cells, drops, paired effects) and ``<out>/accuracy_vs_staleness.png``.

Commands (repository root, venv active)
---------------------------------------
Smoke (2-layer model; the numbers mean nothing)::

    python benchmarks/offpolicy.py --steps 3 --seeds 0 --lags 0 2 --arms tb grpo --mechanism-arms \\
        --no-sync-cell --eval-size 8 --set model.num_hidden_layers=2 --set task.train_size=40 \\
        --set searcher.max_new_tokens=8 --set buffer.min_fill=16 --out /tmp/offpolicy-smoke

The study (2 CPU cores: about 6 minutes a cell, 22 cells a seed)::

    python benchmarks/offpolicy.py --seeds 0 1 2 --eval-size 500 --resume --out benchmarks/results/offpolicy

``--report-only`` rebuilds the table and the plot from ``results.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, _stats, also when loaded by path
from _common import (
    append_result,
    error_line,
    pyplot,
    read_results,
    save_figure,
    setup_id,
    start_study,
    study_main,
    study_parser,
)
from _stats import mean_ci, paired_difference_ci

#: arm name -> (loss.name, the arm's own config overrides)
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "tb": ("tb", {}),
    "rloo": ("rloo", {}),
    "grpo": ("grpo", {}),
    "ppo_clip-is2": ("ppo_clip", {"loss.is_cap": 2.0}),
    "tb-beta0.05": ("tb", {"trainer.beta_start": 0.05, "trainer.beta_end": 0.05}),
    "tb-noclip": ("tb", {"trainer.grad_clip": None}),
    "grpo-noclip": ("grpo", {"loss.clip_eps": 1e9}),  # a ratio never leaves [1 - 1e9, 1 + 1e9]
}
MAIN_ARMS = ("tb", "rloo", "grpo", "ppo_clip-is2")
MECHANISM_ARMS = ("tb-beta0.05", "tb-noclip", "grpo-noclip")
DEFAULT_LAGS = (0, 4, 16)
SYNC_CELL_K = 16
#: applied before the user's --set overrides (which win)
BENCH_DEFAULTS = {"trainer.save_final": False, "run.checkpoint_every": 0}


# -- cells -------------------------------------------------------------------------------------------

def plan_cells(seeds: list[int], arms: list[str], lags: list[int], mechanism_arms: list[str],
               sync_k: int | None) -> list[dict]:
    """Every cell, seed-major, the cells that answer the question first within a seed.

    Per seed: ``arms`` at the smallest and largest lag; ``mechanism_arms`` at those two lags; ``arms`` at the
    other lags; ``arms`` at sync period ``sync_k`` with lag 0 (skipped when ``sync_k`` is None). Lag cells
    use k = 1. Each cell: ``{"arm", "objective", "lag", "k", "seed"}``.
    """
    ends = sorted({min(lags), max(lags)})
    middle = [lag for lag in sorted(set(lags)) if lag not in ends]
    cells = []
    for seed in seeds:
        phases = [(arms, ends, 1), (mechanism_arms, ends, 1), (arms, middle, 1)]
        if sync_k:
            phases.append((arms, [0], sync_k))
        for phase_arms, phase_lags, k in phases:
            for lag in phase_lags:
                for arm in phase_arms:
                    cells.append({"arm": arm, "objective": ARMS[arm][0], "lag": lag, "k": k, "seed": seed})
    return cells


def setting(c: dict) -> str:
    """A cell's staleness setting: ``L<lag>`` (k = 1) or ``k<k>`` (lag 0)."""
    return f"L{c['lag']}" if c["k"] == 1 else f"k{c['k']}" if c["lag"] == 0 else f"L{c['lag']}-k{c['k']}"


def cell_name(c: dict) -> str:
    return f"{c['arm']}-{setting(c)}-s{c['seed']}"


def cell_key(rec: dict) -> tuple:
    return rec["arm"], int(rec["lag"]), int(rec["k"]), int(rec["seed"]), rec.get("setup")


def cell_overrides(extra: dict, c: dict, steps: int, eval_size: int, run_dir: Path, measure_base: bool) -> dict:
    """Config overrides of one cell: the study's ``extra``, then the arm's, then the cell's own."""
    return {**extra, **ARMS[c["arm"]][1], "loss.name": c["objective"], "trainer.generation_lag": c["lag"],
            "trainer.sync_period": c["k"], "run.seed": c["seed"], "trainer.max_steps": steps,
            "task.eval_size": eval_size, "run.output_dir": str(run_dir), "run.mode": "async",
            "run.eval_before": measure_base, "run.eval_after": True}


def run_metrics(run_dir: Path) -> dict:
    """Per-run means of the logged step metrics that explain a cell (``metrics.jsonl``).

    Returns ``reuse_mean`` (mean over steps of how many times a trained sample had been drawn),
    ``reuse_max``, ``staleness_min`` (smallest staleness of any trained sample), ``clipped_frac`` (share of
    steps whose gradient norm was clipped) and ``abs_logratio_token`` (mean |log pi_theta - log pi_ref| per
    token, nats); a key is absent when no step logged it.
    """
    rows = [r for r in read_results(run_dir / "metrics.jsonl") if "buffer/reuse_mean" in r or "train/clipped" in r]

    def values(key):
        return [float(r[key]) for r in rows if key in r]

    out = {}
    for name, key, agg in [("reuse_mean", "buffer/reuse_mean", "mean"), ("reuse_max", "buffer/reuse_max", "max"),
                           ("staleness_min", "buffer/staleness_min", "min"), ("clipped_frac", "train/clipped", "mean"),
                           ("abs_logratio_token", "train/abs_logratio_token_mean", "mean")]:
        v = values(key)
        if v:
            out[name] = {"mean": sum(v) / len(v), "max": max(v), "min": min(v)}[agg]
    return out


# -- report ------------------------------------------------------------------------------------------

def latest_by_cell(records: list[dict]) -> dict[tuple, dict]:
    """Successful records keyed by (arm, lag, k, seed, setup); a rerun cell counts once (the latest)."""
    return {cell_key(r): r for r in records if not r.get("error") and r.get("accuracy") is not None}


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (arm, lag, k): accuracy mean and 95% t interval over seeds, and the cell means of
    staleness, reuse, clipping and compute. Rows follow :data:`ARMS` order, then k, then lag."""
    groups: dict[tuple, list[dict]] = {}
    for (arm, lag, k, _, _), r in latest_by_cell(records).items():
        groups.setdefault((arm, lag, k), []).append(r)
    rows = []
    for (arm, lag, k), rs in groups.items():
        rs.sort(key=lambda r: r["seed"])
        row = {"arm": arm, "lag": lag, "k": k, "seeds": [r["seed"] for r in rs],
               "acc": mean_ci([r["accuracy"] for r in rs]), "eval_n": rs[0].get("n_eval")}
        for key in ("staleness_mean", "reuse_mean", "clipped_frac", "train_wall_s", "wall_s"):
            vals = [float(r[key]) for r in rs if r.get(key) is not None]
            row[key] = sum(vals) / len(vals) if vals else None
        row["staleness_max"] = max(float(r["staleness_max"]) for r in rs)
        row["reuse_max"] = max((float(r["reuse_max"]) for r in rs if r.get("reuse_max") is not None), default=None)
        rows.append(row)
    order = {a: i for i, a in enumerate(ARMS)}
    rows.sort(key=lambda r: (order.get(r["arm"], len(order)), r["k"], r["lag"]))
    return rows


def drops(records: list[dict], low: tuple[int, int], high: tuple[int, int]) -> dict[str, dict[int, float]]:
    """Per arm and seed, accuracy at setting ``low`` minus accuracy at setting ``high`` (settings are
    ``(lag, k)``; seeds with both only)."""
    acc: dict[tuple, float] = {(a, (lag, k), s): r["accuracy"]
                               for (a, lag, k, s, _), r in latest_by_cell(records).items()}
    out: dict[str, dict[int, float]] = {}
    for (arm, where, seed), a in acc.items():
        if where == low and (arm, high, seed) in acc:
            out.setdefault(arm, {})[seed] = a - acc[(arm, high, seed)]
    return out


def effects(records: list[dict], low: tuple[int, int], high: tuple[int, int], reference: str = "tb") -> list[dict]:
    """Each arm's drop (setting ``low`` -> ``high``, each ``(lag, k)``) with its 95% t interval over seeds, and
    the paired difference ``reference``'s drop minus the arm's drop over the seeds both have (the study's
    answer for L = 0 -> 16 at k = 1: positive = the reference lost more accuracy to staleness)."""
    d = drops(records, low, high)
    ref = d.get(reference, {})
    out = []
    for arm in [a for a in ARMS if a in d] + sorted(set(d) - set(ARMS)):
        seeds = sorted(d[arm])
        row = {"arm": arm, "drop": mean_ci([d[arm][s] for s in seeds]), "seeds": seeds}
        common = sorted(set(seeds) & set(ref))
        if arm != reference and common:
            row["ref_minus_arm"] = paired_difference_ci([ref[s] for s in common], [d[arm][s] for s in common])
        out.append(row)
    return out


def _ci(c: dict, digits: int = 3) -> str:
    if c["n"] < 2 or c["low"] != c["low"]:  # NaN bounds: one seed
        return f"{c['mean']:.{digits}f} (n={c['n']})"
    return f"{c['mean']:.{digits}f} [{c['low']:.{digits}f}, {c['high']:.{digits}f}] (n={c['n']})"


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def base_accuracy(records: list[dict]) -> float | None:
    """The base model's accuracy, from the cell that measured it (None before one has)."""
    return next((r["base_accuracy"] for r in records if r.get("base_measured") and r.get("base_accuracy")), None)


def format_report(records: list[dict], rows: list[dict], low: int, high: int) -> str:
    """Markdown: the cell table (``rows`` = :func:`aggregate` of ``records``), then the drops and paired effects
    between lags ``low`` and ``high`` (k = 1), between ``low`` and each lag run in between (k = 1), and between
    k = 1 and each sync period k > 1 run (both at lag ``low``)."""
    base = base_accuracy(records)
    head = ["arm", "setting", "accuracy mean [95% CI]", "staleness mean", "staleness max", "reuse mean",
            "reuse max", "steps clipped", "train s / cell"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["arm"], setting(r), _ci(r["acc"]), _num(r["staleness_mean"], ".2f"), f"{r['staleness_max']:.0f}",
            _num(r["reuse_mean"], ".2f"), _num(r["reuse_max"], ".0f"), _num(r["clipped_frac"], ".0%"),
            _num(r["train_wall_s"], ".0f")]) + " |")
    eval_n = {r["eval_n"] for r in rows}
    notes = [f"Accuracy: final greedy accuracy on the same {'/'.join(map(str, sorted(n for n in eval_n if n)))} "
             "held-out problems, mean over paired seeds with a 95% Student-t interval over seeds."]
    if base is not None:
        notes.append(f"Base model (before training): {base:.3f}.")
    # the question (low -> high) first, then each lag in between, then each sync period
    comparisons = [((low, 1), (lag, 1), f"lag {low} to lag {lag} (k = 1)", "staleness")
                   for lag in [high] + sorted({r["lag"] for r in rows if r["k"] == 1 and low < r["lag"] < high})]
    comparisons += [((low, 1), (low, k), f"lag {low}, k = 1 to k = {k}", f"sync period {k}")
                    for k in sorted({r["k"] for r in rows if r["k"] > 1})]
    for a, b, what, cause in comparisons:
        eff = effects(records, a, b)
        if not eff:
            continue
        lines += ["", f"Drop from {what}, paired by seed; last column: TB's drop minus the arm's (positive: TB "
                  f"lost more to {cause}).", "",
                  "| arm | drop [95% CI] | TB's drop minus this arm's [95% CI] |", "|---|---|---|"]
        for e in eff:
            lines.append(f"| {e['arm']} | {_ci(e['drop'])} | "
                         f"{_ci(e['ref_minus_arm']) if 'ref_minus_arm' in e else '-'} |")
    finished = latest_by_cell(records)
    failed = [r for r in records if r.get("error") and cell_key(r) not in finished]
    if failed:
        notes.append("Failed cells (not in the tables): " + ", ".join(
            f"{cell_name(r)} ({r['error'][:80]})" for r in failed))
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def plot(rows: list[dict], base: float | None, path: Path) -> Path:
    """Accuracy (mean, 95% CI bars) vs mean staleness, one line per arm over its lag cells; k = 16 cells as
    open markers; the base accuracy dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate([a for a in ARMS if any(r["arm"] == a for r in rows)]):
        color = colors[i % len(colors)]
        for lagged, style in ((True, "-"), (False, "none")):
            rs = sorted((r for r in rows if r["arm"] == arm and (r["k"] == 1) == lagged),
                        key=lambda r: r["staleness_mean"] or 0)
            if not rs:
                continue
            y = [r["acc"]["mean"] for r in rs]
            err = [[0 if r["acc"]["low"] != r["acc"]["low"] else m - r["acc"]["low"] for r, m in zip(rs, y)],
                   [0 if r["acc"]["high"] != r["acc"]["high"] else r["acc"]["high"] - m for r, m in zip(rs, y)]]
            ax.errorbar([r["staleness_mean"] for r in rs], y, yerr=err, color=color, linestyle=style, marker="o",
                        mfc=color if lagged else "white", capsize=3, label=arm if lagged else f"{arm} (k={rs[0]['k']})",
                        linewidth=1.5 if arm in MAIN_ARMS else 1.0, alpha=1.0 if arm in MAIN_ARMS else 0.7)
    if base is not None:
        ax.axhline(base, color="gray", linestyle="--", linewidth=1, label=f"base model ({base:.3f})")
    ax.set_xlabel("mean staleness of trained samples (trainer steps)")
    ax.set_ylabel("final greedy accuracy (held-out)")
    ax.set_title("Accuracy vs staleness (lag L, k = 1; open: k = 16); bars: 95% CI over paired seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def report(out: Path, low: int, high: int) -> str:
    """Write ``table.md`` and ``accuracy_vs_staleness.png`` from ``<out>/results.jsonl``; return the table."""
    records = read_results(out / "results.jsonl")
    rows = aggregate(records)
    table = format_report(records, rows, low, high)
    (out / "table.md").write_text(table)
    if rows:
        plot(rows, base_accuracy(records), out / "accuracy_vs_staleness.png")
    return table


# -- running -----------------------------------------------------------------------------------------

def run_cell(args, c: dict, rec: dict, overrides: dict, results_path: Path) -> dict:
    """Train one cell, append its record (or its error) to ``results_path`` and return it.
    KeyboardInterrupt passes through."""
    from tba import train

    t0 = time.monotonic()
    try:
        s = train(args.config, overrides=overrides, show_progress=False)
    except Exception as e:  # noqa: BLE001 - record the failure, go on with the other cells
        rec["error"] = error_line(e, -1)
        print(f"  cell failed: {rec['error']}", file=sys.stderr, flush=True)
        append_result(results_path, rec)
        return rec
    after = s.get("eval_after", {})
    rec.update({"accuracy": after.get("accuracy"), "stderr": after.get("stderr"), "n_eval": after.get("n"),
                "staleness_mean": s["staleness_mean"], "staleness_max": s["staleness_max"],
                "train_wall_s": s["train_wall_s"], "wall_s": time.monotonic() - t0,
                "trainer_steps": s["trainer_steps"], "samples_generated": s["samples_generated"],
                **run_metrics(Path(rec["run_dir"]))})
    if "eval_before" in s:
        rec["base_accuracy"], rec["base_measured"] = s["eval_before"].get("accuracy"), True
    append_result(results_path, rec)
    print(f"  accuracy {rec['accuracy']:.3f}, staleness mean {rec['staleness_mean']:.2f} max "
          f"{rec['staleness_max']:.0f}, reuse {rec.get('reuse_mean', float('nan')):.2f}, "
          f"train {rec['train_wall_s']:.0f} s", flush=True)
    return rec


def run_study(args) -> int:
    """Run every planned cell not yet in ``results.jsonl`` (with ``--resume``), then write the report."""
    extra, base_cfg, out, previous = start_study(args, BENCH_DEFAULTS)
    results_path = out / "results.jsonl"
    steps = args.steps or base_cfg.trainer.max_steps
    eval_size = args.eval_size or base_cfg.task.eval_size
    setup = setup_id(args.config, steps, eval_size, extra)
    cells = plan_cells(args.seeds, args.arms, args.lags, args.mechanism_arms,
                       SYNC_CELL_K if args.sync_cell else None)
    done = {k for k in latest_by_cell(previous) if k[-1] == setup}
    base_done = any(r.get("base_measured") and r.get("setup") == setup for r in previous)
    print(f"off-policy study: {len(cells)} cells ({len(done)} done), {steps} steps each, eval {eval_size} problems, "
          f"setup {setup}, results -> {results_path}", flush=True)
    t0 = time.monotonic()
    for i, c in enumerate(cells, 1):
        if (c["arm"], c["lag"], c["k"], c["seed"], setup) in done:
            continue
        run_dir = out / "runs" / cell_name(c)
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run: metrics.jsonl would otherwise be appended to
        print(f"[{i}/{len(cells)}] {cell_name(c)} (elapsed {time.monotonic() - t0:.0f} s)", flush=True)
        overrides = cell_overrides(extra, c, steps, eval_size, run_dir, measure_base=not base_done)
        rec: dict[str, Any] = {**c, "setting": setting(c), "steps": steps, "eval_size": eval_size, "setup": setup,
                               "config": args.config, "overrides": {k: v for k, v in overrides.items()},
                               "run_dir": str(run_dir), "cpus": os.cpu_count(),
                               "threads": {"searcher": base_cfg.searcher.threads,
                                           "trainer": base_cfg.trainer.threads},
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            rec = run_cell(args, c, rec, overrides, results_path)
        except KeyboardInterrupt:
            print("\ninterrupted; finished cells are in results.jsonl (continue with --resume)", file=sys.stderr)
            return 130
        base_done = base_done or bool(rec.get("base_measured"))
        report(out, min(args.lags), max(args.lags))
    print(f"study finished in {time.monotonic() - t0:.0f} s\n", flush=True)
    print(report(out, min(args.lags), max(args.lags)), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = study_parser(__doc__, "configs/quickstart.yaml", [0, 1, 2], "benchmarks/results/offpolicy")
    p.add_argument("--arms", nargs="+", default=list(MAIN_ARMS), choices=list(ARMS), help="main arms")
    p.add_argument("--mechanism-arms", nargs="*", default=list(MECHANISM_ARMS), choices=list(ARMS),
                   help="arms run at the smallest and largest lag only (none: the flag alone)")
    p.add_argument("--lags", type=int, nargs="+", default=list(DEFAULT_LAGS), help="generation lags L (k = 1)")
    p.add_argument("--sync-cell", action=argparse.BooleanOptionalAction, default=True,
                   help=f"also run the main arms at sync period k = {SYNC_CELL_K}, lag 0")
    p.add_argument("--eval-size", type=int, default=None, help="held-out eval problems; default: the config's")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return study_main(args, run_study, lambda out: report(out, min(args.lags), max(args.lags)))


if __name__ == "__main__":
    sys.exit(main())
