"""Searchers, replay buffer and trainer as Ray actors; the driver loop that wires them (TBA section 2).

The only module that imports ray. Locally it starts a loopback-only Ray instance with no dashboard;
with ``run.ray_address`` it joins an existing cluster and spreads the searchers over its nodes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

from tba import checkpoint
from tba.buffer import ReplayBuffer
from tba.config import Config

log = logging.getLogger(__name__)

MAX_SEARCHER_RESTARTS = 3  # per searcher, before the run gives up


@ray.remote
class BufferActor:
    """The replay buffer plus the weight board: newest published version and its object-store ref."""

    def __init__(self, capacity: int, on_policy_prob: float, inv_temp: float, seed: int, min_fill: int):
        self.buffer = ReplayBuffer(capacity, on_policy_prob, inv_temp, seed)
        self.min_fill = min_fill
        self.version, self.weights, self.stop = 0, None, False
        self.samples_added = 0
        self.reward_failures = 0
        self.searcher_versions: dict[int, int] = {}
        self.searcher_metrics: dict[str, list[float]] = {}

    def add(self, samples, metrics: dict, searcher_id: int, searcher_version: int) -> dict:
        """Store a searcher's samples; reply with the stop flag and newer weights if there are any."""
        self.buffer.add(samples)
        self.samples_added += len(samples)
        self.reward_failures += int(metrics.get("searcher/reward_failures", 0))
        self.searcher_versions[searcher_id] = searcher_version
        for k, v in metrics.items():
            self.searcher_metrics.setdefault(k, []).append(v)
        newer = self.weights if self.version > searcher_version else None
        return {"stop": self.stop, "version": self.version, "weights": newer}

    def publish(self, version: int, weights_ref: list) -> None:
        """Make ``weights_ref`` (a one-element list, so Ray does not resolve it) the newest policy."""
        self.version, self.weights = version, weights_ref

    def sync(self, min_version: int) -> int:
        """See :meth:`ReplayBuffer.sync`."""
        return self.buffer.sync(min_version)

    def sample(self, num_prompts: int, group_size: int, step: int):
        """A batch, or None while the buffer holds fewer than ``min_fill`` samples."""
        if len(self.buffer) < self.min_fill:
            return None
        return self.buffer.sample(num_prompts, group_size, step)

    def set_stop(self) -> None:
        """Searchers finish their current batch and return."""
        self.stop = True

    def state_dict(self) -> dict:
        """Buffer contents and sampling state plus counters (JSON-safe; weights are the trainer's)."""
        return {"buffer": self.buffer.state_dict(), "samples_added": self.samples_added,
                "reward_failures": self.reward_failures}

    def load_state_dict(self, state: dict) -> int:
        """Restore :meth:`state_dict`; returns the number of samples now held."""
        self.buffer.load_state_dict(state["buffer"])
        self.samples_added, self.reward_failures = state["samples_added"], state["reward_failures"]
        return len(self.buffer)

    def stats(self, drain: bool = True) -> dict:
        """Buffer stats, counters and the mean of searcher metrics since the last drain."""
        out = dict(self.buffer.stats())
        out["buffer/samples_added"] = float(self.samples_added)
        out["searcher/reward_failures_total"] = float(self.reward_failures)
        out["searcher/min_version"] = float(min(self.searcher_versions.values(), default=0))
        out["searcher/max_version"] = float(max(self.searcher_versions.values(), default=0))
        for k, vs in self.searcher_metrics.items():
            if vs:
                out[k] = sum(vs) / len(vs)
        if drain:
            self.searcher_metrics = {}
        return out


@ray.remote
class SearcherActor:
    """One searcher: generates with the newest weights it has, pushes samples, never waits for training."""

    def __init__(self, cfg: dict, policy_path: str, ref_path: str, searcher_id: int):
        from tba.runtime.build import build_searcher, quiet_libraries

        quiet_libraries()
        self.searcher = build_searcher(Config.model_validate(cfg), policy_path, ref_path, searcher_id)

    def node_id(self) -> str:
        """Ray node this searcher runs on."""
        return ray.get_runtime_context().get_node_id()

    def state_dict(self) -> dict:
        """Prompt cursor and RNG (answered while ``run`` is busy: the actor has two threads)."""
        return self.searcher.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` before ``run`` starts."""
        self.searcher.load_state_dict(state)

    def run(self, buffer, max_batches: int | None = None) -> int:
        """Loop: load newer weights if published -> generate a batch -> add it. Returns batches made."""
        s = self.searcher
        info = ray.get(buffer.add.remote([], {}, s.searcher_id, s.version))
        made = 0
        while not info["stop"] and (max_batches is None or made < max_batches):
            if info["weights"] is not None:
                s.load_weights(info["version"], ray.get(info["weights"][0]))
            samples, metrics = s.step()
            info = ray.get(buffer.add.remote(samples, metrics, s.searcher_id, s.version))
            made += 1
        return made


@ray.remote
class TrainerActor:
    """The trainer, and greedy evaluation of its current policy."""

    def __init__(self, cfg: dict, policy_path: str):
        from tba.runtime.build import build_trainer, generation_dtype, quiet_libraries, task_from_config

        quiet_libraries()
        self.cfg = Config.model_validate(cfg)
        self.trainer, self.tokenizer = build_trainer(self.cfg, policy_path)
        self.task = task_from_config(self.cfg)
        self.gen_dtype = generation_dtype(self.cfg)

    def train_step(self, buffer, num_prompts: int, group_size: int):
        """Sample a batch from the buffer and take one optimizer step; None if the buffer is not ready."""
        batch = ray.get(buffer.sample.remote(num_prompts, group_size, self.trainer.step_count))
        return None if batch is None else self.trainer.step(batch)

    def publish(self) -> list:
        """Put the current weights (generation dtype) in the object store; returns ``[ref]``."""
        return [ray.put(self.trainer.publish_weights(self.gen_dtype))]

    def evaluate(self) -> dict:
        """The task's held-out metrics for the current policy (greedy accuracy by default), on a copy in
        the generation dtype."""
        import copy

        from tba.engines.hf import HFEngine

        model = copy.deepcopy(self.trainer.model).to(self.gen_dtype).eval()
        result = self.task.evaluate(HFEngine(model, self.tokenizer), self.tokenizer, self.cfg.run.eval_batch_size,
                                    self.cfg.searcher.max_new_tokens)
        del model
        self.trainer.model.train()
        return result

    def save_checkpoint(self, directory: str) -> None:
        """Weights, optimizer, scheduler, step and RNG into ``directory`` (safetensors + JSON)."""
        t = self.trainer
        checkpoint.save_trainer(Path(directory), t.model, t.optimizer, t.scheduler,
                                {"step": t.step_count, "skipped_steps": t.skipped_steps})

    def load_checkpoint(self, directory: str) -> int:
        """Restore :meth:`save_checkpoint`; returns the trainer step."""
        t = self.trainer
        extra = checkpoint.load_trainer(Path(directory), t.model, t.optimizer, t.scheduler)
        t.step_count, t.skipped_steps = extra["step"], extra["skipped_steps"]
        return t.step_count

    def save(self, path: str) -> str:
        """Save the policy and tokenizer in Hugging Face format."""
        self.trainer.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path


def _loopback_only() -> None:
    """Keep Ray on 127.0.0.1: its single-machine switch (read by the driver at call time and by the daemons
    from the environment they inherit) binds every gRPC server to loopback and stops Ray from rewriting a
    loopback address into the machine's external IP."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def init_ray(cfg: Config) -> None:
    """Join ``run.ray_address``, or start a private local instance that listens on loopback only."""
    # MALLOC_ARENA_MAX: glibc's per-thread arenas otherwise inflate each worker's RSS by GBs of freed memory
    env = {"env_vars": {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
                        "MALLOC_ARENA_MAX": "2"}}
    if cfg.run.ray_address:
        host = cfg.run.ray_address.rsplit(":", 1)[0].strip("[]")
        loopback = host in ("localhost", "::1") or host.startswith("127.")
        if loopback:
            _loopback_only()
        ray.init(address=cfg.run.ray_address, runtime_env=env, logging_level=logging.WARNING,
                 **({"_node_ip_address": "127.0.0.1"} if loopback else {}))
        return
    _loopback_only()
    need = cfg.trainer.threads + cfg.searcher.num_searchers * cfg.searcher.threads + 1
    # address="local": always a private instance, never a cluster some other job left running
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
             _node_ip_address="127.0.0.1",
             runtime_env=env, logging_level=logging.WARNING, configure_logging=True)


@dataclass
class RunState:
    """What the driver tracks for the summary."""

    step: int = 0
    staleness_sum: float = 0.0
    staleness_max: float = 0.0
    searcher_restarts: int = 0
    consecutive_skips: int = 0
    train_s: float = 0.0  # seconds inside trainer steps ...
    loop_s: float = 0.0  # ... out of seconds of training loop (no evals or checkpoints): idle = 1 - train/loop
    extra: dict = field(default_factory=dict)  # e.g. eval_before, carried across resumes
    last: dict = field(default_factory=dict)

    @property
    def trainer_idle_frac(self) -> float | None:
        """Share of the training loop the trainer spent outside its steps (issue 4); None before a step."""
        return max(0.0, 1.0 - self.train_s / self.loop_s) if self.loop_s > 0 else None


class RayRuntime:
    """Starts the actors, runs the async (TBA) or sync (on-policy) loop, and always cleans up.

    Args:
        cfg: the validated config.
        policy_path, ref_path: prepared model paths (see :func:`tba.models.prepare_model`).
        run_dir: where checkpoints go (the trainer actor writes its tensors there directly, so on a
            cluster it must be storage the trainer's node can reach).
        on_metrics: called as ``on_metrics(step, metrics)`` after every trainer step.
    """

    def __init__(self, cfg: Config, policy_path: str, ref_path: str, run_dir: str | Path, on_metrics=None):
        self.cfg, self.policy_path, self.ref_path = cfg, policy_path, ref_path
        self.run_dir = Path(run_dir)
        self.on_metrics = on_metrics or (lambda step, m: None)
        self.state = RunState()
        self.actors: list = []

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "RayRuntime":
        init_ray(self.cfg)
        try:
            self._start_actors()
        except BaseException:
            self.__exit__()  # a failed start must not leave Ray running
            raise
        return self

    def _start_actors(self) -> None:
        c, sync = self.cfg, self.cfg.run.mode == "sync"
        self.cfg_dict = c.model_dump()
        self.buffer = BufferActor.options(num_cpus=0).remote(
            c.buffer.capacity_per_prompt, 1.0 if sync else c.buffer.on_policy_prob, c.buffer.inv_temp,
            c.run.seed, 1 if sync else c.buffer.min_fill)
        self.trainer = TrainerActor.options(num_cpus=c.trainer.threads).remote(self.cfg_dict, self.policy_path)
        self.searchers = [self._new_searcher(i) for i in range(c.searcher.num_searchers)]
        self.actors = [self.buffer, self.trainer, *self.searchers]
        # Wait for every actor to be constructed: surfaces model/task errors from the workers now, and
        # turns a cluster too small to place them into an error instead of a hang.
        try:
            ray.get([a.__ray_ready__.remote() for a in self.actors], timeout=c.run.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"actors not started after {c.run.startup_timeout_s:g} s: the cluster needs "
                f"{c.trainer.threads} CPU(s) for the trainer and {c.searcher.threads} per searcher "
                f"x {c.searcher.num_searchers}; see `ray status`") from None

    def __exit__(self, *exc) -> None:
        try:
            ray.get(self.buffer.set_stop.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - best effort; the kill below is what matters
            pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        ray.shutdown()

    def _new_searcher(self, i: int):
        return SearcherActor.options(num_cpus=self.cfg.searcher.threads, scheduling_strategy="SPREAD",
                                     max_concurrency=2).remote(self.cfg_dict, self.policy_path, self.ref_path, i)

    # -- the pieces the CLI calls ------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy eval of the trainer's current policy."""
        return ray.get(self.trainer.evaluate.remote())

    def save(self, path: str) -> str:
        """Save the trainer's policy (HF format)."""
        return ray.get(self.trainer.save.remote(path))

    def searcher_nodes(self) -> list[str]:
        """Ray node id of each searcher."""
        return ray.get([s.node_id.remote() for s in self.searchers])

    def stats(self) -> dict:
        """Buffer and searcher counters (not drained)."""
        return ray.get(self.buffer.stats.remote(False))

    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of trainer, buffer, searcher cursors and run state; returns its folder."""
        tmp = checkpoint.begin(self.run_dir)
        ray.get(self.trainer.save_checkpoint.remote(str(tmp)))
        checkpoint.write_json(tmp / "buffer.json", ray.get(self.buffer.state_dict.remote()))
        checkpoint.write_json(tmp / "searchers.json", ray.get([s.state_dict.remote() for s in self.searchers]))
        state = {k: v for k, v in asdict(self.state).items() if k != "last"}
        checkpoint.write_json(tmp / "driver.json", state)
        return checkpoint.commit(self.run_dir)

    def resume(self) -> RunState:
        """Load the run directory's checkpoint into the actors and publish the restored weights.

        Raises:
            FileNotFoundError: no checkpoint in the run directory.
        """
        ckpt = checkpoint.find(self.run_dir)
        step = ray.get(self.trainer.load_checkpoint.remote(str(ckpt)))
        ray.get(self.buffer.load_state_dict.remote(checkpoint.read_json(ckpt / "buffer.json")))
        cursors = checkpoint.read_json(ckpt / "searchers.json")
        ray.get([s.load_state_dict.remote(c) for s, c in zip(self.searchers, cursors)])
        driver = checkpoint.read_json(ckpt / "driver.json")
        self.state = RunState(**driver)
        if step != self.state.step:
            raise RuntimeError(f"checkpoint {ckpt} is inconsistent: trainer step {step}, run step {self.state.step}")
        self._publish(step)
        ray.get(self.buffer.sync.remote(max(0, step - self.cfg.trainer.sync_period)))
        return self.state

    def start_searchers(self) -> None:
        """Async mode: start every searcher's endless loop now (they fill the buffer during the eval)."""
        self.runs = []
        if self.cfg.run.mode == "async":
            self.runs = [s.run.remote(self.buffer) for s in self.searchers]

    def train(self, progress=None) -> RunState:
        """Run until ``trainer.max_steps`` in the configured mode; returns the run state.

        Ctrl-C / SIGTERM (KeyboardInterrupt) and too many non-finite steps in a row save a checkpoint
        first, then propagate.
        """
        self._t0 = time.monotonic()
        try:
            if self.cfg.run.mode == "sync":
                self._train_sync(progress)
            else:
                self._train_async(progress)
        except (KeyboardInterrupt, FloatingPointError):
            if self.state.step > 0:
                log.warning("saving a checkpoint once the current trainer step ends (Ctrl-C again: quit without)")
                path = self.save_checkpoint()
                log.warning("saved checkpoint at step %d to %s (resume: tba train --resume %s)",
                            self.state.step, path, self.run_dir)
            raise
        ray.get(self.buffer.set_stop.remote())
        return self.state

    # -- loops -------------------------------------------------------------------------------------
    def _train_async(self, progress) -> None:
        c = self.cfg
        k = c.trainer.sync_period
        self._wait_for_fill()
        if self.state.step == 0:
            ray.get(self.buffer.sync.remote(0))
        while self.state.step < c.trainer.max_steps:
            t_iter = time.monotonic()
            self._check_searchers()
            metrics = ray.get(self.trainer.train_step.remote(self.buffer, c.trainer.prompts_per_step,
                                                             c.trainer.group_size))
            if metrics is None:  # cannot happen after the fill (samples are never removed below it)
                time.sleep(0.1)
                continue
            self.state.step += 1
            if self.state.step % k == 0:
                self._publish(self.state.step)
                ray.get(self.buffer.sync.remote(self.state.step - k))
            self._record(metrics, progress, time.monotonic() - t_iter)

    def _train_sync(self, progress) -> None:
        c = self.cfg
        while self.state.step < c.trainer.max_steps:
            t_iter = time.monotonic()
            ray.get([s.run.remote(self.buffer, 1) for s in self.searchers])
            ray.get(self.buffer.sync.remote(self.state.step))  # only what this step's policy generated
            metrics = ray.get(self.trainer.train_step.remote(self.buffer, c.trainer.prompts_per_step,
                                                             c.trainer.group_size))
            self.state.step += 1
            self._publish(self.state.step)
            self._record(metrics, progress, time.monotonic() - t_iter)

    def _publish(self, version: int) -> None:
        refs = ray.get(self.trainer.publish.remote())
        ray.get(self.buffer.publish.remote(version, refs))

    def _record(self, metrics: dict, progress, loop_s: float) -> None:
        """Log one step. ``loop_s``: wall seconds of this step's loop iteration (generation in sync mode,
        the trainer step, weight publication and buffer sync), for ``perf/trainer_idle_frac`` (issue 4):
        the fraction of loop time the trainer was not computing a step, cumulative over the run."""
        st = self.state
        st.train_s += metrics.get("perf/train_step_s", 0.0)
        st.loop_s += loop_s
        stats = ray.get(self.buffer.stats.remote())
        metrics = {**stats, **metrics, "searcher/restarts": float(st.searcher_restarts),
                   "perf/elapsed_s": time.monotonic() - self._t0,
                   "perf/trainer_idle_frac": st.trainer_idle_frac}
        st.staleness_sum += metrics.get("buffer/staleness_mean", 0.0)
        st.staleness_max = max(st.staleness_max, metrics.get("buffer/staleness_max", 0.0))
        st.last = metrics
        self.on_metrics(st.step, metrics)
        if progress is not None:
            progress(st.step, metrics)
        every = self.cfg.run.eval_every
        if every and st.step % every == 0 and st.step < self.cfg.trainer.max_steps:
            result = self.evaluate()
            self.on_metrics(st.step, {f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))})
        st.consecutive_skips = st.consecutive_skips + 1 if metrics.get("train/skipped") else 0
        if st.consecutive_skips > self.cfg.trainer.max_consecutive_skips:
            raise FloatingPointError(f"{st.consecutive_skips} trainer steps in a row had a non-finite loss or "
                                     f"gradient (last loss metrics: { {k: v for k, v in metrics.items() if k.startswith('loss/')} }); "
                                     "lower trainer.lr or check the rewards")
        every = self.cfg.run.checkpoint_every
        if every and st.step % every == 0 and st.step < self.cfg.trainer.max_steps:
            self.save_checkpoint()

    def _wait_for_fill(self) -> None:
        deadline = time.monotonic() + self.cfg.run.startup_timeout_s
        while True:
            self._check_searchers()
            size = ray.get(self.buffer.stats.remote(False))["buffer/size"]
            if size >= self.cfg.buffer.min_fill:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"buffer holds {int(size)} samples after {self.cfg.run.startup_timeout_s:g} s, "
                                   f"below buffer.min_fill={self.cfg.buffer.min_fill}; lower it or raise "
                                   "run.startup_timeout_s")
            time.sleep(0.5)

    def _check_searchers(self) -> None:
        """Restart any searcher whose loop died (exception or killed process); the trainer keeps going."""
        if self.cfg.run.mode != "async":
            return
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            i = self.runs.index(ref)
            try:
                ray.get(ref)
                continue  # returned normally: only after stop
            except (ray.exceptions.RayError, Exception) as e:  # noqa: BLE001
                err = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            self.state.searcher_restarts += 1
            if self.state.searcher_restarts > MAX_SEARCHER_RESTARTS * len(self.searchers):
                raise RuntimeError(f"searchers failed {self.state.searcher_restarts} times; last error: {err}")
            log.warning("searcher %d died (%s); restarting it with the newest weights", i, err)
            try:
                ray.kill(self.searchers[i])
            except Exception:  # noqa: BLE001
                pass
            self.searchers[i] = self._new_searcher(i)
            self.actors.append(self.searchers[i])
            self.runs[i] = self.searchers[i].run.remote(self.buffer)
