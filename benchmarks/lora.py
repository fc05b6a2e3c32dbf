"""LoRA against full fine-tuning on the quickstart: resources side by side, and learning over paired seeds.

``resources``: for each arm (full weights; a LoRA adapter of rank r), a trainer process and a searcher
process are started one after the other, each on ``--threads`` threads with the quickstart's model:

- trainer: median seconds of a trainer step (B x K responses of ``--response-len`` random tokens; the
  cost does not depend on what they say), bytes and median seconds of packing a publication, peak RSS;
- searcher: median seconds of loading that publication into its engine, one generation batch of the
  quickstart's size, peak RSS (the engine's policy plus its reference: a second copy with full weights,
  the engine's own base with LoRA).

Ratios LoRA / full come from the same run. ``learning``: the quickstart (60 steps, 200 held-out problems)
for each arm and paired seed, a resumable study whose cells append to ``results.jsonl`` and keep each
run's ``metrics.jsonl`` and ``summary.json``; the report gives each arm's gain (after - before) with its
95% t-interval over seeds and the paired difference of the gains, LoRA - full.

    python benchmarks/lora.py resources --rank 16 --out benchmarks/results/lora/resources.json
    python benchmarks/lora.py learning --arms full lora:16:2e-4 --seeds 0 1 2 --resume \
        --out benchmarks/results/lora
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_study_options,
    append_result,
    command_line,
    error_line,
    peak_rss_mib,
    read_results,
    setup_id,
    start_study,
    study_main,
    write_json,
)
from _stats import mean_ci, paired_difference_ci  # noqa: E402

CONFIG = "configs/quickstart.yaml"


# -- resources --------------------------------------------------------------------------------------

def _cfg(rank: int | None, threads: int, extra: dict | None = None):
    from tba.config import load_config

    over = {"trainer.threads": threads, "searcher.threads": threads, **(extra or {})}
    if rank:
        over["model.lora.r"] = rank
    return load_config(CONFIG, over)


def _trainer_role(rank, threads, response_len, repeats, pack_file, queue) -> None:
    """Child process: trainer step and publication figures, then the pack for the searcher role."""
    import numpy as np
    import torch

    from tba.models import prepare_model
    from tba.runtime.build import build_trainer, generation_dtype
    from tba.types import Batch, Sample

    cfg = _cfg(rank, threads)
    path = prepare_model(cfg.model.policy)
    trainer, tok = build_trainer(cfg, path, path)
    g = torch.Generator().manual_seed(0)
    prompt = tok("What is 12 + 7?\nAnswer with just the number.")["input_ids"]
    k = cfg.trainer.group_size
    samples = [Sample(i // k, prompt, torch.randint(10, 2000, (response_len,), generator=g).tolist(), float(i % 2),
                      [-1.0] * response_len, [-1.0] * response_len, 0) for i in range(cfg.trainer.prompts_per_step * k)]
    batch = Batch(samples, k)
    step_s = []
    for _ in range(repeats + 1):  # the first step warms up (allocator, lazy inits) and is dropped
        t0 = time.perf_counter()
        trainer.step(batch)
        step_s.append(time.perf_counter() - t0)
    pack_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        packed = trainer.publish_weights(generation_dtype(cfg))
        pack_s.append(time.perf_counter() - t0)
    np.save(pack_file, packed.data)
    Path(f"{pack_file}.json").write_text(json.dumps({"entries": packed.entries, "adapter": packed.adapter}))
    queue.put({"train_step_s": statistics.median(step_s[1:]), "publish_bytes": int(packed.data.nbytes),
               "pack_s": statistics.median(pack_s), "trainer_params_trained": sum(p.numel() for p in trainer.params),
               "trainer_peak_rss_mib": peak_rss_mib()})


def _searcher_role(rank, threads, repeats, pack_file, queue) -> None:
    """Child process: load the trainer's pack into a searcher, generate one batch, peak RSS."""
    import numpy as np

    from tba.models import prepare_model
    from tba.runtime.build import build_searcher
    from tba.types import PackedWeights

    cfg = _cfg(rank, threads)
    path = prepare_model(cfg.model.policy)
    searcher = build_searcher(cfg, path, path, 0)
    meta = json.loads(Path(f"{pack_file}.json").read_text())
    packed = PackedWeights([tuple(e) for e in meta["entries"]], np.load(f"{pack_file}.npy"), meta["adapter"])
    load_s = []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        searcher.load_weights(v, packed)
        load_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    samples, metrics = searcher.step()
    queue.put({"load_s": statistics.median(load_s), "generate_batch_s": time.perf_counter() - t0,
               "gen_tokens_per_s": metrics["searcher/gen_tokens_per_s"], "searcher_peak_rss_mib": peak_rss_mib()})


def _in_child(target, *args) -> dict:
    ctx = mp.get_context("spawn")  # a fresh interpreter: each role's peak RSS is its own
    queue = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, queue))
    p.start()
    out = queue.get(timeout=1800)
    p.join()
    return out


def resources(args) -> int:
    """Measure both arms and print the figures with the ratios LoRA / full."""
    load = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, rank in (("full", None), (f"lora r={args.rank}", args.rank)):
            pack = str(Path(tmp) / arm.replace(" ", "_").replace("=", ""))
            rows[arm] = {**_in_child(_trainer_role, rank, args.threads, args.response_len, args.repeats, pack),
                         **_in_child(_searcher_role, rank, args.threads, args.repeats, pack)}
            print(arm, json.dumps({k: round(v, 4) for k, v in rows[arm].items()}), flush=True)
    full, lora = rows["full"], rows[f"lora r={args.rank}"]
    ratios = {k: lora[k] / full[k] for k in full if full[k]}
    result = {"command": command_line(sys.argv[1:]), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "loadavg_before": load, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(), "rows": rows,
              "ratio_lora_over_full": ratios, "threads": args.threads, "response_len": args.response_len,
              "repeats": args.repeats}
    print("ratios LoRA / full:", json.dumps({k: round(v, 4) for k, v in ratios.items()}))
    print(f"load average before/after: {load} / {result['loadavg_after']}")
    if args.out:
        write_json(Path(args.out), result)
    return 0


# -- learning ---------------------------------------------------------------------------------------

def arm_overrides(arm: str) -> dict[str, Any]:
    """``full`` -> {} (the quickstart as it is); ``lora:R:LR`` -> rank R at learning rate LR.

    Raises:
        ValueError: another form.
    """
    if arm == "full":
        return {}
    kind, _, rest = arm.partition(":")
    rank, _, lr = rest.partition(":")
    if kind != "lora" or not rank.isdigit() or not lr:
        raise ValueError(f"arm '{arm}': use 'full' or 'lora:RANK:LR' (e.g. lora:16:2e-4)")
    return {"model.lora.r": int(rank), "trainer.lr": float(lr)}


def _arm(text: str) -> str:
    try:
        arm_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def report(out: Path) -> str:
    """Write ``table.md`` from ``<out>/results.jsonl``: every cell, each arm's mean gain with its 95%
    interval over seeds, and each LoRA arm's paired difference of gains against ``full``."""
    records = [r for r in read_results(out / "results.jsonl") if "error" not in r]
    by_arm: dict[str, dict[int, dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r  # the newest record of a cell wins
    lines = ["| arm | seed | before | after | gain | train wall s | load avg |", "|---|---|---|---|---|---|---|"]
    for arm, cells in by_arm.items():
        for seed, r in sorted(cells.items()):
            lines.append(f"| {arm} | {seed} | {r['before']:.3f} | {r['after']:.3f} | {r['after'] - r['before']:+.3f} | "
                         f"{r['train_wall_s']:.0f} | {r['loadavg'][0]:.2f} |")
    lines += ["", "| arm | seeds | mean gain [95% CI] | paired gain - full's [95% CI] |", "|---|---|---|---|"]
    full = by_arm.get("full", {})
    for arm, cells in by_arm.items():
        gains = {s: r["after"] - r["before"] for s, r in cells.items()}
        g = mean_ci(list(gains.values()))
        paired = "-"
        shared = sorted(set(gains) & set(full))
        if arm != "full" and len(shared) >= 2:
            d = paired_difference_ci([gains[s] for s in shared], [full[s]["after"] - full[s]["before"] for s in shared])
            paired = f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] (seeds {shared})"
        lines.append(f"| {arm} | {sorted(gains)} | {g['mean']:+.3f} [{g['low']:+.3f}, {g['high']:+.3f}] | {paired} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def learning(args) -> int:
    """Run every (arm, seed) cell not yet in ``results.jsonl``, one at a time (``--lock``), then report."""
    from tba import train

    extra, _, out, previous = start_study(args, {})
    setup = setup_id(args.config, 0, 0, extra)  # a resumed study skips only cells of the same config and --set
    done = {(r["arm"], r["seed"]) for r in previous if "error" not in r and r.get("setup", setup) == setup}
    for seed in args.seeds:  # seed-major: a stopped study leaves complete pairs
        for arm in args.arms:
            if (arm, seed) in done:
                continue
            run_dir = out / "runs" / f"{arm.replace(':', '-')}-s{seed}"
            overrides = {**extra, **arm_overrides(arm), "run.seed": seed, "run.output_dir": str(run_dir)}
            print(f"{arm} seed {seed} -> {run_dir}", flush=True)
            with open(args.lock, "w") if args.lock else nullcontext() as lock:
                if lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # one heavy job at a time on a shared machine
                rec = {"arm": arm, "seed": seed, "setup": setup, "overrides": overrides, "loadavg": os.getloadavg(),
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "run_dir": str(run_dir)}
                try:
                    s = train(args.config, overrides=overrides, show_progress=False)
                    rec.update({"before": s["eval_before"]["accuracy"], "after": s["eval_after"]["accuracy"],
                                "train_wall_s": s["train_wall_s"], "loadavg_after": os.getloadavg()})
                except Exception as e:  # noqa: BLE001 - record the failure, go on with the other cells
                    rec["error"] = error_line(e, -1)
            append_result(out / "results.jsonl", rec)
            print("  " + (rec.get("error") or f"{rec['before']:.3f} -> {rec['after']:.3f}"), flush=True)
            report(out)
    print(report(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("resources", help="memory, publication and step time, full vs LoRA, side by side")
    r.add_argument("--rank", type=int, default=16)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--response-len", type=int, default=32)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--out", default=None, help="JSON file for the figures")
    learn = sub.add_parser("learning", help="quickstart gains over paired seeds, full vs LoRA arms")
    learn.add_argument("--config", default=CONFIG)
    learn.add_argument("--arms", nargs="+", default=["full", "lora:16:2e-4"], type=_arm,
                       help="'full' or 'lora:RANK:LR'")
    learn.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    learn.add_argument("--lock", default=None, help="hold an exclusive flock on this file while a cell runs")
    add_study_options(learn, "benchmarks/results/lora")
    args = p.parse_args(argv)
    if args.what == "resources":
        return resources(args)
    return study_main(args, learning, report)


if __name__ == "__main__":
    sys.exit(main())
