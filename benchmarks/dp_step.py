"""Data-parallel trainer step on this machine: 1 rank x 2 threads against 2 ranks x 1 thread, same batch.

One real searcher batch of the quickstart recipe (B = 4 prompts x K = 8 responses, SmolLM2-135M, up to 32 new
tokens) is generated once; then cells alternate (1x2, 2x1, 1x2, ...): each cell starts fresh processes
(torch.multiprocessing spawn; the 2-rank cells form a gloo group on loopback, ``tba.parallel``), builds the
trainer as a run does (``tba.runtime.build.build_trainer``: float32 master weights, bf16 autocast where
supported), takes one warm-up step and times ``--steps`` more on copies of the same batch (rank 0's
``perf/train_step_s``, wall seconds). The report is the median step time of each layout over all its cells and
their ratio, with the 1-minute load average before and after every cell (the machine is shared).

    python benchmarks/dp_step.py --out benchmarks/results/dp-step.json
    python benchmarks/dp_step.py --layers 2 --cells 1 --steps 2 --out /tmp/dp-step.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, quiet_env, write_json

LAYOUTS = {"1 rank x 2 threads": (1, 2), "2 ranks x 1 thread": (2, 1)}


def _overrides(layers: int | None, ranks: int, threads: int) -> dict:
    return {"model.num_hidden_layers": layers, "trainer.threads": threads, "trainer.num_workers": ranks}


def _rank(rank: int, world: int, port: int, config: str, overrides: dict, batch_file: str, steps: int,
          out: str) -> None:
    """One rank of a cell: build the trainer, one warm-up step, ``steps`` timed steps; rank 0 writes its times."""
    import copy

    import torch

    from tba import parallel
    from tba.config import load_config
    from tba.models import prepare_model
    from tba.runtime.build import build_trainer

    quiet_env()
    cfg = load_config(config, overrides)
    torch.set_num_threads(cfg.trainer.threads)
    if world > 1:
        parallel.init_group(rank, world, port, "cpu", cfg.trainer.collective_timeout_s)
    path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    trainer, _ = build_trainer(cfg, path, path)
    batch = pickle.loads(Path(batch_file).read_bytes())
    trainer.step(copy.deepcopy(batch))  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step(copy.deepcopy(batch))
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    parallel.close_group()


def make_batch(config: str, layers: int | None, seed: int):
    """One searcher batch of ``config`` (generated with the hf engine, as a run's first batch)."""
    from tba.config import load_config
    from tba.models import prepare_model
    from tba.runtime.build import build_searcher
    from tba.types import Batch

    cfg = load_config(config, {"model.num_hidden_layers": layers, "run.seed": seed, "searcher.threads": 2})
    path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    samples, _ = build_searcher(cfg, path, path, 0).step()
    k = cfg.trainer.group_size
    return Batch(samples[: cfg.trainer.prompts_per_step * k], k)


def run_cell(config: str, layers: int | None, layout: str, batch_file: str, steps: int, tmp: Path) -> dict:
    """One cell: fresh processes of ``layout``; its step times and the load average around it."""
    import torch.multiprocessing as mp

    from tba.parallel import free_port

    ranks, threads = LAYOUTS[layout]
    out = tmp / f"times-{time.monotonic_ns()}.txt"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    mp.spawn(_rank, args=(ranks, free_port(), config, _overrides(layers, ranks, threads), batch_file, steps, str(out)),
             nprocs=ranks, join=True)
    return {"layout": layout, "ranks": ranks, "threads": threads, "step_s": json.loads(out.read_text()),
            "cell_wall_s": time.monotonic() - t0, "load1_before": load_before, "load1_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--layers", type=int, default=None, help="model.num_hidden_layers (default: the whole model)")
    p.add_argument("--cells", type=int, default=3, help="cells per layout, interleaved")
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/dp-step.json")
    args = p.parse_args(argv)
    quiet_env()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    batch = make_batch(args.config, args.layers, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        batch_file = Path(tmp) / "batch.pkl"
        batch_file.write_bytes(pickle.dumps(batch))
        cells = [run_cell(args.config, args.layers, layout, str(batch_file), args.steps, Path(tmp))
                 for _ in range(args.cells) for layout in LAYOUTS]
    medians = {layout: statistics.median([t for c in cells if c["layout"] == layout for t in c["step_s"]])
               for layout in LAYOUTS}
    one, two = medians["1 rank x 2 threads"], medians["2 ranks x 1 thread"]
    result = {
        "command": command_line(argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(), "batch": {"prompts": batch.num_prompts, "group_size": batch.group_size,
                                          "response_tokens": sum(len(s.response_ids) for s in batch.samples),
                                          "prompt_tokens": sum(len(s.prompt_ids) for s in batch.samples)},
        "layers": args.layers, "median_step_s": medians, "ratio_2x1_over_1x2": two / one, "cells": cells,
    }
    write_json(Path(args.out), result)
    for layout, m in medians.items():
        print(f"{layout}: median step {m:.3f} s", flush=True)
    print(f"2 ranks x 1 thread / 1 rank x 2 threads = {two / one:.3f} (load1 "
          f"{min(c['load1_before'] for c in cells):.2f}-{max(c['load1_after'] for c in cells):.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
