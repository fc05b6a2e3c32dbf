"""The trainer as the driver sees it: one rank actor, or N in one process group (``trainer.num_workers``).

:class:`TrainerGroup` starts the rank actors (N > 1: packed on one node by a Ray placement group, one
bundle per rank) and fans each call out to all of them; rank 0's answer is the group's. A rank that dies or
whose call fails (a collective past ``trainer.collective_timeout_s``: a rank that hangs) ends the call at
once with :class:`TrainerRankError`, one line; the driver then stops the run without a new checkpoint, so
the last one stays intact and resumable.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tba import parallel
from tba.config import Config
from tba.runtime.actors import TrainerActor


class TrainerRankError(RuntimeError):
    """A trainer rank died, or its call failed (e.g. a collective timed out because another rank hangs)."""


@ray.remote(num_cpus=0)
def _free_port() -> int:
    """A free loopback port on the node this runs on (the ranks' node: it runs in their placement group)."""
    return parallel.free_port()


class PendingStep:
    """A trainer step sent to every rank and not yet collected (:meth:`TrainerGroup.result`)."""

    def __init__(self, refs: list):
        self.refs = refs


class TrainerGroup:
    """N trainer rank actors behind the interface the driver uses (train step, publish, evaluate, checkpoint,
    save, step count).

    Args:
        cfg: the run config (placement resolved: ``trainer.num_gpus`` is each rank's share times N).
        policy_path, ref_path, run_dir: as :class:`tba.runtime.actors.TrainerActor` takes them.
        timeout_s: seconds to wait for the placement group (``run.startup_timeout_s``).

    Raises:
        TimeoutError: the node cannot hold N ranks (one line naming the resources) within ``timeout_s``.
    """

    def __init__(self, cfg: Config, policy_path: str, ref_path: str, run_dir: str, timeout_s: float):
        t = cfg.trainer
        self.n = t.num_workers
        self.run_dir = run_dir
        self.straggle_s = t.collective_timeout_s
        self.pg = None
        gpus = (t.num_gpus or 0.0) / self.n
        options = {"num_cpus": t.threads, "num_gpus": gpus}
        if self.n == 1:
            self.actors = [TrainerActor.options(**options).remote(cfg.model_dump(), policy_path, ref_path, run_dir)]
            return
        bundle = {"CPU": float(t.threads), **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([bundle] * self.n, strategy="STRICT_PACK")  # one node: loopback rendezvous
        if not self.pg.wait(timeout_s):
            remove_placement_group(self.pg)
            raise TimeoutError(f"trainer.num_workers={self.n}: one node could not hold {self.n} ranks x "
                               f"{t.threads} CPU(s){f' and {gpus:g} GPU' if gpus else ''} within {timeout_s:g} s; "
                               "see `ray status`")
        port = ray.get(_free_port.options(scheduling_strategy=self._on(0)).remote())
        self.actors = [TrainerActor.options(**options, scheduling_strategy=self._on(i)).remote(
            cfg.model_dump(), policy_path, ref_path, run_dir, i, self.n, port) for i in range(self.n)]

    def _on(self, i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)

    # -- fan out, collect, fail fast --------------------------------------------------------------------
    def _collect(self, refs: list, what: str, straggle_s: float | None = None):
        """Wait for every rank's answer and return rank 0's; the first failure raises at once.

        Args:
            straggle_s: once one rank has answered, the others must within this many seconds (a trainer
                step: the ranks do the same work, so one still busy after the timeout of a collective hangs).

        Raises:
            TrainerRankError: a rank died, its call raised, or it straggled (the message names the rank).
        """
        index = {ref: i for i, ref in enumerate(refs)}
        pending, answers, deadline = list(refs), {}, None
        while pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not done:
                late = ", ".join(str(index[r]) for r in pending)
                raise TrainerRankError(f"trainer rank(s) {late} of {self.n} did not finish {what} within "
                                       f"{straggle_s:g} s of the others (trainer.collective_timeout_s): hung; the "
                                       f"run stops, its last checkpoint is intact: tba train --resume {self.run_dir}")
            if deadline is None and straggle_s is not None:
                deadline = time.monotonic() + straggle_s
            for ref in done:
                try:
                    answers[index[ref]] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - RayActorError (died) or RayTaskError (raised)
                    raise TrainerRankError(self._describe(index[ref], what, e)) from None
        return answers[0]

    def _describe(self, i: int, what: str, e: Exception) -> str:
        died = isinstance(e, ray.exceptions.RayActorError)
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        cause = "its process died" if died else (lines[-1] if lines else type(e).__name__)
        who = "the trainer" if self.n == 1 else f"trainer rank {i} of {self.n}"
        return (f"{who} failed during {what} ({cause[:300]}); the run stops, its last checkpoint is intact: "
                f"tba train --resume {self.run_dir}")

    def _all(self, method: str, *args):
        return self._collect([getattr(a, method).remote(*args) for a in self.actors], method)

    # -- the driver's interface ---------------------------------------------------------------------------
    def ready_refs(self) -> list:
        """Refs that resolve once every rank is constructed (``__ray_ready__``)."""
        return [a.__ray_ready__.remote() for a in self.actors]

    def submit_step(self, buffer, num_prompts: int, group_size: int) -> PendingStep:
        """Send one trainer step: the batch is drawn from ``buffer`` once, and every rank gets it whole."""
        if self.n == 1:
            return PendingStep([self.actors[0].train_step.remote(buffer, num_prompts, group_size)])
        batch = buffer.sample.remote(num_prompts, group_size, self.step_count())
        return PendingStep([a.train_batch.remote(batch) for a in self.actors])

    def result(self, pending: PendingStep) -> dict | None:
        """Rank 0's metrics of a :meth:`submit_step` (None: the buffer was not ready).

        Raises:
            TrainerRankError: see :meth:`_collect`.
        """
        return self._collect(pending.refs, "a trainer step", self.straggle_s)

    def publish(self) -> list:
        """The current weights in the object store, ``[ref]`` (rank 0's pack)."""
        return self._all("publish")

    def evaluate(self) -> dict:
        """The task's held-out metrics of the current policy (rank 0's eval)."""
        return self._all("evaluate")

    def step_count(self) -> int:
        """Optimizer steps taken (rank 0's count; every rank's is the same)."""
        return self._collect([self.actors[0].step_count.remote()], "step_count")

    def save_checkpoint(self, directory: str) -> None:
        """The trainer's part of a checkpoint into ``directory`` (every rank takes part)."""
        self._all("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> int:
        """Restore :meth:`save_checkpoint` on every rank; returns the trainer step."""
        return self._all("load_checkpoint", directory)

    def save(self, path: str) -> str:
        """The final policy in Hugging Face format (rank 0 writes it)."""
        return self._all("save", path)

    def pids(self) -> list[int]:
        """Each rank's process id, in rank order."""
        return self._all_answers("pid")

    def _all_answers(self, method: str) -> list:
        return [ray.get(getattr(a, method).remote()) for a in self.actors]

    def kill(self) -> None:
        """Kill every rank and free the placement group (best effort: some may be dead already)."""
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - Ray already shut down
                pass
