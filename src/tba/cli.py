"""``tba`` command line: ``tba train CONFIG [--section.field VALUE | section.field=VALUE ...]``."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import sys
import textwrap
import time
import types
import typing
from pathlib import Path

from tba.config import ConfigError, iter_fields, load_config, parse_assignments, parse_value

SHORTCUTS = {"--max-steps": "trainer.max_steps", "--ray-address": "run.ray_address",
             "--output-dir": "run.output_dir", "--mode": "run.mode", "--seed": "run.seed"}


class _TrainParser(argparse.ArgumentParser):
    """``tba train``'s parser; its help ends with every task's options (imported only when help is shown)."""

    def format_help(self) -> str:
        self.epilog = task_options_help(shutil.get_terminal_size().columns - 2)
        return super().format_help()


def type_name(ann) -> str:
    """``Optional[int]`` -> ``int|null``, ``Literal['a', 'b']`` -> ``a|b``, ``list[str]`` -> ``list[str]``: a
    field's type as ``tba train --help`` and the configuration reference (docs/hooks.py) print it."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return "|".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(map(type_name, args))}]"
    return getattr(ann, "__name__", str(ann))


def task_option_fields() -> dict[str, tuple[str | None, dict]]:
    """Every task's ``task.options`` by ``task.name``: ``(note, fields)``, with ``fields`` the pydantic fields of
    its ``Options`` model and ``note`` what to print instead when it has none (the free dict's docstring, or
    'none'), else None. The one source of the options part of ``tba train --help`` and of the reference."""
    from tba.tasks import task_classes

    out = {}
    for name, cls in task_classes().items():
        fields = cls.Options.model_fields
        note = None
        if not fields:  # none, or a free dict (reasoning-gym: the dataset's own settings)
            free = cls.Options.model_config.get("extra") == "allow"
            note = " ".join((cls.Options.__doc__ or "").split()) if free else "none"
        out[name] = (note, fields)
    return out


def task_options_help(width: int = 100) -> str:
    """The ``task.options`` of every task, a section per task: ``name: type``, description and default, laid
    out as argparse lays out the config fields above them."""
    width = max(width, 60)
    lines = textwrap.wrap("task options: set as task.options.NAME=VALUE (YAML: task: {options: {NAME: VALUE}}); "
                          "each task takes its own, checked before anything starts.", width)
    wrap = textwrap.TextWrapper(width=width, initial_indent=" " * 24, subsequent_indent=" " * 24)
    for name, (note, fields) in task_option_fields().items():
        lines += ["", f"task.options of {name}:"]
        if note is not None:
            lines += textwrap.wrap(note, width, initial_indent="  ", subsequent_indent="  ")
        for field, info in fields.items():
            left = f"  {field}: {type_name(info.annotation)}"
            body = wrap.wrap(f"{info.description or ''} [default: {info.get_default(call_default_factory=True)!r}]")
            lines += [left, *body] if len(left) > 22 else [left.ljust(24) + body[0][24:], *body[1:]]
    return "\n".join(lines)


def _train_parser() -> argparse.ArgumentParser:
    p = _TrainParser(
        prog="tba train",
        description="Post-train a causal LM with TBA: searchers -> replay buffer -> trainer -> weights back. "
        "Every config field can be set in the YAML file or overridden here as --section.field VALUE or "
        "section.field=VALUE (values are parsed as YAML: 1e-5, true, null, [1, 2]).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (e.g. configs/quickstart.yaml); omitted = defaults")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue RUN_DIR from its checkpoint to trainer.max_steps (its config.yaml + overrides)")
    p.add_argument("assignments", nargs="*", help="overrides as section.field=VALUE")
    for flag, dotted in SHORTCUTS.items():
        p.add_argument(flag, dest=dotted, default=argparse.SUPPRESS, metavar="V", help=f"same as --{dotted}")
    for dotted, info in iter_fields():
        default = info.get_default(call_default_factory=True)
        p.add_argument(f"--{dotted}", dest=dotted, default=argparse.SUPPRESS, metavar="V",
                       help=f"{info.description or ''} [default: {default!r}]")
    return p


def parse_train_args(argv: list[str]) -> tuple[str | None, dict, str | None]:
    """Split ``tba train`` arguments into the config path, a dict of dotted overrides and the resume dir.

    Raises:
        ConfigError: an assignment without '='.
    """
    ns = vars(_train_parser().parse_intermixed_args(argv))
    config = ns.pop("config")
    assignments = ns.pop("assignments")
    resume = ns.pop("resume")
    if config and "=" in config:  # `tba train trainer.lr=1e-5` with no config file
        assignments, config = [config, *assignments], None
    overrides = {**{k: parse_value(v) for k, v in ns.items()}, **parse_assignments(assignments)}
    if resume and config is None:
        config = str(Path(resume) / "config.yaml")
    return config, overrides, resume


def _progress_bar(total: int, loss_key: str):
    """tqdm bar over trainer steps showing reward, loss, samples/s and staleness; returns its update fn."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)
    t0 = time.monotonic()

    def update(step: int, m: dict) -> None:
        bar.n = step
        bar.set_postfix(reward=f"{m.get('train/reward_mean', 0):.3f}", loss=f"{m.get(loss_key, 0):.3g}",
                        samples_s=f"{m.get('buffer/samples_added', 0) / max(time.monotonic() - t0, 1e-9):.1f}",
                        stale=f"{m.get('buffer/staleness_mean', 0):.1f}", refresh=True)

    update.close = bar.close
    return update


def run_train(cfg, *, resume_dir: str | None = None, show_progress: bool = True) -> dict:
    """Run one training job from a validated config; returns the summary (also written to summary.json).

    With ``resume_dir`` the run continues from that directory's checkpoint, appending to its metrics.

    Raises:
        ModelLoadError, DataError, FileNotFoundError, ValueError: bad model/data, before Ray starts.
        TooManySkippedSteps: too many non-finite steps in a row (after saving a checkpoint).
    """
    from tba.logger import LIBRARY_LOG, MetricsLogger, RunStatus, route_library_file

    t_start = time.monotonic()
    task, policy_path, ref_path, run_dir, resume_step = _prepare(cfg, resume_dir)
    library_log = route_library_file(run_dir, "driver")  # the actors append to the same file
    # a resumed run drops the records a killed run wrote after its checkpoint: those steps are run again
    logger = MetricsLogger(run_dir, cfg.run.tensorboard, cfg.run.wandb_project, cfg.model_dump(),
                           keep_through=resume_step)
    status = RunStatus(run_dir)
    print(f"run directory: {run_dir}", flush=True)
    summary: dict = {"run_dir": str(run_dir), "task": task.name, "mode": cfg.run.mode, "loss": cfg.loss.name,
                     "library_log": str(run_dir / LIBRARY_LOG)}
    try:
        state, stats = _run(cfg, policy_path, ref_path, run_dir, resume_dir, logger, status, summary, show_progress)
    finally:
        logger.close()
        if library_log is not None:
            logging.getLogger().removeHandler(library_log)
            library_log.close()
    summary.update({
        "trainer_steps": state.step,
        "samples_generated": int(stats["buffer/samples_added"]),
        "searcher_max_version": int(stats["searcher/max_version"]),
        "searcher_restarts": state.searcher_restarts,
        "reward_failures": int(stats["searcher/reward_failures_total"]),
        "staleness_mean": state.staleness_sum / max(1, state.step),
        "staleness_max": state.staleness_max,
        "trainer_idle_frac": state.trainer_idle_frac,
        "wall_s": time.monotonic() - t_start,
    })
    _plot(cfg, run_dir, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    status.set("done", state.step)
    return summary


def _prepare(cfg, resume_dir: str | None):
    """Everything that can fail on bad input, before Ray starts: the engine's library, the device placement
    (GPUs asked for where there are none), the task and its data, the models, the prompts' lengths, the
    checkpoint to resume. Returns (task, policy path, reference path, run dir, the step a resumed run
    continues from or None)."""
    from tba.checkpoint import find, resumable_step
    from tba.models import prepare_model
    from tba.placement import check_engine, resolve_placement
    from tba.tasks import build_task

    check_engine(cfg)
    if not cfg.run.ray_address:  # a cluster's GPUs are known once joined: the driver checks them then
        import torch

        resolve_placement(cfg, torch.cuda.device_count())
    resume_step = None
    if resume_dir:
        ckpt = find(Path(resume_dir))
        resume_step = resumable_step(ckpt) if ckpt is not None else 0
    task = build_task(cfg)  # fails fast on bad data, before any model loads
    if cfg.model.policy == "task":  # the task builds its own model (known_optimum)
        policy_path = task.own_model()
    else:
        policy_path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    ref_path = prepare_model(cfg.model.reference, cfg.model.cache_dir) if cfg.model.reference else policy_path
    _check_prompts(task, policy_path, cfg.searcher.max_new_tokens)
    if resume_dir:
        run_dir = Path(resume_dir)
    else:
        run_dir = Path(cfg.run.output_dir.format(task=task.name.replace(":", "-"), time=time.strftime("%Y%m%d-%H%M%S")))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a path under a regular file: one line naming the field, not "[Errno 20] ..."
        raise OSError(f"run.output_dir '{run_dir}' cannot be created: {e.strerror or e}") from None
    try:
        (run_dir / "config.yaml").write_text(_dump_yaml(cfg.model_dump()))
    except OSError as e:
        raise OSError(f"run.output_dir '{run_dir}' is not writable: {e.strerror or e}") from None
    return task, policy_path, ref_path, run_dir, resume_step


def _run(cfg, policy_path, ref_path, run_dir, resume_dir, logger, status, summary: dict, show_progress: bool):
    """Start the runtime, resume, evaluate before, train, evaluate after and save; fills ``summary``.
    Returns (run state, buffer/searcher counters)."""
    from tba.placement import describe
    from tba.runtime import RayRuntime

    status.set("starting", 0)
    with RayRuntime(cfg, policy_path, ref_path, run_dir, on_metrics=logger.log, on_phase=status.set) as rt:
        # again now that Ray runs: ray.init installs its own SIGTERM handler, which exits at once
        # (no checkpoint, actors left to the raylet)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        print(describe(rt.cfg), flush=True)
        summary["device"] = rt.cfg.model.device
        if resume_dir:
            state = rt.resume()
            if state is None:
                print(f"{run_dir} holds no checkpoint yet: starting at step 0", flush=True)
            else:
                summary.update(state.extra)
                print(f"resumed at trainer step {state.step} with {int(rt.stats()['buffer/size'])} samples in the "
                      "buffer", flush=True)
        rt.start_searchers()
        if cfg.run.eval_before and "eval_before" not in summary:
            summary["eval_before"] = rt.state.extra["eval_before"] = _numbers(rt.evaluate("eval_before"))
            print(f"eval before training: {_fmt_metrics(summary['eval_before'])}", flush=True)
        bar = _progress_bar(cfg.trainer.max_steps, f"loss/{cfg.loss.name}") if show_progress else None
        t_train = time.monotonic()
        state = rt.train(bar)
        summary["train_wall_s"] = time.monotonic() - t_train
        if bar is not None:
            bar.close()
        stats = rt.stats()
        summary["searcher_nodes"] = sorted(set(rt.searcher_nodes()))
        if cfg.run.eval_after:
            after = rt.evaluate("eval_after")
            summary["eval_after"], summary["eval_examples"] = _numbers(after), after.get("examples", [])
        if cfg.trainer.save_final:
            summary["final_model"] = rt.save(str(run_dir / "final"))
    return state, stats


def _plot(cfg, run_dir: Path, summary: dict) -> None:
    from tba.logger import plot_learning_curve

    if (run_dir / "metrics.jsonl").stat().st_size:
        summary["learning_curve"] = str(plot_learning_curve(
            run_dir / "metrics.jsonl", run_dir / "learning_curve.png",
            ("searcher/reward_mean", "train/reward_mean", f"loss/{cfg.loss.name}", "buffer/staleness_mean")))


def _check_prompts(task, model_path: str, max_new_tokens: int) -> None:
    """Empty or over-long prompts fail here, before Ray starts (one clear line, see Task.check_prompts)."""
    from transformers import AutoConfig

    from tba.models import load_tokenizer

    try:
        max_positions = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except OSError:
        max_positions = None  # a hub id we cannot reach yet: the workers will report it
    task.check_prompts(load_tokenizer(model_path), max_positions, max_new_tokens)


def _numbers(result: dict) -> dict[str, float]:
    return {k: v for k, v in result.items() if isinstance(v, (int, float))}


def _fmt_metrics(m: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items())


def _dump_yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def _fmt3(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def print_summary(s: dict) -> None:
    """Human-readable end-of-run summary."""
    lines = ["", "== tba summary =="]
    before, after = s.get("eval_before", {}), s.get("eval_after", {})
    for key in [k for k in {**before, **after} if k not in ("n", "stderr")]:
        b, a = before.get(key), after.get(key)
        gain = f" (change {a - b:+.3f})" if a is not None and b is not None else ""
        noise = (f", eval stderr {after['stderr']:.3f} on {after['n']} problems"
                 if key == "accuracy" and "stderr" in after else "")
        lines.append(f"eval {key}: before {_fmt3(b)} -> after {_fmt3(a)}{gain}{noise}")
    lines += [
        f"trainer steps: {s['trainer_steps']}   samples generated: {s['samples_generated']}",
        f"wall time: {s['wall_s']:.0f} s (training {s['train_wall_s']:.0f} s"
        + (f", trainer idle {s['trainer_idle_frac']:.1%} of it)" if s.get("trainer_idle_frac") is not None else ")"),
        f"staleness (trainer step - policy version): mean {s['staleness_mean']:.2f}, max {s['staleness_max']:.0f}",
        f"searchers: newest policy version received {s['searcher_max_version']}, restarts {s['searcher_restarts']}, "
        f"reward failures {s['reward_failures']}",
        f"run directory: {s['run_dir']}" + (f" (library logs: {Path(s['library_log']).name}, each warning shown "
                                            "above once)" if Path(s.get("library_log", "")).is_file() else ""),
    ]
    print("\n".join(lines), flush=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tba`` command; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: tba train CONFIG [overrides]   (tba train --help lists every config field)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "train":
        print(f"error: unknown command '{command}'; use 'tba train'", file=sys.stderr)
        return 2
    from tba.logger import remove_routes, route_console

    route_console()  # tba's lines, and each distinct library warning once; library logs go to the run dir
    try:
        return _train(rest)
    finally:
        remove_routes()


def _train(rest: list[str]) -> int:
    """``tba train REST``: runs and prints the summary, or prints one error line; returns the exit code."""
    from tba.models import ModelLoadError
    from tba.runtime.cadence import NoSamples, TooManySkippedSteps

    try:
        path, overrides, resume = parse_train_args(rest)
        cfg = load_config(path, overrides)
        signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM checkpoints and cleans up like Ctrl-C
        # a shell starts background jobs with SIGINT ignored; `kill -INT` must still stop such a run cleanly
        signal.signal(signal.SIGINT, signal.default_int_handler)
        summary = run_train(cfg, resume_dir=resume)
    except KeyboardInterrupt:
        print("\ninterrupted; all actors stopped", file=sys.stderr)
        return 130
    except TooManySkippedSteps as e:
        print(f"error: {e} (a checkpoint was saved)", file=sys.stderr)
        return 1
    except (ConfigError, ModelLoadError, NoSamples, OSError, ValueError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except Exception as e:  # noqa: BLE001 - one line for the user; the Ray traceback is already logged
        msg = str(e).strip().splitlines()
        print(f"error: {type(e).__name__}: {msg[-1] if msg else ''}", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
