"""Recipe sweep: TB's KL coefficient schedule and learning rate chosen by evidence (issue 25, item 3).

The off-policy study found the shipped recipe at sync period 1 the least reliable arm (1 seed in 3 below the
base model) while TB at a constant beta of 0.05 learned on every seed. This study measures which recipe
learns on every seed, and by how much, before the shipped defaults change.

Design
------
Every *cell* trains the same base model on the same task, from the same config, for the same number of
trainer steps, and differs only in its *arm* (:data:`ARMS`), its sync period k (``trainer.sync_period``;
default 1 and the config's) and its seed:

- ``shipped``: the config as it is: by default ``benchmarks/results/recipe_sweep/base_config.yaml``, the
  quickstart as it shipped when this study began (beta annealed 0.012 -> 0.004, lr 2e-5), frozen there
  because a cell's setup fingerprint is the config's text (``_common.setup_id``), so the quickstart's
  defaults can change to the evidence without orphaning the finished cells;
- ``const-B``: beta fixed at B (``trainer.beta_start = beta_end = B``), B in {0.01, 0.02, 0.05, 0.1};
- ``anneal-B``: beta annealed linearly from B to B/3 over the whole run (the shipped schedule's shape);
- ``lr1e-5``, ``lr4e-5``: the shipped recipe at half and twice its learning rate;
- ``lr3e-6`` (not in the screen, so not in the default ``--arms``): the recipe at lr 3e-6, a third of the
  lr shipped since (1e-5), for a headroom task whose rise at 1e-5 ends within 25 steps.

Seeds ``run.seed`` are paired (every arm and k of a seed shares them) and every cell evaluates the same
held-out problems (``task.seed``) every ``run.eval_every`` steps (default here: 10) and after training. A
cell's scores are its final eval and the mean of its last 3 evals (the final one included), which is less
noisy than one eval. The base model's accuracy is measured once (greedy decoding of the unchanged model gives
the same number in every cell of one generation dtype, but not across dtypes: see :func:`gen_dtype`). Screen on
2 seeds, then confirm the survivors on at least 5.

Statistics (``_stats``): per arm, k and generation dtype, the mean of each score over seeds with a 95%
Student-t interval, the gain over the base measured in that dtype with its interval, the smallest gain over
seeds, how many seeds ended above the base, and the standard deviation over seeds; per arm, the paired
difference of both scores from ``shipped``'s (``--versus``) at the same k and dtype; per arm, k and dtype
with at least 5 seeds, issue 25's bar for shipping (:func:`shipping_bar`). Every finished cell is appended to
``<out>/results.jsonl`` (fsync) and its ``metrics.jsonl`` (every step and every eval) kept as
``<out>/curves/<cell>.jsonl.gz`` (``_common.write_jsonl_gz``), so ``--resume`` skips finished cells and a
later analysis can be recomputed. Each record holds the cell's compute, the load average around
it, the generation dtype and the CPU's capability (``torch.backends.cpu.get_cpu_capability``).

Commands (repository root, venv active)
---------------------------------------
Smoke (2-layer model; the numbers mean nothing)::

    python benchmarks/recipe_sweep.py --steps 4 --seeds 0 --arms shipped const-0.05 --sync-periods 1 \\
        --set run.eval_every=2 --set task.eval_size=8 --set model.num_hidden_layers=2 \\
        --set task.train_size=40 --set searcher.max_new_tokens=8 --set buffer.min_fill=16 --out /tmp/sweep

The screen (2 CPU cores: about 6 minutes a cell; 11 arms x 2 sync periods x 2 seeds)::

    python benchmarks/recipe_sweep.py --seeds 0 1 --resume --out benchmarks/results/recipe_sweep

``--report-only`` rebuilds ``table.md`` from ``results.jsonl``; ``--merge DIR...`` adds other sweeps' cells of
the same config and steps (:func:`merge_records`). ``--spread-ref DIR`` takes the bar's spread
reference (``const-0.05``) from another sweep's results, e.g. beta arms run with ``--set trainer.lr=...`` in a
directory of their own.
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
    read_jsonl_gz,
    read_results,
    setup_id,
    start_study,
    study_main,
    study_parser,
    write_jsonl_gz,
)
from _stats import mean_ci, paired_difference_ci, sd_ratio_ci

BETAS = (0.01, 0.02, 0.05, 0.1)
#: arm name -> its config overrides; an anneal's length is the run's (filled in by :func:`cell_overrides`)
ARMS: dict[str, dict[str, Any]] = {
    "shipped": {},
    **{f"const-{b}": {"trainer.beta_start": b, "trainer.beta_end": b} for b in BETAS},
    **{f"anneal-{b}": {"trainer.beta_start": b, "trainer.beta_end": b / 3, "trainer.beta_anneal_steps": None}
       for b in BETAS},
    "lr1e-5": {"trainer.lr": 1e-5},
    "lr4e-5": {"trainer.lr": 4e-5},
    "lr3e-6": {"trainer.lr": 3e-6},
}
SCREEN = [a for a in ARMS if a != "lr3e-6"]  #: the default --arms: the quickstart screen's
#: what every cell sets (no final model, TensorBoard or checkpoints: the study keeps the curves)
BENCH_DEFAULTS = {"trainer.save_final": False, "run.tensorboard": False, "run.checkpoint_every": 0,
                  "run.eval_every": 10}
LAST = 3  # evals averaged in a cell's last-evals score
#: issue 25's bar for a shipped recipe: measured on at least this many seeds, its spread against this arm's
MIN_SEEDS, SPREAD_ARM = 5, "const-0.05"


def plan_cells(seeds: list[int], arms: list[str], sync_periods: list[int]) -> list[dict]:
    """Every cell, seed-major, then sync period, then arm: ``{"arm", "k", "seed"}``."""
    return [{"arm": a, "k": k, "seed": s} for s in seeds for k in sync_periods for a in arms]


def cell_name(c: dict) -> str:
    return f"{c['arm']}-k{c['k']}-s{c['seed']}"


def cell_key(rec: dict) -> tuple:
    return rec["arm"], int(rec["k"]), int(rec["seed"]), rec.get("setup")


def cell_overrides(extra: dict, c: dict, steps: int, run_dir: Path, measure_base: bool) -> dict:
    """Config overrides of one cell: the study's ``extra``, then the arm's (an anneal over ``steps``), then
    the cell's own."""
    arm = {k: (steps if v is None else v) for k, v in ARMS[c["arm"]].items()}
    return {**extra, **arm, "trainer.sync_period": c["k"], "run.seed": c["seed"], "trainer.max_steps": steps,
            "run.output_dir": str(run_dir), "run.eval_before": measure_base, "run.eval_after": True}


def eval_points(metrics_path: Path, after: dict, last_step: int) -> list[tuple[int, float]]:
    """(step, accuracy) of every eval during training (``eval/accuracy`` records of ``metrics.jsonl``) and of
    the eval after it (``after``, at ``last_step``; it replaces an eval logged at that same step)."""
    from tba.logger import eval_series

    series = eval_series(read_results(metrics_path), after=after, last_step=last_step)
    if series is None:
        return []
    points = {step: value for step, value, _ in series[1]}  # the eval after training is last: it wins its step
    return sorted(points.items())


def last_mean(points: list[tuple[int, float]], n: int = LAST) -> float | None:
    """Mean accuracy of the last ``n`` evals (fewer when fewer ran; None without any)."""
    tail = [v for _, v in points[-n:]]
    return sum(tail) / len(tail) if tail else None


def late_gain(points: list[tuple[int, float]], steps: int, n: int = LAST) -> float | None:
    """Whether a cell was still improving after its first third: the mean of its last ``n`` evals minus the
    mean of its evals at steps ``<= steps // 3`` (issue 25's "keeps improving"; None without evals in both)."""
    early = [v for s, v in points if s <= steps // 3]
    last = last_mean(points, n)
    return None if not early or last is None else last - sum(early) / len(early)


def latest_by_cell(records: list[dict]) -> dict[tuple, dict]:
    """Successful records keyed by (arm, k, seed, setup); a rerun cell counts once (the latest)."""
    return {cell_key(r): r for r in records if not r.get("error") and r.get("accuracy") is not None}


ROOT = Path(__file__).resolve().parents[1]  # committed records hold paths relative to the repository root
#: the config sections a merged sweep may set differently (:func:`merge_records`): the others (model, task,
#: searcher) change what the base model scores, so the cells would share no base
MERGEABLE = ("trainer.", "buffer.", "loss.", "run.")


def _path(p: str) -> Path:
    """A recorded path: as given where it exists (relative to the working directory), else under :data:`ROOT`."""
    path = Path(p)
    return path if path.exists() or path.is_absolute() else ROOT / path


def gen_dtype(rec: dict) -> str:
    """The dtype a cell's searchers and evals generated in: its record's ``gen_dtype`` (recorded since 2026-12-07),
    else read off its committed curve: with ``model.dtype: auto`` a CPU with AVX512/AMX generates in bfloat16
    against the float32 trainer, so the sync check's ``sync/logprob_gap`` is bfloat16 rounding (median above
    1e-3) there and exactly 0 in float32; ``"unrecorded"`` without either. Cells of different dtypes are not
    paired evidence: the base model alone scores differently in the two (benchmarks/README.md, headroom caveat)."""
    import statistics

    if rec.get("gen_dtype"):
        return rec["gen_dtype"]
    curve = _path(rec["curve"]) if rec.get("curve") else None
    if curve is None or not curve.is_file():
        return "unrecorded"
    gaps = [m["sync/logprob_gap"] for m in read_jsonl_gz(curve) if "sync/logprob_gap" in m]
    if not gaps:
        return "unrecorded"
    return "bfloat16" if statistics.median(gaps) > 1e-3 else "float32"


def bases(records: list[dict]) -> dict[str, float]:
    """Generation dtype -> the base model's accuracy measured in it (the first cell's that measured one)."""
    out: dict[str, float] = {}
    for r in records:
        if r.get("base_measured"):
            out.setdefault(gen_dtype(r), r["base_accuracy"])
    return out


def base_arm(arm: str) -> str:
    """The :data:`ARMS` name of an arm, also of one renamed by :func:`merge_records` (``ARM [key=value]``)."""
    return arm.split(" [")[0]


#: a cell's own overrides (:func:`cell_overrides`); with the arm's, what :func:`settings` leaves out
CELL_KEYS = set(cell_overrides({}, {"arm": "shipped", "k": 1, "seed": 0}, 1, Path(), False))


def settings(rec: dict) -> dict:
    """What a cell's sweep set for all its cells (``--set`` and the bench defaults): its overrides less the arm's,
    the cell's own and ``model.dtype`` (its effect is the cell's :func:`gen_dtype`, a column of its own)."""
    arm = ARMS.get(base_arm(rec["arm"]), {})
    return {k: v for k, v in rec.get("overrides", {}).items()
            if k not in arm and k not in CELL_KEYS and k != "model.dtype"}


def other_dtype_note(previous: list[dict], setup: str, dtype: str) -> str | None:
    """A line for a resumed sweep whose finished cells of ``setup`` generated in another dtype than this machine's
    ``dtype`` (they are kept, and the new cells go to rows of their own: :func:`aggregate`); None when none did."""
    done = {gen_dtype(r) for r in latest_by_cell(previous).values() if r.get("setup") == setup}
    other = sorted(done - {dtype, "unrecorded"})
    if not other:
        return None
    return (f"note: finished cells generated in {', '.join(other)}, this machine generates in {dtype}; they are "
            "kept and reported in rows of their own (--set model.dtype=... to match them)")


def merge_records(records: list[dict], others: dict[str, list[dict]]) -> list[dict]:
    """One sweep's ``records`` and other sweeps' (``others``: where -> records) in one list, for one report.
    Where another sweep's :func:`settings` differ from this one's (the union over its cells), its arms are
    renamed ``ARM [key=value, ...]`` (the differing settings; ``default`` where it left one unset), so cells of
    different recipes share no row and no pair. Raises SystemExit naming the other sweep if it ran another
    config or number of steps, set a section outside :data:`MERGEABLE` differently (another task, model or
    searcher: another base), or ran a cell (arm, k, seed, generation dtype) that the list already has."""
    def shared(rs: list[dict]) -> set:
        return {(str(_path(r["config"]).resolve()), r["steps"]) for r in rs if "config" in r and "steps" in r}

    mine = {k: v for r in records for k, v in settings(r).items()}
    out = list(records)
    for where, other in others.items():
        if shared(other) - shared(records):
            raise SystemExit(f"--merge {where}: its cells ran (config, steps) {sorted(shared(other), key=str)}, "
                             f"this sweep's {sorted(shared(records), key=str)}; merge sweeps of the same config and "
                             "steps")
        seen = {(r["arm"], r["k"], r["seed"], gen_dtype(r)) for r in latest_by_cell(out).values()}
        for r in other:
            own = ARMS.get(base_arm(r["arm"]), {})
            diff = {k: v for k, v in settings(r).items() if mine.get(k) != v}
            diff.update({k: "default" for k in mine if k not in settings(r) and k not in own})
            if bad := sorted(k for k in diff if not k.startswith(MERGEABLE)):
                raise SystemExit(f"--merge {where}: it sets {', '.join(bad)} differently (another base model "
                                 f"score); merge sweeps that differ in {', '.join(MERGEABLE)} settings only")
            r = dict(r, arm=r["arm"] + (" [" + ", ".join(f"{k}={v}" for k, v in sorted(diff.items())) + "]"
                                        if diff else ""))
            if (r["arm"], r["k"], r["seed"], gen_dtype(r)) in seen and r.get("accuracy") is not None:
                raise SystemExit(f"--merge {where}: cell {cell_name(r)} in {gen_dtype(r)} is in both sweeps (a row "
                                 "would count its seed twice)")
            out.append(r)
    return out


def _order(arm: str) -> tuple:
    """Rows in :data:`ARMS` order; arms renamed by :func:`merge_records` after their own arm."""
    order = list(ARMS)
    return (order.index(base_arm(arm)) if base_arm(arm) in order else len(order), arm)


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (arm, k, generation dtype), in :data:`ARMS` order, then k, then dtype: ``final`` and
    ``last`` (mean_ci over seeds), ``gain`` (final minus the base measured in the row's dtype: mean_ci; None
    without one), ``min_gain``, ``above`` (seeds with final > base; None without a base), ``sd`` (sample
    standard deviation of the final accuracy over seeds; NaN for one seed), ``late`` (:func:`late_gain` over
    the seeds that have it: mean_ci, or None), ``seeds``, ``train_s`` (median train seconds) and ``dtype``
    (:func:`gen_dtype`). Cells of different dtypes never share a row: the base model alone scores differently
    in them (:func:`gen_dtype`)."""
    import statistics

    base_of = bases(records)
    cells: dict[tuple, list[dict]] = {}
    for (arm, k, _, _), r in sorted(latest_by_cell(records).items(), key=lambda kv: kv[0][2]):
        cells.setdefault((arm, k, gen_dtype(r)), []).append(r)
    rows = []
    for (arm, k, dtype), rs in sorted(cells.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1], kv[0][2])):
        finals = [r["accuracy"] for r in rs]
        base = base_of.get(dtype)
        gains = [f - base for f in finals] if base is not None else []
        lates = [g for g in (late_gain([tuple(p) for p in r["evals"]], r["steps"]) for r in rs if r.get("evals"))
                 if g is not None]
        rows.append({"arm": arm, "k": k, "seeds": [r["seed"] for r in rs], "final": mean_ci(finals),
                     "last": mean_ci([r["last_mean"] for r in rs]), "gain": mean_ci(gains) if gains else None,
                     "min_gain": min(gains) if gains else None,
                     "above": sum(g > 0 for g in gains) if gains else None,
                     "sd": statistics.stdev(finals) if len(finals) > 1 else float("nan"),
                     "late": mean_ci(lates) if lates else None,
                     "train_s": statistics.median(r["train_wall_s"] for r in rs), "dtype": dtype})
    return rows


def versus(records: list[dict], ref: str = "shipped") -> list[dict]:
    """Per (arm, k, generation dtype) other than the ``ref`` arm's: the paired differences (arm minus ``ref``)
    over the seeds both ran at that k in that dtype, of the final eval (``final``) and of the last-evals score
    (``last``), each a :func:`_stats.paired_difference_ci`. Rows without a partner seed are left out."""
    cells = latest_by_cell(records)
    partner = {(k, s, gen_dtype(r)): r for (a, k, s, _), r in cells.items() if a == ref}
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for (arm, k, s, _), r in sorted(cells.items(), key=lambda kv: kv[0][2]):
        dtype = gen_dtype(r)
        if arm != ref and (k, s, dtype) in partner:
            groups.setdefault((arm, k, dtype), []).append((r, partner[(k, s, dtype)]))
    return [{"arm": arm, "k": k, "dtype": dtype, "seeds": [r["seed"] for r, _ in pairs],
             "final": paired_difference_ci([r["accuracy"] for r, _ in pairs], [p["accuracy"] for _, p in pairs]),
             "last": paired_difference_ci([r["last_mean"] for r, _ in pairs], [p["last_mean"] for _, p in pairs])}
            for (arm, k, dtype), pairs in sorted(groups.items(), key=lambda kv: (_order(kv[0][0]), *kv[0][1:]))]


def shipping_bar(rows: list[dict], ref_rows: list[dict] | None = None) -> list[dict]:
    """Issue 25's bar for a recipe to ship, from :func:`aggregate`'s ``rows``, per arm, k and dtype measured on at
    least :data:`MIN_SEEDS` seeds: every seed's final eval above the base (``all_above``), the 95% lower bound
    of the mean gain above 0 (``low_above_0``), and the spread over seeds (sample sd of the final eval) no
    larger than :data:`SPREAD_ARM`'s at the same k and generation dtype (``spread_ok``; None while that arm has
    fewer seeds there). The reference comes from ``ref_rows`` (another sweep's :func:`aggregate`, e.g. the beta
    arms run at a changed lr in their own directory) where given, else from ``rows``. ``meets``: False if any
    check fails, None if none fails but one is undecided, else True. ``sd_ratio``: this sd over the reference's
    with its 95% F interval (:func:`sd_ratio_ci`, seeds taken as independent), None without a reference."""
    judged = [r for r in rows if len(r["seeds"]) >= MIN_SEEDS and r["gain"] is not None]
    refs = [r for r in (rows if ref_rows is None else ref_rows) if len(r["seeds"]) >= MIN_SEEDS]
    # (k, dtype) -> (sd, seeds): spreads compare within one sync period and one generation dtype
    ref_spread = {(r["k"], r["dtype"]): (r["sd"], len(r["seeds"])) for r in refs if r["arm"] == SPREAD_ARM}
    out = []
    for r in judged:
        ref = ref_spread.get((r["k"], r["dtype"]))
        spread_ok = None if ref is None else r["sd"] <= ref[0]
        checks = {"all_above": r["above"] == len(r["seeds"]), "low_above_0": r["gain"]["low"] > 0,
                  "spread_ok": spread_ok}
        meets = False if False in checks.values() else None if None in checks.values() else True
        out.append({"arm": r["arm"], "k": r["k"], "dtype": r["dtype"], "seeds": len(r["seeds"]), **checks,
                    "meets": meets,
                    "sd_ratio": None if ref is None else sd_ratio_ci(r["sd"], len(r["seeds"]), *ref)})
    return out


def _ci(x: dict | None) -> str:
    if x is None:
        return "n/a"
    if x["low"] != x["low"]:  # NaN: one seed
        return f"{x['mean']:.3f} (n={x['n']})"
    return f"{x['mean']:.3f} [{x['low']:.3f}, {x['high']:.3f}] (n={x['n']})"


def _ratio(x: dict | None) -> str:
    if x is None:
        return "n/a"
    return f"{x['mean']:.2f} [{x['low']:.2f}, {x['high']:.2f}]"


def format_report(records: list[dict], ref_records: list[dict] | None = None, ref_arm: str = "shipped") -> str:
    """Markdown: the cells (scores, gain over the base, reliability; one row per arm, k and generation dtype),
    each arm against ``ref_arm`` (:func:`versus`), then :func:`shipping_bar` (its spread reference from
    ``ref_records`` where given)."""
    head = ["arm", "k", "final [95% CI]", f"last {LAST} evals [95% CI]", "gain over base [95% CI]", "smallest gain",
            "seeds above base", "sd over seeds", f"last {LAST} minus first third's evals [95% CI]",
            "train s / cell", "generation dtype"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = aggregate(records)
    for r in rows:
        lines.append("| " + " | ".join([
            r["arm"], str(r["k"]), _ci(r["final"]), _ci(r["last"]), _ci(r["gain"]),
            "n/a" if r["min_gain"] is None else f"{r['min_gain']:+.3f}",
            "n/a" if r["above"] is None else f"{r['above']}/{len(r['seeds'])}",
            f"{r['sd']:.3f}", _ci(r["late"]), f"{r['train_s']:.0f}", r["dtype"]]) + " |")
    vs = versus(records, ref_arm)
    if ref_arm != "shipped" and not any(r["arm"] == ref_arm for r in rows):
        lines += ["", f"No cells of {ref_arm} (--versus): nothing is paired."]
    if vs:
        lines += ["", f"Paired by seed, within a sync period and a generation dtype: each arm minus {ref_arm}.", "",
                  f"| arm | k | generation dtype | seeds | final minus {ref_arm}'s [95% CI] | last {LAST} evals minus "
                  f"{ref_arm}'s [95% CI] |", "|" + "---|" * 6]
        lines += [f"| {v['arm']} | {v['k']} | {v['dtype']} | {' '.join(map(str, v['seeds']))} | {_ci(v['final'])} | "
                  f"{_ci(v['last'])} |" for v in vs]
    bar = shipping_bar(rows, None if ref_records is None else aggregate(ref_records))
    if bar:
        yes = {True: "yes", False: "no", None: "n/a"}
        ref = "" if ref_records is None else " in the --spread-ref sweep"
        lines += ["", f"The bar to ship (issue 25), arms with at least {MIN_SEEDS} seeds: every seed ends above the "
                  f"base, the gain's 95% lower bound is above 0, the spread over seeds is no larger than "
                  f"{SPREAD_ARM}'s{ref} at the same k and dtype (n/a: that arm has fewer than {MIN_SEEDS} seeds "
                  "there). The sd ratio's interval is Fisher's F, taking the two arms' seeds as independent.", "",
                  "| arm | k | generation dtype | seeds | every seed above base | gain's lower bound > 0 | sd <= "
                  f"{SPREAD_ARM}'s | meets the bar | sd / {SPREAD_ARM}'s [95% CI] |", "|" + "---|" * 9]
        lines += [f"| {b['arm']} | {b['k']} | {b['dtype']} | {b['seeds']} | {yes[b['all_above']]} | "
                  f"{yes[b['low_above_0']]} | {yes[b['spread_ok']]} | {yes[b['meets']]} | {_ratio(b['sd_ratio'])} |"
                  for b in bar]
    notes = ["Accuracy: greedy, on the same held-out problems in every cell; intervals are 95% Student-t over "
             "paired seeds."]
    base_of = bases(records)
    if base_of:
        notes.append("Base model (before training): " + ", ".join(
            f"{b:.3f}" + ("" if d == "unrecorded" else f" in {d}") for d, b in sorted(base_of.items())) + ".")
    if len({r["dtype"] for r in rows}) > 1:
        notes.append("Generation dtypes differ between cells (bfloat16 on CPUs with AVX512/AMX under model.dtype "
                     "auto, else float32), and the base model alone scores differently in them: each row holds one "
                     "dtype, its gain is taken against the base measured in that dtype (n/a without one), and "
                     "seeds are paired within a dtype only.")
    failed = [r for r in records if r.get("error") and cell_key(r) not in latest_by_cell(records)]
    if failed:
        notes.append("Failed cells (not in the tables): " + ", ".join(
            f"{cell_name(r)} ({r['error'][:80]})" for r in failed))
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def with_dtypes(records: list[dict]) -> list[dict]:
    """``records``, each with its :func:`gen_dtype` filled in, so that each old cell's curve is read once."""
    return [dict(r, gen_dtype=gen_dtype(r)) for r in records]


def report(out: Path, spread_ref: Path | None = None, merge: tuple[Path, ...] = (), ref_arm: str = "shipped") -> str:
    """Write ``table.md`` from ``<out>/results.jsonl`` and the ``results.jsonl`` of each sweep in ``merge``
    (:func:`merge_records`; same config and steps), the bar's spread reference from
    ``<spread_ref>/results.jsonl`` where given, each arm paired against ``ref_arm``; return it."""
    def read(d: Path) -> list[dict]:
        return with_dtypes(read_results(Path(d) / "results.jsonl"))

    records = merge_records(read(out), {str(d): read(d) for d in merge})
    ref = None if spread_ref is None else read(spread_ref)
    table = format_report(records, ref, ref_arm)
    (out / "table.md").write_text(table)
    return table


def run_cell(args, rec: dict, overrides: dict, out: Path) -> dict:
    """Train one cell; append its record (or its error) to ``results.jsonl`` and its metrics to ``curves/``.
    KeyboardInterrupt passes through."""
    from tba import train

    t0 = time.monotonic()
    rec["load_before"] = os.getloadavg()[0]
    try:
        s = train(args.config, overrides=overrides, show_progress=False)
    except Exception as e:  # noqa: BLE001 - record the failure, go on with the other cells
        rec["error"] = error_line(e, -1)
        print(f"  cell failed: {rec['error']}", file=sys.stderr, flush=True)
        append_result(out / "results.jsonl", rec)
        return rec
    run_dir = Path(rec["run_dir"])
    after = s.get("eval_after", {})
    points = eval_points(run_dir / "metrics.jsonl", after, s["trainer_steps"])
    curve = out / "curves" / f"{cell_name(rec)}.jsonl.gz"
    write_jsonl_gz(curve, read_results(run_dir / "metrics.jsonl"))
    rec.update({"accuracy": after.get("accuracy"), "stderr": after.get("stderr"), "n_eval": after.get("n"),
                "last_mean": last_mean(points), "evals": points, "train_wall_s": s["train_wall_s"],
                "wall_s": time.monotonic() - t0, "trainer_steps": s["trainer_steps"], "curve": str(curve),
                "load_after": os.getloadavg()[0]})
    if "eval_before" in s:
        rec["base_accuracy"], rec["base_measured"] = s["eval_before"].get("accuracy"), True
    append_result(out / "results.jsonl", rec)
    print(f"  final {rec['accuracy']:.3f}, last {LAST} evals {rec['last_mean']:.3f}, "
          f"train {rec['train_wall_s']:.0f} s", flush=True)
    return rec


def run_study(args) -> int:
    """Run every planned cell not yet in ``results.jsonl`` (with ``--resume``), then write the report."""
    import torch

    from tba.models import pick_dtype

    extra, base_cfg, out, previous = start_study(args, BENCH_DEFAULTS)
    previous = with_dtypes(previous)
    steps = args.steps or base_cfg.trainer.max_steps
    setup = setup_id(args.config, steps, base_cfg.task.eval_size, extra)
    sync_periods = args.sync_periods or sorted({1, base_cfg.trainer.sync_period})
    cells = plan_cells(args.seeds, args.arms, sync_periods)
    dtype = str(pick_dtype(base_cfg.model.dtype)).removeprefix("torch.")  # what this machine generates in
    done = {k for k in latest_by_cell(previous) if k[-1] == setup}
    # the base model is measured once per generation dtype: it scores differently in bfloat16 and float32
    base_done = any(r.get("base_measured") and r.get("setup") == setup and gen_dtype(r) == dtype for r in previous)
    print(f"recipe sweep: {len(cells)} cells ({len(done)} done), {steps} steps each, setup {setup}", flush=True)
    if note := other_dtype_note(previous, setup, dtype):
        print(note, flush=True)
    t0 = time.monotonic()
    for i, c in enumerate(cells, 1):
        if (c["arm"], c["k"], c["seed"], setup) in done:
            continue
        run_dir = out / "runs" / cell_name(c)
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run: metrics.jsonl would otherwise be appended to
        print(f"[{i}/{len(cells)}] {cell_name(c)} (elapsed {time.monotonic() - t0:.0f} s)", flush=True)
        overrides = cell_overrides(extra, c, steps, run_dir, measure_base=not base_done)
        rec: dict[str, Any] = {**c, "steps": steps, "setup": setup, "config": args.config, "overrides": overrides,
                               "run_dir": str(run_dir), "cpus": os.cpu_count(), "gen_dtype": dtype,
                               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            rec = run_cell(args, rec, overrides, out)
        except KeyboardInterrupt:
            print("\ninterrupted; finished cells are in results.jsonl (continue with --resume)", file=sys.stderr)
            return 130
        base_done = base_done or bool(rec.get("base_measured"))
        report(out, args.spread_ref, args.merge, args.versus)
    print(f"sweep finished in {time.monotonic() - t0:.0f} s\n", flush=True)
    print(report(out, args.spread_ref, args.merge, args.versus), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = study_parser(__doc__, "benchmarks/results/recipe_sweep/base_config.yaml", [0, 1],
                     "benchmarks/results/recipe_sweep")
    p.add_argument("--arms", nargs="+", default=SCREEN, choices=list(ARMS), help="arms (default: the screen's)")
    p.add_argument("--sync-periods", type=int, nargs="+", default=None,
                   help="sync periods k; default: 1 and the config's")
    p.add_argument("--spread-ref", type=Path, default=None, metavar="DIR",
                   help=f"judge the shipping bar's spread against {SPREAD_ARM} in this sweep's results "
                        "(default: this one's)")
    p.add_argument("--merge", type=Path, nargs="+", default=[], metavar="DIR",
                   help="report these sweeps' cells too (same config and steps; arms whose --set differs are "
                        "renamed 'ARM [key=value]')")
    p.add_argument("--versus", default="shipped", metavar="ARM",
                   help="the arm every other is paired against (default: shipped)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return study_main(args, run_study, lambda out: report(out, args.spread_ref, args.merge, args.versus))


if __name__ == "__main__":
    sys.exit(main())
