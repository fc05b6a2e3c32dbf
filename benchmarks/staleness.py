"""Off-policy robustness study: how does each objective's accuracy hold up as data grows stale?

The paper's off-policy claim (docs/algorithm.md sections 3 and 6).

What it measures
----------------
Every *cell* trains the same base model on the same task, from the same base config, for the same number of
trainer steps, through the same searchers, replay buffer and trainer; cells differ only in

- the objective ``loss.name`` in {tb, rloo, grpo, online_dpo},
- the sync period ``trainer.sync_period`` k in {1, 4, 16} (weights reach the searchers every k steps, so a
  larger k means staler samples), and
- for ``tb`` only, the on-policy probability ``buffer.on_policy_prob`` m in {0.5, 0.95} (m = 0.5 replays
  half of every batch from the whole buffer: much staler data). The other objectives use the config's m
  (0.95 in configs/quickstart.yaml).

For each cell and seed (``run.seed``; the prompts, ``task.seed``, stay those of the config, so every cell
sees the same training and eval problems) it records the final greedy eval accuracy and its stderr, the
base (pre-training) accuracy, the mean and max staleness of the trained samples (trainer step minus the
policy version that generated them; ``tba.train``'s ``staleness_mean``/``staleness_max``) and the training
wall time. Each record is appended to ``<out>/results.jsonl`` as soon as its cell finishes, so an
interrupted study keeps its data and ``--resume-results`` continues it. The base accuracy is measured once
per seed (``run.eval_before`` only for that seed's first cell) and reused for the others: greedy decoding of
the unchanged model on the same eval set gives the same number in every cell.

At the end (or with ``--report-only``) the records are aggregated over seeds into ``<out>/table.md``
(printed as well) and ``<out>/accuracy_vs_staleness.png``: x = mean staleness, y = final accuracy (mean
over seeds, bars = min..max), one line per objective (tb m=0.95 and tb m=0.5 separately), points labelled
by k, base accuracy as a dashed line.

Commands (run from the repository root with the venv active)
------------------------------------------------------------
Smoke test (2-layer model, seconds per cell; checks the plumbing, the numbers mean nothing)::

    python benchmarks/staleness.py --steps 2 --seeds 0 --objectives tb rloo --sync-periods 1 4 \\
        --m-values 0.95 --eval-size 4 --set model.num_hidden_layers=2 --set task.train_size=40 \\
        --set searcher.max_new_tokens=8 --set buffer.min_fill=16 --set trainer.prompts_per_step=2 \\
        --set searcher.prompts_per_batch=2 --out /tmp/stale_smoke

Small CPU budget (2 CPU cores; the full 135M model, 15 cells x 2 seeds, 40 steps each, 100 eval problems;
roughly 4-5 hours, see benchmarks/README.md)::

    python benchmarks/staleness.py --steps 40 --seeds 0 1 --eval-size 100 \\
        --set trainer.beta_anneal_steps=40 --out benchmarks/results/staleness

Full scale, e.g. on a GPU machine (the same study with a bigger budget: flags only; any config field,
such as the learning rate or the number of searchers, can be changed for every cell with ``--set``)::

    python benchmarks/staleness.py --steps 500 --seeds 0 1 2 --eval-size 500 \\
        --set trainer.beta_anneal_steps=500 --set trainer.warmup_steps=25 --set trainer.decay_steps=150 \\
        --out benchmarks/results/staleness-full

Add ``--resume-results`` to continue a study in the same ``--out``; ``--report-only`` re-renders the table and
plot from ``results.jsonl`` without training. Choose ``--steps`` well above the largest k (with k = 16 and
40 steps the searchers get new weights only twice).

Caveats
-------
Results and timings are noisy, especially on shared CPUs: wall times depend on whatever else runs on the
machine, async staleness itself depends on the relative speed of searchers and trainer (so it varies from
run to run and machine to machine), and a 100-problem eval has a standard error of about 0.05. Read
differences smaller than the seed spread plus the eval stderr as "no difference".
Per-cell runs go to ``<out>/runs/<cell>`` with ``trainer.save_final=false`` and ``run.checkpoint_every=0``
(to save disk; override with ``--set``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when this file is loaded by path
from _common import append_result, error_line, parse_sets, pyplot, read_results, save_figure, setup_id, study_main

ALL_OBJECTIVES = ("tb", "rloo", "grpo", "online_dpo")
DEFAULT_SYNC_PERIODS = (1, 4, 16)
DEFAULT_M_VALUES = (0.5, 0.95)
#: applied before the user's --set overrides (which win)
BENCH_DEFAULTS = {"trainer.save_final": False, "run.checkpoint_every": 0}


# -- cells -------------------------------------------------------------------------------------------

def plan_cells(objectives: Iterable[str], sync_periods: Iterable[int], m_values: Iterable[float],
               seeds: Iterable[int], base_m: float) -> list[dict]:
    """All (seed, objective, k, m) cells, seed-major so a partial study holds complete seeds first.

    ``m_values`` applies to ``tb`` only; every other objective runs at ``base_m`` (the config's m).
    """
    cells = []
    for seed in seeds:
        for obj in objectives:
            for k in sync_periods:
                for m in (m_values if obj == "tb" else [base_m]):
                    cells.append({"objective": obj, "k": int(k), "m": float(m), "seed": int(seed)})
    return cells


def cell_name(c: dict) -> str:
    return f"{c['objective']}-k{c['k']}-m{c['m']:g}-s{c['seed']}"


def cell_key(rec: dict) -> tuple:
    return (rec["objective"], int(rec["k"]), float(rec["m"]), int(rec["seed"]), int(rec["steps"]), rec.get("setup"))


# -- aggregation and report --------------------------------------------------------------------------

def series_name(objective: str, m: float) -> str:
    """Plot line / table label: tb is split by m, the others are one line each."""
    return f"{objective} m={m:g}" if objective == "tb" else f"{objective} (m={m:g})"


def aggregate(records: list[dict]) -> list[dict]:
    """Group successful records by (objective, k, m, steps, setup) and summarise over seeds.

    Each row: objective, k, m, steps, setup, n_seeds, seeds, acc_mean, acc_min, acc_max, acc_std (sample
    std, 0 for one seed), stderr_mean (mean eval stderr), base_mean, staleness_mean (mean over seeds),
    staleness_max (max over seeds), wall_s (mean train wall time). Rows are sorted by objective order of
    ALL_OBJECTIVES, then m descending, then k.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("error") or r.get("accuracy") is None:
            continue
        key = (r["objective"], int(r["k"]), float(r["m"]), int(r["steps"]), r.get("setup"))
        groups.setdefault(key, []).append(r)
    rows = []
    for (obj, k, m, steps, setup), rs in groups.items():
        # one record per seed (the latest, should a cell have been rerun)
        by_seed = {int(r["seed"]): r for r in rs}
        rs = [by_seed[s] for s in sorted(by_seed)]
        acc = [float(r["accuracy"]) for r in rs]
        base = [float(r["base_accuracy"]) for r in rs if r.get("base_accuracy") is not None]
        errs = [float(r["stderr"]) for r in rs if r.get("stderr") is not None]
        rows.append({
            "objective": obj, "k": k, "m": m, "steps": steps, "setup": setup,
            "n_seeds": len(rs), "seeds": sorted(by_seed),
            "acc_mean": statistics.fmean(acc), "acc_min": min(acc), "acc_max": max(acc),
            "acc_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "stderr_mean": statistics.fmean(errs) if errs else None,
            "base_mean": statistics.fmean(base) if base else None,
            "staleness_mean": statistics.fmean(float(r["staleness_mean"]) for r in rs),
            "staleness_max": max(float(r["staleness_max"]) for r in rs),
            "wall_s": statistics.fmean(float(r["train_wall_s"]) for r in rs),
        })
    order = {o: i for i, o in enumerate(ALL_OBJECTIVES + ("dr_grpo", "ppo_clip"))}
    rows.sort(key=lambda r: (order.get(r["objective"], len(order)), r["objective"], -r["m"], r["k"], r["steps"],
                             str(r["setup"])))
    return rows


def base_accuracy(records: list[dict]) -> float | None:
    """Mean base accuracy over the seeds that measured it (None if no record has one)."""
    per_seed = {}
    for r in records:
        if r.get("base_accuracy") is not None:
            per_seed[(int(r["seed"]), r.get("setup"))] = float(r["base_accuracy"])
    return statistics.fmean(per_seed.values()) if per_seed else None


def format_table(rows: list[dict], base: float | None = None) -> str:
    """Markdown table of :func:`aggregate` rows."""
    multi = len({(r["steps"], r["setup"]) for r in rows}) > 1
    head = ["objective", "k", "m", "accuracy mean (min-max)", "std", "eval stderr", "seeds",
            "staleness mean", "staleness max", "train wall s"]
    if multi:
        head += ["steps", "setup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        err = "n/a" if r["stderr_mean"] is None else f"{r['stderr_mean']:.3f}"
        cells = [r["objective"], str(r["k"]), f"{r['m']:g}",
                 f"{r['acc_mean']:.3f} ({r['acc_min']:.3f}-{r['acc_max']:.3f})", f"{r['acc_std']:.3f}", err,
                 str(r["n_seeds"]), f"{r['staleness_mean']:.2f}", f"{r['staleness_max']:.0f}", f"{r['wall_s']:.0f}"]
        if multi:
            cells += [str(r["steps"]), str(r["setup"])]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if rows:
        steps = sorted({r["steps"] for r in rows})
        notes.append(f"{'/'.join(map(str, steps))} trainer steps per cell; accuracy = final greedy eval accuracy, "
                     "mean over seeds (min-max over seeds); std = sample std over seeds.")
    if base is not None:
        notes.append(f"Base model accuracy (before training): {base:.3f}.")
    if multi:
        notes.append("WARNING: results.jsonl mixes several setups (steps / config / --set); "
                     "compare rows of one setup only.")
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


def plot(rows: list[dict], base: float | None, path: Path) -> Path:
    """Accuracy vs mean staleness, one line per objective (tb split by m), base accuracy dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(series_name(r["objective"], r["m"]), []).append(r)
    markers = "osD^vP*X"
    for i, (name, rs) in enumerate(series.items()):
        rs = sorted(rs, key=lambda r: (r["staleness_mean"], r["k"]))
        x = [r["staleness_mean"] for r in rs]
        y = [r["acc_mean"] for r in rs]
        yerr = [[r["acc_mean"] - r["acc_min"] for r in rs], [r["acc_max"] - r["acc_mean"] for r in rs]]
        ax.errorbar(x, y, yerr=yerr, marker=markers[i % len(markers)], capsize=3, label=name,
                    linestyle=":" if name == "tb m=0.5" else "-")
        for r in rs:
            ax.annotate(f"k={r['k']}", (r["staleness_mean"], r["acc_mean"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    if base is not None:
        ax.axhline(base, color="gray", linestyle="--", linewidth=1, label=f"base model ({base:.3f})")
    ax.set_xlabel("mean staleness of trained samples (trainer steps)")
    ax.set_ylabel("final greedy eval accuracy")
    steps = sorted({r["steps"] for r in rows})
    ax.set_title(f"Accuracy vs staleness ({'/'.join(map(str, steps))} steps per cell; bars: min-max over seeds)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def report(out: Path) -> str:
    """Aggregate ``<out>/results.jsonl`` into ``table.md`` and ``accuracy_vs_staleness.png``; return the table."""
    records = read_results(out / "results.jsonl")
    rows = aggregate(records)
    base = base_accuracy(records)
    table = format_table(rows, base)
    failed = [r for r in records if r.get("error")]
    if failed:
        done = {cell_key(r) for r in records if not r.get("error")}
        still = [r for r in failed if cell_key(r) not in done]
        if still:
            table += "\nFailed cells (not in the table): " + ", ".join(
                f"{cell_name(r)} ({r['error'][:80]})" for r in still) + "\n"
    (out / "table.md").write_text(table)
    if rows:
        plot(rows, base, out / "accuracy_vs_staleness.png")
    return table


# -- running -----------------------------------------------------------------------------------------

def previous_results(results_path: Path, setup: str) -> tuple[list[dict], set[tuple], dict[int, float]]:
    """What ``results.jsonl`` already holds: its records, the keys of the finished cells, and the base
    accuracy per seed measured by a cell of this setup."""
    previous = read_results(results_path)
    done = {cell_key(r) for r in previous if not r.get("error")}
    base_by_seed = {int(r["seed"]): r["base_accuracy"] for r in previous
                    if r.get("setup") == setup and r.get("base_accuracy") is not None and r.get("base_measured")}
    return previous, done, base_by_seed


def cell_overrides(extra: dict, c: dict, steps: int, eval_size: int, run_dir: Path, measure_base: bool) -> dict:
    """The config overrides of one cell: the study's ``extra`` plus the cell's objective, k, m and seed."""
    return {**extra, "loss.name": c["objective"], "trainer.sync_period": c["k"],
            "buffer.on_policy_prob": c["m"], "run.seed": c["seed"], "trainer.max_steps": steps,
            "task.eval_size": eval_size, "run.output_dir": str(run_dir), "run.mode": "async",
            "run.eval_before": measure_base, "run.eval_after": True}


def cell_outcome(s: dict, base: float | None, measure_base: bool) -> dict:
    """The result fields of a finished cell, from ``tba.train``'s summary ``s``."""
    after = s.get("eval_after", {})
    return {
        "accuracy": after.get("accuracy"), "stderr": after.get("stderr"), "n_eval": after.get("n"),
        "base_accuracy": base, "base_measured": measure_base,
        "staleness_mean": s["staleness_mean"], "staleness_max": s["staleness_max"],
        "train_wall_s": s["train_wall_s"], "wall_s": s["wall_s"], "trainer_steps": s["trainer_steps"],
        "samples_generated": s["samples_generated"], "searcher_max_version": s["searcher_max_version"],
    }


def run_cell(args, c: dict, rec: dict, overrides: dict, results_path: Path, base_by_seed: dict[int, float],
             measure_base: bool) -> None:
    """Train one cell and append its record (or its error) to ``results_path``; ``base_by_seed`` gets the
    seed's base accuracy if this cell measured it. KeyboardInterrupt passes through."""
    from tba import train

    try:
        s = train(args.config, overrides=overrides, show_progress=False)
    except Exception as e:  # noqa: BLE001 - record the failure, keep going with the other cells
        err = error_line(e, -1)
        print(f"  cell failed: {err}", file=sys.stderr, flush=True)
        append_result(results_path, {**rec, "error": err})
        return
    if measure_base and "eval_before" in s:
        base_by_seed[c["seed"]] = s["eval_before"].get("accuracy")
    rec.update(cell_outcome(s, base_by_seed.get(c["seed"]), measure_base))
    append_result(results_path, rec)
    print(f"  accuracy {rec['accuracy']:.3f} (base {rec['base_accuracy']}), staleness mean "
          f"{rec['staleness_mean']:.2f} max {rec['staleness_max']:.0f}, train {rec['train_wall_s']:.0f} s",
          flush=True)


def run_study(args) -> int:
    """Run every cell not yet done (with ``--resume-results``), then print and write the report."""
    from tba.config import load_config

    extra = {**BENCH_DEFAULTS, **parse_sets(args.set)}
    base_cfg = load_config(args.config, extra)  # validates --set before any model loads
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    steps = args.steps or base_cfg.trainer.max_steps
    eval_size = args.eval_size or base_cfg.task.eval_size
    setup = setup_id(args.config, steps, eval_size, extra)
    cells = plan_cells(args.objectives, args.sync_periods, args.m_values, args.seeds, base_cfg.buffer.on_policy_prob)

    previous, done, base_by_seed = previous_results(results_path, setup)
    if previous and not args.resume_results:
        print(f"note: {results_path} already has {len(previous)} records; new records are appended "
              "(use --resume-results to skip finished cells)", flush=True)
    print(f"staleness study: {len(cells)} cells, {steps} steps each, eval {eval_size} problems, setup {setup}, "
          f"results -> {results_path}", flush=True)

    t0 = time.monotonic()
    for i, c in enumerate(cells, 1):
        key = (c["objective"], c["k"], c["m"], c["seed"], steps, setup)
        if args.resume_results and key in done:
            print(f"[{i}/{len(cells)}] {cell_name(c)}: already in results, skipped", flush=True)
            continue
        run_dir = out / "runs" / cell_name(c)
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run: metrics.jsonl would otherwise be appended to
        measure_base = c["seed"] not in base_by_seed
        overrides = cell_overrides(extra, c, steps, eval_size, run_dir, measure_base)
        print(f"[{i}/{len(cells)}] {cell_name(c)} (elapsed {time.monotonic() - t0:.0f} s)", flush=True)
        rec: dict[str, Any] = {**c, "steps": steps, "eval_size": eval_size, "setup": setup, "config": args.config,
                               "overrides": {k: v for k, v in extra.items()}, "run_dir": str(run_dir),
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            run_cell(args, c, rec, overrides, results_path, base_by_seed, measure_base)
        except KeyboardInterrupt:
            print("\ninterrupted; finished cells are in results.jsonl (continue with --resume-results)",
                  file=sys.stderr)
            return 130
    print(f"study finished in {time.monotonic() - t0:.0f} s\n", flush=True)
    print(report(out), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring (and benchmarks/README.md) for full commands.")
    p.add_argument("--config", default="configs/quickstart.yaml", help="base config shared by every cell")
    p.add_argument("--steps", type=int, default=None,
                   help="trainer steps per cell (the per-cell budget); default: the config's trainer.max_steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="run.seed values (default: 0 1)")
    p.add_argument("--objectives", nargs="+", default=list(ALL_OBJECTIVES),
                   choices=ALL_OBJECTIVES + ("dr_grpo", "ppo_clip"),
                   help="loss.name values (default: tb rloo grpo online_dpo)")
    p.add_argument("--sync-periods", type=int, nargs="+", default=list(DEFAULT_SYNC_PERIODS),
                   help="trainer.sync_period values k (default: 1 4 16)")
    p.add_argument("--m-values", type=float, nargs="+", default=list(DEFAULT_M_VALUES),
                   help="buffer.on_policy_prob values for tb (default: 0.5 0.95); others use the config's m")
    p.add_argument("--eval-size", type=int, default=None, help="held-out eval problems; default: the config's")
    p.add_argument("--out", default="benchmarks/results/staleness", help="results folder")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every cell, repeatable (e.g. model.num_hidden_layers=2)")
    p.add_argument("--resume-results", action="store_true",
                   help="skip cells already in <out>/results.jsonl (same steps and setup)")
    p.add_argument("--report-only", action="store_true", help="only rebuild table.md and the PNG from results.jsonl")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return study_main(args, run_study, report)


if __name__ == "__main__":
    sys.exit(main())
