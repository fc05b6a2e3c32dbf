"""Soak run: memory and stability over a long async run with 2 searchers
(``--set searcher.num_searchers=N`` changes it);
memory per process must stay flat and the replay buffer must never grow past its capacity.

Runs ``tba train`` in a subprocess for ``--minutes``, samples the resident memory (RSS) of every process
of the run (the driver, each Ray actor and daemon, found through an environment marker they inherit)
every ``--every`` seconds, then stops the run with SIGTERM (checkpoint + clean shutdown, like Ctrl-C; a
SIGINT would be ignored where the soak itself was started in the background) and reports, per process:
RSS when training started, at the end, and the peak; plus the buffer's size and its largest per-prompt
group against the configured capacity. A small prompt set and capacity make the buffer reach
capacity early, so eviction runs for most of the soak.

    python benchmarks/soak.py --minutes 20                       # a 20-minute soak
    python benchmarks/soak.py --minutes 2 --set model.num_hidden_layers=2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def run_processes(marker: str) -> dict[int, str]:
    """pid -> short name of every process carrying ``TBA_SOAK_MARKER=marker`` in its environment."""
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "environ"]):
        try:
            if (p.info["environ"] or {}).get("TBA_SOAK_MARKER") != marker:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            name = next((n for n in ("TrainerActor", "SearcherActor", "BufferActor", "raylet", "gcs_server",
                                     "tba.cli") if n in cmd), p.info["name"])
            out[p.info["pid"]] = "driver" if name == "tba.cli" else name
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between memory samples")
    ap.add_argument("--capacity", type=int, default=16, help="buffer.capacity_per_prompt for the soak")
    ap.add_argument("--prompts", type=int, default=60, help="task.train_size (small: groups fill quickly)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra overrides")
    ap.add_argument("--max-growth", type=float, default=0.25,
                    help="fail if any process's RSS at the end exceeds its RSS at half time by this fraction")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak"))
    return ap


def start_run(args, out: Path, run_dir: Path, marker: str) -> subprocess.Popen:
    """Start ``tba train`` for the soak; every process of the run inherits ``TBA_SOAK_MARKER=marker``."""
    argv = [sys.executable, "-m", "tba.cli", "train", args.config, "--searcher.num_searchers", "2",
            "--max-steps", "1000000", "--run.eval_before", "false", "--run.eval_after", "false",
            "--trainer.save_final", "false", "--run.checkpoint_every", "0", "--run.tensorboard", "false",
            "--buffer.capacity_per_prompt", str(args.capacity), "--task.train_size", str(args.prompts),
            "--output-dir", str(run_dir), *args.set]
    env = {**os.environ, "TBA_SOAK_MARKER": marker, "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=open(out / "stderr.log", "w"))


def rss_by_process(marker: str) -> dict[str, float]:
    """``name#pid`` -> current RSS (MiB) of every live process of the run."""
    rss = {}
    for pid, name in run_processes(marker).items():
        try:
            rss[f"{name}#{pid}"] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return rss


def sample_memory(proc: subprocess.Popen, args, marker: str, metrics: Path, out: Path) -> list[dict]:
    """Sample the run's memory every ``--every`` s for ``--minutes``, then stop it with SIGTERM.

    Returns ``[{"t", "trained": bool, "rss": {name#pid: MiB}}]``; ``trained``: the first trainer step has been
    logged (``metrics`` is not empty)."""
    samples: list[dict] = []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.minutes * 60:
            if proc.poll() is not None:
                raise SystemExit(f"the run exited early with code {proc.returncode}; see {out / 'stderr.log'}")
            rss = rss_by_process(marker)
            trained = metrics.is_file() and metrics.stat().st_size > 0
            samples.append({"t": time.monotonic() - t0, "trained": trained, "rss": rss})
            time.sleep(args.every)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    return samples


def process_rows(started: list[dict]) -> tuple[list[str], float]:
    """Table rows (one per process alive at the first and last sample) and the worst half->end growth."""
    first, last = started[0]["rss"], started[-1]["rss"]
    half = started[len(started) // 2]  # warm-up (allocator pools, longest responses) is over by then
    rows, worst = [], 0.0
    for key in sorted(set(first) & set(last)):
        peak = max(s["rss"].get(key, 0.0) for s in started)
        mid = half["rss"].get(key, first[key])
        growth = last[key] / mid - 1
        worst = max(worst, growth)
        rows.append(f"| {key.split('#')[0]} (pid {key.split('#')[1]}) | {first[key]:.0f} | {mid:.0f} | "
                    f"{last[key]:.0f} | {peak:.0f} | {last[key] / first[key] - 1:+.1%} | {growth:+.1%} |")
    return rows, worst


def buffer_sizes(records: list[dict]) -> tuple[list[float], float]:
    """The buffer's size at every trainer step, and its largest per-prompt group ever."""
    return [r["buffer/size"] for r in records], max(r.get("buffer/largest_group", 0) for r in records)


def format_report(args, started: list[dict], records: list[dict], rows: list[str]) -> str:
    """The markdown report: memory per process (start, half time, end, peak) and the buffer's sizes."""
    first, last = started[0]["rss"], started[-1]["rss"]
    half = started[len(started) // 2]
    sizes, largest = buffer_sizes(records)
    total_first = sum(first.values())
    total_last = sum(last.values())
    n_searchers = sum(1 for key in last if key.startswith("SearcherActor"))
    peak_total = max(sum(smp["rss"].values()) for smp in started)
    return "\n".join([
        (f"Soak: {args.minutes:g} min, {n_searchers} searcher(s), {len(records)} trainer steps, "
         f"{int(records[-1]['buffer/samples_added'])} samples generated; memory sampled every {args.every:g} s "
         f"from the first trainer step ({started[0]['t']:.0f} s) to the end ({started[-1]['t']:.0f} s)."),
        "",
        (f"| process | RSS at start (MiB) | RSS at half time, {half['t']:.0f} s (MiB) | RSS at end (MiB) | "
         "peak (MiB) | change start->end | change half->end |"),
        "|---|---|---|---|---|---|---|",
        *rows,
        (f"| all | {total_first:.0f} | {sum(half['rss'].values()):.0f} | {total_last:.0f} | {peak_total:.0f} | "
         f"{total_last / total_first - 1:+.1%} | {total_last / sum(half['rss'].values()) - 1:+.1%} |"),
        "",
        (f"Buffer: {args.prompts} prompts x capacity {args.capacity} = at most {args.prompts * args.capacity} samples; "
         f"size first/max/last = {sizes[0]:.0f}/{max(sizes):.0f}/{sizes[-1]:.0f}; largest group ever {largest:.0f}."),
    ])


def main() -> int:
    """Run the soak and print/write its report; exit 1 if memory grew by more than --max-growth."""
    args = build_parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous soak's metrics would fake "training started"
    marker = f"soak-{os.getpid()}-{time.time()}"
    metrics = run_dir / "metrics.jsonl"
    samples = sample_memory(start_run(args, out, run_dir, marker), args, marker, metrics, out)

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    started = [s for s in samples if s["trained"]]
    if not started:
        raise SystemExit("training never started within the soak")
    (out / "rss.json").write_text(json.dumps(samples))
    rows, worst = process_rows(started)
    report = format_report(args, started, records, rows)
    print(report)
    (out / "soak.md").write_text(report + "\n")
    sizes, largest = buffer_sizes(records)
    ok = worst <= args.max_growth and largest <= args.capacity and max(sizes) <= args.prompts * args.capacity
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
