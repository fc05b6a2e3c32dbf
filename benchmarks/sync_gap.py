"""Sync check: the probe gap of a correct weight sync and of a broken one (where ``searcher.sync_gap_bound``'s
default comes from).

The pieces are built as a run builds them (``tba.runtime.build``): the trainer (float32 master weights,
bf16 autocast when ``model.dtype`` is bfloat16) and a searcher with the hf engine in the generation dtype. One
searcher batch per trainer step with the current weights (sync mode, so every batch is at staleness 0), and a
publication after every step (step 0: the probe before any step, when every engine holds the trainer's
weights). After each publication the trainer's probe (``Trainer.probe``: the same four
responses of the first batch, scored by the trainer at temperature 1) is scored by

- ``hf_sync``: the searcher's hf engine after ``Searcher.load_weights`` (the searcher's own check);
- ``vllm_sync``: a vLLM engine (``searcher.engine vllm``) after ``load_weights`` of the same pack;
- ``hf_stale``, ``vllm_stale``: an hf and a vLLM engine never given weights (a sync that never reaches the
  engine: still the initial policy after t steps);

and each gap is the searchers' formula (``Searcher.check_sync``): mean |engine - trainer| log-prob over the
probe's tokens, nats per token. From step 1 on, how far each engine's log-probs moved since the previous
publication against the trainer's (``tba.searcher.engine_moved``) goes beside it (``NAME_moved``), and the
trainer's own move (``trainer_moved``, RMS nats per token).
``fresh`` is the step's ``train/fresh_behaviour_gap`` (behaviour log-probs of
the staleness-0 batch against the trainer's, at the sampling temperature). ``model.dtype float32`` makes every
side float32 (the control).

    python benchmarks/sync_gap.py --layers 30 2 --dtypes bfloat16 float32 --steps 8 \\
        --out benchmarks/results/sync-gap.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_sets, quiet_env, warnings_only_logging, write_json


def probe_check(name: str, engine, probe, previous: dict) -> dict:
    """``Searcher.check_sync``'s two quantities for one engine: the gap (mean |engine - trainer| log-prob over
    the probe's tokens) and, against ``previous[name]`` (the engine's and the trainer's log-probs at the last
    publication, updated here), how far the engine moved against the trainer."""
    from tba.searcher import engine_moved

    scored = engine.score(probe.prompt_ids, probe.response_ids, probe.temperature)
    diffs = [abs(a - b) for mine, theirs in zip(scored, probe.logprobs) for a, b in zip(mine, theirs)]
    out = {name: sum(diffs) / len(diffs)}
    if name in previous:
        moved = engine_moved(previous[name][0], scored, previous[name][1], probe.logprobs)
        if moved is not None:
            out[f"{name}_moved"] = moved
        if name == "hf_sync":  # the trainer's move since the last publication (RMS, nats per token)
            d = [b - a for t0, t1 in zip(previous[name][1], probe.logprobs) for a, b in zip(t0, t1)]
            out["trainer_moved"] = (sum(x * x for x in d) / len(d)) ** 0.5
    previous[name] = (scored, probe.logprobs)
    return out


def measure(config: str, layers: int, dtype: str, steps: int, seed: int, vllm: bool, extra: dict) -> list[dict]:
    """``steps`` trainer steps with a publication after each; one row of gaps per publication."""
    from tba.config import load_config
    from tba.engines.hf import HFEngine
    from tba.models import load_causal_lm, prepare_model
    from tba.runtime.build import build_engine, build_searcher, build_trainer, generation_dtype
    from tba.trainer import pick_probe
    from tba.types import Batch

    cfg = load_config(config, {"model.dtype": dtype, "model.num_hidden_layers": layers, "model.device": "cpu",
                               "run.seed": seed, **extra})
    path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    searcher = build_searcher(cfg, path, path, 0)
    trainer, _ = build_trainer(cfg, path, path)
    gen = generation_dtype(cfg)
    engines = {"hf_stale": HFEngine(load_causal_lm(path, gen, layers).eval(), searcher.tokenizer)}
    if cfg.model.lora.r:
        from tba.adapters import add_adapter

        engines["hf_stale"] = HFEngine(add_adapter(engines["hf_stale"].model, cfg.model.lora).eval(),
                                       searcher.tokenizer)
    if vllm:
        vcfg = cfg.model_copy(update={"searcher": cfg.searcher.model_copy(update={"engine": "vllm"})})
        for name in ("vllm_sync", "vllm_stale"):
            engines[name] = build_engine(vcfg, path, searcher.tokenizer, seed, searcher.task, searcher.problem_ids)
    b, k = cfg.trainer.prompts_per_step, cfg.trainer.group_size
    rows, previous = [], {}
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            samples, _ = searcher.step()  # the current weights: staleness 0 at this step
            assert len(samples) >= b * k and cfg.searcher.samples_per_prompt == k, "one batch = B prompts x K"
            batch = Batch(samples[: b * k], k)
            if trainer.probe_tokens is None:  # step 0: every engine holds the trainer's weights
                trainer.probe_tokens = pick_probe(batch)
                probe = trainer.probe()
                row = {"layers": layers, "dtype": dtype, "seed": seed, "step": 0, "lr": 0.0,
                       "probe_tokens": sum(len(r) for r in probe.response_ids)}
                for name, e in [("hf_sync", searcher.engine), *engines.items()]:  # stale ones: their baseline
                    gaps = probe_check(name, e, probe, previous)
                    row.update(gaps if "sync" in name else {})
                print(row, flush=True)
                rows.append(row)
            m = trainer.step(batch)
            packed = trainer.publish_weights(gen)
            searcher.load_weights(trainer.step_count, packed)  # runs the searcher's own sync check
            row = {"layers": layers, "dtype": dtype, "seed": seed, "step": trainer.step_count, "lr": m["train/lr"],
                   "probe_tokens": sum(len(r) for r in packed.probe.response_ids),
                   "fresh": m.get("train/fresh_behaviour_gap")}
            if "vllm_sync" in engines:
                engines["vllm_sync"].load_weights(packed)
            for name, e in [("hf_sync", searcher.engine), *engines.items()]:
                row.update(probe_check(name, e, packed.probe, previous))
            assert abs(row["hf_sync"] - searcher.sync_gap) < 1e-9, "the searcher's own check scored the same"
            row["s"] = round(time.perf_counter() - t0, 1)
            print({key: round(v, 5) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
            rows.append(row)
    finally:
        for e in engines.values():
            e.close()
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per (layers, dtype): the correct-sync gaps (largest and mean over seeds, steps and both engines, step 0
    included), the staleness-0 gaps, the smallest stale gap at each step (over seeds and engines), and the
    engine's move against the trainer's: its range on correct syncs and on stale engines, and how many of each
    are below ``tba.searcher.MOVED_MIN`` (a warning)."""
    from tba.searcher import MOVED_MIN

    out = []
    for key in sorted({(r["layers"], r["dtype"]) for r in rows}, key=lambda x: (-x[0], x[1])):
        cell = [r for r in rows if (r["layers"], r["dtype"]) == key]
        summary = {"layers": key[0], "dtype": key[1], "seeds": sorted({r["seed"] for r in cell})}
        for name, keys in (("sync", ("hf_sync", "vllm_sync")), ("fresh", ("fresh",))):
            vals = [r[k] for r in cell for k in keys if r.get(k) is not None]
            if vals:
                summary[f"{name}_max"], summary[f"{name}_mean"] = max(vals), sum(vals) / len(vals)
        stale = {}
        for r in cell:
            vals = [r[k] for k in ("hf_stale", "vllm_stale") if k in r]
            if vals:
                stale[r["step"]] = min(vals + [stale.get(r["step"], float("inf"))])
        summary["stale_min_by_step"] = stale
        for kind, names in (("sync", ("hf_sync", "vllm_sync")), ("stale", ("hf_stale", "vllm_stale"))):
            moved = [r[f"{n}_moved"] for r in cell for n in names if f"{n}_moved" in r]
            if moved:
                summary[f"{kind}_moved_range"] = [min(moved), max(moved)]
                summary[f"{kind}_warned"] = f"{sum(m < MOVED_MIN for m in moved)}/{len(moved)}"
        out.append(summary)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--layers", type=int, nargs="+", default=[30, 2], help="model.num_hidden_layers per cell")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--no-vllm", action="store_true", help="hf engine only (vLLM not installed)")
    p.add_argument("--set", action="append", default=["searcher.threads=2", "trainer.threads=2"],
                   metavar="KEY=VALUE", help="config override, repeatable (e.g. model.lora.r=8)")
    p.add_argument("--out", default="benchmarks/results/sync-gap.json")
    args = p.parse_args(argv)
    quiet_env()
    warnings_only_logging()
    extra = parse_sets(args.set)
    rows = [r for layers in args.layers for dtype in args.dtypes for seed in args.seeds
            for r in measure(args.config, layers, dtype, args.steps, seed, not args.no_vllm, extra)]
    summary = summarise(rows)
    for s in summary:
        print(s, flush=True)
    write_json(Path(args.out), {"summary": summary, "rows": rows, "command": " ".join(["python", *sys.argv])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
