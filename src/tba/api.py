"""The Python API of a run: ``train(config)`` does what ``tba train`` does and returns the run's summary.

``tba.cli`` parses the command line, calls :func:`train` and prints the summary; the benchmarks call
:func:`train` directly. Torch, transformers and Ray are imported only once a run starts, so importing this
module (or ``from tba import train``) stays light. docs/python-api.md has an example.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from tba.config import Config, apply_overrides, dump_config, load_config


class RunSummary(TypedDict, total=False):
    """What :func:`train` returns: a plain dict, the same as ``RUN_DIR/summary.json``. Keys that depend on
    the config are absent when it turns them off (``eval_before``, ``eval_after``, ``final_model``, ...)."""

    run_dir: str  #: the run directory (config.yaml, metrics.jsonl, checkpoint/, final/, summary.json)
    task: str  #: the task's name, e.g. 'reasoning_gym:chain_sum'
    mode: str  #: 'async' or 'sync'
    loss: str  #: loss.name
    device: str  #: where the models ran: 'cpu' or 'cuda'
    library_log: str  #: RUN_DIR/third_party.log, the libraries' log records
    eval_before: dict[str, float]  #: the task's held-out metrics before training (e.g. accuracy, n, stderr)
    eval_after: dict[str, float]  #: the same after training
    eval_examples: list  #: a few eval prompts with the trained policy's responses
    final_model: str  #: the final policy in Hugging Face format (trainer.save_final)
    trainer_steps: int  #: optimizer steps taken (trainer.max_steps unless the run stopped early)
    samples_generated: int  #: samples the searchers added to the buffer
    searcher_max_version: int  #: the newest policy version a searcher received
    searcher_restarts: int  #: searchers restarted after a crash
    searcher_nodes: list[str]  #: the Ray nodes the searchers ran on
    reward_failures: int  #: reward calls that raised, timed out or returned a non-number
    sync_gap_warnings: int  #: sync checks that warned: log-prob gap over searcher.sync_gap_bound, or an engine that
    #: did not move with the trainer (0 = the weights arrived)
    staleness_mean: float  #: mean over steps of (trainer step - policy version of the trained samples)
    staleness_max: float  #: its largest value
    trainer_idle_frac: float  #: share of the training time the trainer waited for samples
    train_wall_s: float  #: seconds of the training loop
    wall_s: float  #: seconds of the whole call, model preparation and evals included
    learning_curve: str  #: RUN_DIR/learning_curve.png


def train(config: Config | str | os.PathLike | None = None, *, overrides: Mapping[str, Any] | None = None,
          resume_dir: str | os.PathLike | None = None, show_progress: bool = True) -> RunSummary:
    """Run one training job, as ``tba train`` does: check the input, start Ray (a private loopback instance
    unless ``run.ray_address``), evaluate before, train, evaluate after, save, shut Ray down.

    Args:
        config: a :class:`~tba.config.Config`, or the path of a YAML config file; None: the config of
            ``resume_dir`` (its ``config.yaml``) when resuming, else the defaults.
        overrides: dotted fields applied on top, validated like the file (``{"trainer.max_steps": 20}``).
        resume_dir: continue this run directory from its checkpoint up to ``trainer.max_steps``, appending
            to its metrics (a directory without a checkpoint yet starts at step 0).
        show_progress: a progress bar over trainer steps on stderr.

    Returns:
        the run's summary (:class:`RunSummary`, a plain dict), also written to ``RUN_DIR/summary.json``.

    Raises:
        ConfigError: an invalid config or override (the message names the field), before anything loads.
        FileNotFoundError: the config file, a model or a dataset does not exist.
        ModelLoadError, DataError, ValueError: a model or the task's data cannot be used, before Ray starts.
        OSError: ``run.output_dir`` cannot be created or written.
        TimeoutError: the actors or the initial buffer fill took longer than ``run.startup_timeout_s``.
        NoSamples: a sync-mode round left the buffer empty (every reward failed).
        TooManySkippedSteps: too many non-finite steps in a row (after saving a checkpoint).
        KeyboardInterrupt: Ctrl-C, or SIGTERM while Ray runs; a checkpoint was saved and every actor stopped.
    """
    cfg = _resolve(config, overrides, resume_dir)
    resume_dir = None if resume_dir is None else str(resume_dir)
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
        "sync_gap_warnings": int(stats["sync/gap_warnings"]),
        "staleness_mean": state.staleness_sum / max(1, state.step),
        "staleness_max": state.staleness_max,
        "trainer_idle_frac": state.trainer_idle_frac,
        "wall_s": time.monotonic() - t_start,
    })
    _plot(cfg, run_dir, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    status.set("done", state.step)
    return summary


def _resolve(config, overrides, resume_dir) -> Config:
    """The run's validated config from :func:`train`'s arguments."""
    if isinstance(config, Config):
        return apply_overrides(config, overrides)
    if config is None and resume_dir is not None:
        config = Path(resume_dir) / "config.yaml"
    return load_config(config, dict(overrides or {}))


def _prepare(cfg: Config, resume_dir: str | None):
    """Everything that can fail on bad input, before Ray starts: the engine's library, the device placement
    (GPUs asked for where there are none), the task and its data, the models, the prompts' lengths, the
    checkpoint to resume. Returns (task, policy path, reference path, run dir, the step a resumed run
    continues from or None)."""
    from tba.adapters import check_lora
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
    check_lora(policy_path, cfg.model.lora)
    if resume_dir:
        run_dir = Path(resume_dir)
    else:
        run_dir = Path(cfg.run.output_dir.format(task=task.name.replace(":", "-"), time=time.strftime("%Y%m%d-%H%M%S")))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a path under a regular file: one line naming the field, not "[Errno 20] ..."
        raise OSError(f"run.output_dir '{run_dir}' cannot be created: {e.strerror or e}") from None
    try:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    except OSError as e:
        raise OSError(f"run.output_dir '{run_dir}' is not writable: {e.strerror or e}") from None
    return task, policy_path, ref_path, run_dir, resume_step


def _run(cfg, policy_path, ref_path, run_dir, resume_dir, logger, status, summary: dict, show_progress: bool):
    """Start the runtime, resume, evaluate before, train, evaluate after and save; fills ``summary``.
    Returns (run state, buffer/searcher counters)."""
    from tba.placement import describe
    from tba.runtime import RayRuntime

    status.set("starting", 0)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        with RayRuntime(cfg, policy_path, ref_path, run_dir, on_metrics=logger.log, on_phase=status.set) as rt:
            # now that Ray runs: ray.init installs its own SIGTERM handler, which exits at once (no
            # checkpoint, actors left to the raylet); as KeyboardInterrupt the runtime's __exit__ saves
            if main_thread:
                signal.signal(signal.SIGTERM, raise_interrupt)
            print(describe(rt.cfg), flush=True)
            summary["device"] = rt.cfg.model.device
            if resume_dir:
                state = rt.resume()
                if state is None:
                    print(f"{run_dir} holds no checkpoint yet: starting at step 0", flush=True)
                else:
                    summary.update(state.extra)
                    print(f"resumed at trainer step {state.step} with {int(rt.stats()['buffer/size'])} samples in "
                          "the buffer", flush=True)
            rt.start_searchers()
            if cfg.run.eval_before and "eval_before" not in summary:
                summary["eval_before"] = rt.state.extra["eval_before"] = _numbers(rt.evaluate("eval_before"))
                print(f"eval before training: {_fmt_metrics(summary['eval_before'])}", flush=True)
            bar = _progress_bar(cfg.trainer.max_steps, f"loss/{cfg.loss.name}") if show_progress else None
            t_train = time.monotonic()
            try:
                state = rt.train(bar)
            finally:  # also when training stops with an error: the error line then starts a line of its own
                if bar is not None:
                    bar.close()
            summary["train_wall_s"] = time.monotonic() - t_train
            stats = rt.stats()
            summary["searcher_nodes"] = sorted(set(rt.searcher_nodes()))
            if cfg.run.eval_after:
                after = rt.evaluate("eval_after")
                summary["eval_after"], summary["eval_examples"] = _numbers(after), after.get("examples", [])
            if cfg.trainer.save_final:
                summary["final_model"] = rt.save(str(run_dir / "final"))
    finally:
        if main_thread and previous is not None:  # the caller's handler (the CLI's, a benchmark's) again
            signal.signal(signal.SIGTERM, previous)
    return state, stats


def raise_interrupt(signum, frame):
    """A SIGTERM handler: stop the run as Ctrl-C does (a checkpoint is saved, every actor stopped).

    Raises:
        KeyboardInterrupt: always.
    """
    raise KeyboardInterrupt


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


def _plot(cfg, run_dir: Path, summary: dict) -> None:
    from tba.logger import plot_learning_curve

    if (run_dir / "metrics.jsonl").stat().st_size:
        summary["learning_curve"] = str(plot_learning_curve(
            run_dir / "metrics.jsonl", run_dir / "learning_curve.png",
            ("searcher/reward_mean", "train/reward_mean", f"loss/{cfg.loss.name}", "buffer/staleness_mean"),
            summary.get("eval_before"), summary.get("eval_after")))


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
