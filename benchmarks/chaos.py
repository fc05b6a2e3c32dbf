"""Chaos loop: stop one run N times at random points, resume it each time, then check that nothing was lost.

Each round resumes the run (the first one starts it), waits a random delay (seeded), sends a random signal
(SIGINT = Ctrl-C, SIGTERM = what a scheduler sends, SIGKILL = a crash), waits for the process to end and
kills whatever a SIGKILL left of its Ray instance. After every stop it checks the checkpoint on disk; at the
end it resumes the run to a few steps past its last checkpoint (``--max-steps`` override) and checks the whole
run:

- every stop left a resumable checkpoint whose trainer and driver steps agree (or, before the first
  checkpoint, none at all), and a resume restores exactly the checkpoint's buffer;
- no prompt a searcher started is missing from the buffer beyond one generation batch per searcher;
- the run completes; ``metrics.jsonl`` holds every step 1..final exactly once, in order;
- no process of the run is left.

    python benchmarks/chaos.py --stops 50 --seed 0 --out benchmarks/results/chaos

Prints one line per stop and a final verdict; writes ``<out>/chaos.json``. The fault-injection tests
(``tests/test_fault_injection.py``) use the same functions at chosen phases instead of random delays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import quiet_env, write_json  # noqa: E402

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}

#: A run on the 2-layer SmolLM2: small and fast, with a checkpoint and a publication every 2 steps and a
#: prompt set large enough that no searcher finishes an epoch (so skipped prompts can be counted).
TINY_RUN = [
    "--model.num_hidden_layers", "2", "--task.train_size", "1000", "--task.eval_size", "8",
    "--task.options", "{min_terms: 2, max_terms: 2, max_digits: 1}",
    "--searcher.prompts_per_batch", "2", "--searcher.samples_per_prompt", "4", "--searcher.max_new_tokens", "12",
    "--trainer.prompts_per_step", "2", "--trainer.group_size", "4", "--trainer.lr", "1e-4",
    "--trainer.lr_schedule", "constant", "--buffer.min_fill", "48", "--run.eval_batch_size", "8",
    "--trainer.sync_period", "2", "--run.checkpoint_every", "2", "--run.tensorboard", "false",
]


class Run:
    """One ``tba train`` run directory, driven through the CLI as a user would, its processes tagged.

    Args:
        run_dir: the run directory.
        args: ``tba train`` arguments of the first start (later starts are ``--resume RUN_DIR``).
        marker: value of the ``TBA_TEST_MARKER`` env var, inherited by Ray's daemons and workers, so the
            processes of this run can be found (and killed after a SIGKILL).
    """

    def __init__(self, run_dir: Path, args: list[str], marker: str):
        self.run_dir, self.args, self.marker = Path(run_dir), args, marker
        self.proc: subprocess.Popen | None = None
        self.output = ""

    def start(self, extra: list[str] = ()) -> None:
        """Start the run, or resume it if its directory holds a config (``extra``: more overrides)."""
        resume = (self.run_dir / "config.yaml").is_file()
        args = ["--resume", str(self.run_dir), *extra] if resume else [*self.args, *extra, "--output-dir",
                                                                     str(self.run_dir)]
        self.proc = subprocess.Popen([sys.executable, "-m", "tba.cli", "train", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=marked_env(self.marker))

    def phase(self) -> dict:
        """The run's ``status.json`` as written by the current process (``{}`` before it writes one: the file
        may still hold the previous process's last phase)."""
        try:
            status = json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}
        return status if status.get("pid") == self.proc.pid else {}

    def wait_for(self, predicate, timeout_s: float = 600) -> bool:
        """Poll ``predicate(self)`` every 50 ms until true (True), or the process ends / time runs out (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def stop(self, sig: int, timeout_s: float = 600) -> int:
        """Send ``sig``, wait for the CLI to exit, kill what a SIGKILL left behind; returns the exit code."""
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.output = out or ""
        if sig == signal.SIGKILL:  # the driver had no chance to stop its Ray instance
            for pid in self.processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return self.proc.returncode

    def finish(self, timeout_s: float = 900) -> int:
        """Wait for the process to end by itself; returns its exit code."""
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.output = out or ""
        return self.proc.returncode

    def processes(self) -> list[int]:
        """PIDs of this run's processes (the CLI, Ray daemons and workers)."""
        return marked_processes(self.marker)

    def processes_gone(self, timeout_s: float = 60) -> bool:
        """Whether every process of the run has exited within ``timeout_s`` seconds."""
        return processes_gone(self.marker, timeout_s)


def marked_env(marker: str) -> dict:
    """The environment for a ``tba`` subprocess: quiet transformers, no hub, and ``TBA_TEST_MARKER=marker``,
    which Ray's daemons and workers inherit, so the processes of one run can be found."""
    return {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TBA_TEST_MARKER": marker}


def marked_processes(marker: str) -> list[int]:
    """PIDs (other than this one) whose environment carries ``TBA_TEST_MARKER=marker``."""
    needle = f"TBA_TEST_MARKER={marker}".encode() + b"\0"
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes() + b"\0":
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def processes_gone(marker: str, timeout_s: float = 60) -> bool:
    """Whether every process marked ``marker`` has exited within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not marked_processes(marker)


def checkpoint_problems(run_dir: Path, num_problems: int, batch_prompts: int) -> list[str]:
    """What is wrong with the checkpoint a stop left (empty list: nothing).

    Args:
        run_dir: the run directory.
        num_problems: training prompts of the task (one searcher: its shard is all of them).
        batch_prompts: prompts per generation batch times searchers: how many started prompts a stop may lose.
    """
    from tba.checkpoint import CheckpointError, find, read_json, resumable_step

    ckpt = find(run_dir)
    if ckpt is None:
        return []  # stopped before its first checkpoint: a resume starts over
    try:
        resumable_step(ckpt)
    except CheckpointError as e:
        return [str(e)]
    (cursor,) = read_json(ckpt / "searchers.json")
    in_buffer = {s["prompt_id"] for _, s in read_json(ckpt / "buffer.json")["buffer"]["samples"]}
    # prompts the searcher has taken in its current epoch (its cursor holds the rest of the epoch)
    started = set(range(num_problems)) - set(cursor["order"]) if cursor["order"] else in_buffer
    lost = started - in_buffer
    if len(lost) > batch_prompts:
        return [f"{len(lost)} started prompts are not in the buffer (at most {batch_prompts} may be)"]
    return []


def resume_problems(run: Run, saved_samples: int | None) -> list[str]:
    """Whether the resume's first line reports exactly the checkpoint's buffer (``saved_samples``; None: the
    run had no checkpoint and must start over)."""
    if saved_samples is None:
        return [] if "holds no checkpoint yet" in run.output else ["a run without checkpoint did not start over"]
    line = re.search(r"resumed at trainer step \d+ with (\d+) samples in the buffer", run.output)
    if line is None:
        return ["the resume printed no 'resumed at' line"]
    return [] if int(line.group(1)) == saved_samples else [
        f"the resume restored {line.group(1)} samples, the checkpoint holds {saved_samples}"]


def saved_samples(run_dir: Path) -> int | None:
    """Samples in the run's checkpoint buffer, or None without a checkpoint."""
    from tba.checkpoint import find, read_json

    ckpt = find(run_dir)
    return None if ckpt is None else len(read_json(ckpt / "buffer.json")["buffer"]["samples"])


def final_problems(run: Run, max_steps: int) -> list[str]:
    """What is wrong with a run that should have completed (empty list: nothing)."""
    problems = []
    if run.proc.returncode != 0:
        problems.append(f"the final resume exited {run.proc.returncode}: {run.output[-500:]}")
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r["step"] for r in records if "train/lr" in r]
    if steps != list(range(1, max_steps + 1)):
        problems.append(f"metrics steps are not 1..{max_steps} once each: {steps}")
    summary = run.run_dir / "summary.json"
    if not summary.is_file() or json.loads(summary.read_text())["trainer_steps"] != max_steps:
        problems.append("summary.json is missing or does not report max_steps")
    if not run.processes_gone():
        problems.append("processes of the run were left behind")
    return problems


def num_train_problems(run_dir: Path) -> int:
    """Training prompts of the run's task (built from its config.yaml, no model loaded)."""
    from tba.config import load_config
    from tba.tasks import build_task

    return len(build_task(load_config(run_dir / "config.yaml")).train)


def chaos(args: argparse.Namespace) -> dict:
    """The stop/resume loop of the module docstring; returns the per-stop log and the verdict."""
    rng = random.Random(args.seed)
    out = Path(args.out)
    run = Run(out / "run", [*TINY_RUN, "--max-steps", str(args.max_steps)], f"chaos-{os.getpid()}-{time.time()}")
    stops, problems, n_problems = [], [], None
    for i in range(args.stops):
        run.start()
        before = saved_samples(run.run_dir)
        name, delay = rng.choice(sorted(SIGNALS)), rng.uniform(args.min_delay_s, args.max_delay_s)
        started = run.wait_for(lambda r: r.phase().get("phase") not in (None, "starting"))
        run.wait_for(lambda r: False, timeout_s=delay)  # sleeps, or returns early if the process ends
        if run.proc.poll() is not None:
            problems.append(f"stop {i}: the run ended before the signal: {run.finish()} {run.output[-300:]}")
            break
        phase = run.phase()
        code = run.stop(SIGNALS[name])
        n_problems = n_problems or num_train_problems(run.run_dir)
        found = ([] if started else ["never left 'starting'"]) + resume_problems_if_resumed(run, before, i)
        found += checkpoint_problems(run.run_dir, n_problems, args.batch_prompts)
        stops.append({"stop": i, "signal": name, "delay_s": round(delay, 2), "phase": phase.get("phase"),
                      "step": phase.get("step"), "exit": code, "problems": found})
        print(f"stop {i:3d}: {name:7s} after {delay:5.1f} s in phase {phase.get('phase')} "
              f"(step {phase.get('step')}), exit {code}{'; ' + '; '.join(found) if found else ''}", flush=True)
        problems += [f"stop {i}: {p}" for p in found]
    before = saved_samples(run.run_dir)
    final_steps = (saved_step(run.run_dir) or 0) + args.final_steps  # the run's max_steps outlasts the stops
    run.start(["--max-steps", str(final_steps)])
    run.finish()
    problems += resume_problems(run, before) + final_problems(run, final_steps)
    return {"stops": stops, "problems": problems, "ok": not problems, "final_steps": final_steps,
            "seed": args.seed}


def saved_step(run_dir: Path) -> int | None:
    """The trainer step of the run's checkpoint, or None without one."""
    from tba.checkpoint import find, read_json

    ckpt = find(run_dir)
    return None if ckpt is None else read_json(ckpt / "driver.json")["step"]


def resume_problems_if_resumed(run: Run, before: int | None, i: int) -> list[str]:
    """:func:`resume_problems` for every start after the first (the first start resumes nothing)."""
    if i == 0 or "resumed at trainer step" not in run.output and "holds no checkpoint" not in run.output:
        return []  # stopped before the CLI printed its resume line: nothing to compare
    return resume_problems(run, before)


def main(argv: list[str] | None = None) -> int:
    """Command line; exit 0 if every invariant held."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stops", type=int, default=50, help="random stops before the final resume")
    p.add_argument("--seed", type=int, default=0, help="seeds the signals and delays")
    p.add_argument("--max-steps", type=int, default=100000, help="trainer steps of the run (outlasts the stops)")
    p.add_argument("--final-steps", type=int, default=4,
                   help="the final resume runs to the checkpoint's step + this many, then evaluates and saves")
    p.add_argument("--min-delay-s", type=float, default=0.0, help="shortest wait after start, seconds")
    p.add_argument("--max-delay-s", type=float, default=30.0, help="longest wait after start, seconds")
    p.add_argument("--batch-prompts", type=int, default=2, help="prompts per generation batch x searchers")
    p.add_argument("--out", default="benchmarks/results/chaos")
    args = p.parse_args(argv)
    quiet_env()
    result = chaos(args)
    write_json(Path(args.out) / "chaos.json", result)
    print(f"{len(result['stops'])} stops, {'all resumed, nothing lost' if result['ok'] else 'PROBLEMS:'}")
    for line in result["problems"]:
        print(f"  {line}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
