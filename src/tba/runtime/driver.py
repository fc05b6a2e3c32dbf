"""The driver: starts the actors, runs the ONE training loop, checkpoints and resumes (docs/algorithm.md section 2).

Sync and async mode differ only in when generation happens: async searchers loop on their own from
:meth:`RayRuntime.start_searchers` on; in sync mode every searcher makes one batch with the current
weights right before each trainer step (k = 1, m = 1: the on-policy baseline).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path

import ray

from tba import checkpoint
from tba.config import Config
from tba.placement import resolve_placement
from tba.runtime.actors import BufferActor, SearcherActor
from tba.runtime.bootstrap import init_ray
from tba.runtime.cadence import Cadence, NoSamples, TooManySkippedSteps
from tba.runtime.state import RunState
from tba.runtime.supervisor import SearcherSupervisor
from tba.runtime.trainer_group import TrainerGroup

log = logging.getLogger(__name__)


def mode_config(cfg: Config) -> Config:
    """``cfg`` as the actors run it: sync mode samples only the newest batch (m = 1) and trains as soon as
    one batch is in (min_fill = 1)."""
    if cfg.run.mode != "sync":
        return cfg
    return cfg.model_copy(update={"buffer": cfg.buffer.model_copy(update={"on_policy_prob": 1.0, "min_fill": 1})})


class RayRuntime:
    """Starts the actors, runs the training loop, and always cleans up (a context manager).

    Args:
        cfg: the validated config.
        policy_path, ref_path: prepared model paths (see :func:`tba.models.prepare_model`).
        run_dir: where checkpoints go (the trainer actor writes its tensors there directly, so on a
            cluster it must be storage the trainer's node can reach), and where every actor that can reach
            it appends its libraries' log records (``third_party.log``, :mod:`tba.logger`).
        on_metrics: called as ``on_metrics(step, metrics)`` after every trainer step and mid-run eval.
        on_phase: called as ``on_phase(phase, step)`` when the run enters a phase: ``fill`` (waiting for
            ``buffer.min_fill``), ``step`` (a trainer step is in flight), ``publish``, ``eval``,
            ``checkpoint``, ``eval_after``... (see :class:`tba.logger.RunStatus`).

    A Ctrl-C / SIGTERM (KeyboardInterrupt) or :class:`TooManySkippedSteps` anywhere inside the ``with`` block
    saves a checkpoint on the way out, after recording a trainer step already in flight, so the trainer's
    and the driver's step agree and the checkpoint resumes exactly.
    """

    def __init__(self, cfg: Config, policy_path: str, ref_path: str, run_dir: str | Path, on_metrics=None,
                 on_phase=None):
        self.cfg = mode_config(cfg)
        self.policy_path, self.ref_path = policy_path, ref_path
        self.run_dir = Path(run_dir)
        self.on_metrics = on_metrics or (lambda step, m: None)
        self.on_phase = on_phase or (lambda phase, step: None)
        self.cadence = Cadence.from_config(cfg)
        self.state = RunState()
        self.actors: list = []  # buffer and trainer; the searchers are the supervisor's
        self._inflight = None  # the trainer step sent and not yet recorded
        self._t0 = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "RayRuntime":
        init_ray(self.cfg)
        try:
            # the GPUs of the cluster joined, or of this machine, decide the device and each role's share
            self.cfg = resolve_placement(self.cfg, ray.cluster_resources().get("GPU", 0))
            self._start_actors()
        except BaseException:
            self.__exit__()  # a failed start must not leave Ray running
            raise
        return self

    def _start_actors(self) -> None:
        c = self.cfg
        cfg_dict = c.model_dump()
        run_dir = str(self.run_dir)  # each actor appends its libraries' log records to run_dir/third_party.log
        self.buffer = BufferActor.options(num_cpus=0).remote(cfg_dict, run_dir)
        self.trainer = TrainerGroup(c, self.policy_path, self.ref_path, run_dir, c.run.startup_timeout_s)

        def new_searcher(i: int):
            return SearcherActor.options(num_cpus=c.searcher.threads, num_gpus=c.searcher.num_gpus,
                                         scheduling_strategy="SPREAD", max_concurrency=2).remote(
                cfg_dict, self.policy_path, self.ref_path, i, run_dir)

        self.actors = [self.buffer, *self.trainer.actors]
        self.searchers = SearcherSupervisor(new_searcher, c.searcher.num_searchers, self.buffer,
                                            c.searcher.stall_timeout_s)
        # Wait for every actor to be constructed: surfaces model/task errors from the workers now, and
        # turns a cluster too small to place them into an error instead of a hang.
        try:
            ray.get([self.buffer.__ray_ready__.remote(), *self.trainer.ready_refs(),
                     *[s.__ray_ready__.remote() for s in self.searchers]], timeout=c.run.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"actors not started after {c.run.startup_timeout_s:g} s: the cluster needs "
                f"{c.trainer.threads} CPU(s) and {c.trainer.num_gpus:g} GPU for the trainer "
                f"({c.trainer.num_workers} rank(s)) and "
                f"{c.searcher.threads} CPU(s) and {c.searcher.num_gpus:g} GPU per searcher x "
                f"{c.searcher.num_searchers}; see `ray status`") from None

    def __exit__(self, exc_type=None, exc=None, tb=None) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, TooManySkippedSteps)):
                self._save_on_stop()
        finally:
            self._shutdown()

    def _save_on_stop(self) -> None:
        """The checkpoint of an interrupted run (Ctrl-C again: quit without it)."""
        if not self.actors:
            return  # stopped while starting: nothing to save
        log.warning("saving a checkpoint (Ctrl-C again: quit without)")
        self._finish_inflight()
        self._drain_searchers()
        path = self.save_checkpoint()
        log.warning("saved checkpoint at step %d to %s (resume: tba train --resume %s)", self.state.step, path,
                    self.run_dir)

    def _shutdown(self) -> None:
        try:
            ray.get(self.buffer.set_stop.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - best effort; the kills below are what matter
            pass
        for a in [*self.actors, *getattr(self, "searchers", [])]:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if getattr(self, "trainer", None) is not None:
            self.trainer.kill()  # its ranks (killed above) and their placement group
        ray.shutdown()

    # -- the pieces the CLI calls ------------------------------------------------------------------
    def evaluate(self, phase: str = "eval") -> dict:
        """The task's held-out metrics for the trainer's current policy; ``phase`` names it in the status."""
        self.on_phase(phase, self.state.step)
        return self.trainer.evaluate()

    def save(self, path: str) -> str:
        """Save the trainer's policy (HF format)."""
        self.on_phase("save", self.state.step)
        return self.trainer.save(path)

    def searcher_nodes(self) -> list[str]:
        """Ray node id of each searcher."""
        return ray.get([s.node_id.remote() for s in self.searchers])

    def stats(self) -> dict:
        """Buffer and searcher counters (not drained)."""
        return ray.get(self.buffer.stats.remote(False))

    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of trainer, buffer, searcher cursors and run state; returns its folder.

        Written to a temporary folder and renamed into place, so a crash while saving keeps the previous one.
        """
        self.on_phase("checkpoint", self.state.step)
        tmp = checkpoint.begin(self.run_dir)
        self.trainer.save_checkpoint(str(tmp))
        # cursors before the buffer: a batch that lands in between is then generated again, never skipped
        checkpoint.write_json(tmp / "searchers.json", ray.get([s.state_dict.remote() for s in self.searchers]))
        checkpoint.write_json(tmp / "buffer.json", ray.get(self.buffer.state_dict.remote()))
        checkpoint.write_json(tmp / "driver.json", self.state.to_json())
        return checkpoint.commit(self.run_dir)

    def resume(self) -> RunState | None:
        """Load the run directory's checkpoint into the actors and publish the restored weights; returns the
        restored run state, or None for a run stopped before its first checkpoint (it starts over at step 0).

        Raises:
            CheckpointError: the checkpoint is incomplete or its parts disagree (checked again here, since the
                CLI's check ran before Ray started).
        """
        ckpt = checkpoint.find(self.run_dir)
        if ckpt is None:
            return None
        checkpoint.resumable_step(ckpt)
        step = self.trainer.load_checkpoint(str(ckpt))
        driver = checkpoint.read_json(ckpt / "driver.json")
        ray.get(self.buffer.load_state_dict.remote(checkpoint.read_json(ckpt / "buffer.json")))
        cursors = checkpoint.read_json(ckpt / "searchers.json")
        ray.get([s.load_state_dict.remote(c) for s, c in zip(self.searchers, cursors)])
        self.state = RunState(**driver)
        self._publish(step, reset=True)
        ray.get(self.buffer.sync.remote(self._recent_from(step)))
        return self.state

    def start_searchers(self) -> None:
        """Async mode: start every searcher's endless loop now (they fill the buffer during the first eval)."""
        if self.cfg.run.mode == "async":
            self.searchers.start()

    def train(self, progress=None) -> RunState:
        """Run until ``trainer.max_steps``; returns the run state. Stops the searchers at the end.

        Raises:
            TooManySkippedSteps: see :class:`tba.runtime.cadence.Cadence` (the checkpoint is saved on exit).
        """
        self._t0 = time.monotonic()
        self._loop(progress)
        ray.get(self.buffer.set_stop.remote())
        return self.state

    # -- the loop ----------------------------------------------------------------------------------
    def _loop(self, progress) -> None:
        c, st = self.cfg, self.state
        if c.run.mode == "async":
            self.on_phase("fill", st.step)
            self._wait_for_fill()
            if st.step == 0:
                ray.get(self.buffer.sync.remote(0))
        while st.step < c.trainer.max_steps:
            t_iter = time.monotonic()
            self._generate()
            self.on_phase("step", st.step)
            self._inflight = self.trainer.submit_step(self.buffer, c.trainer.prompts_per_step,
                                                      c.trainer.group_size)
            metrics = self.trainer.result(self._inflight)
            if metrics is None:  # the buffer is below buffer.min_fill (samples are never removed below it)
                self._inflight = None
                if c.run.mode == "sync":  # sync mode trains once a sample is in: this round added none
                    self._raise_no_samples()
                time.sleep(0.1)
                continue
            if self.cadence.publish_due(st.step + 1):
                self.on_phase("publish", st.step + 1)
                self._publish(st.step + 1)
                ray.get(self.buffer.sync.remote(self._recent_from(st.step + 1)))
            self._record(metrics, progress, time.monotonic() - t_iter)
            self._after_step(metrics)

    def _generate(self) -> None:
        """Sync mode: one batch per searcher with the current weights, made the recent set. Async mode:
        searchers generate on their own; restart any that died or stalled."""
        if self.cfg.run.mode == "sync":
            self.on_phase("generate", self.state.step)
            self.state.searcher_restarts += self.searchers.run_batches()
            # the recent set is exactly the batch just generated (every sample since the previous sync),
            # whichever version the searchers were served (trainer.generation_lag, searcher.receive_weights)
            ray.get(self.buffer.sync.remote(0))
        else:
            self.state.searcher_restarts += self.searchers.restart_dead()

    def _raise_no_samples(self) -> None:
        """Sync mode trains once the buffer holds a sample (:func:`mode_config`); a generation round that
        leaves it empty (every reward failed, failed samples dropped) would repeat forever.

        Raises:
            NoSamples: always: one line naming the cause, with the count and the newest reward error.
        """
        stats = ray.get(self.buffer.stats.remote(False))
        failures = int(stats["searcher/reward_failures_total"])
        last = next(filter(None, ray.get([s.last_reward_error.remote() for s in self.searchers])), None)
        raise NoSamples(f"sync mode: generation added no sample ({failures} rewards failed, last: {last}) and the "
                        "buffer is empty; searcher.failed_reward is null, so failed samples are dropped: fix the "
                        "reward, or set searcher.failed_reward")

    def _publish(self, version: int, reset: bool = False) -> None:
        if not self.cfg.searcher.receive_weights:
            return  # frozen searchers: the behaviour policy stays the initial one
        refs = self.trainer.publish()
        ray.get(self.buffer.publish.remote(version, refs, reset))

    def _recent_from(self, version: int) -> int:
        """The oldest policy version whose samples join the recent set at the publication of ``version``:
        ``version`` minus the sync period k, minus the L x k steps by which ``trainer.generation_lag`` holds
        the searchers' weights back; 0 with frozen searchers (every sample is of version 0)."""
        if not self.cfg.searcher.receive_weights:
            return 0
        return max(0, version - self.cadence.sync_period * (1 + self.cfg.trainer.generation_lag))

    def _record(self, metrics: dict, progress, loop_s: float) -> None:
        """Count and log one trainer step; ``loop_s``: wall seconds of its loop iteration (generation in sync
        mode, the step, weight publication), for ``perf/trainer_idle_frac``."""
        st = self.state
        metrics = {**ray.get(self.buffer.stats.remote()), **metrics,
                   "searcher/restarts": float(st.searcher_restarts), "perf/elapsed_s": time.monotonic() - self._t0}
        with _signals_deferred():  # counted and logged together, or neither (a stop then records it again)
            st.step += 1
            self._inflight = None
            st.record(metrics, loop_s)
            metrics["perf/trainer_idle_frac"] = st.trainer_idle_frac
            self.on_metrics(st.step, metrics)
        if progress is not None:
            progress(st.step, metrics)

    def _after_step(self, metrics: dict) -> None:
        """What the cadence asks for after a recorded step: a mid-run eval, the skip limit, a checkpoint."""
        st = self.state
        if self.cadence.eval_due(st.step):
            result = self.evaluate()
            self.on_metrics(st.step, {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))})
        st.consecutive_skips = self.cadence.count_skip(st.consecutive_skips, bool(metrics.get("train/skipped")))
        if self.cadence.checkpoint_due(st.step):
            self.save_checkpoint()

    def _finish_inflight(self) -> None:
        """After an interrupt: wait for the trainer step already sent (the trainer finishes it regardless)
        and record it, so the checkpoint's trainer and driver steps agree."""
        if self._inflight is None:
            return
        metrics = self.trainer.result(self._inflight)
        if metrics is not None and self.trainer.step_count() > self.state.step:
            self._record(metrics, None, 0.0)
        self._inflight = None

    def _drain_searchers(self) -> None:
        """Stop the searchers and wait (at most 300 s, or ``searcher.stall_timeout_s`` if shorter: a batch
        takes no longer) for the batch each is generating to reach the buffer, so a stop checkpoint skips
        no prompt a searcher has started."""
        ray.get(self.buffer.set_stop.remote())
        running = self.searchers.runs  # the loops (async) or one-batch calls (sync) in flight
        if running:
            ray.wait(running, num_returns=len(running), timeout=min(300.0, self.cfg.searcher.stall_timeout_s or 300.0))

    def _wait_for_fill(self) -> None:
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        while True:
            self.state.searcher_restarts += self.searchers.restart_dead()
            size = ray.get(self.buffer.stats.remote(False))["buffer/size"]
            if size >= self.cfg.buffer.min_fill:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"buffer holds {int(size)} samples after {self.cfg.run.startup_timeout_s:g} s, "
                                   f"below buffer.min_fill={self.cfg.buffer.min_fill}; lower it or raise "
                                   "run.startup_timeout_s")
            time.sleep(0.5)


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT and SIGTERM until the block ends (then their handlers run): for state changes that must
    happen together. Only the main thread can change its signal mask; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
