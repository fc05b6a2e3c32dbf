"""Keeps the searchers running: starts their loops, restarts any that dies, and treats one that delivers
nothing for ``searcher.stall_timeout_s`` (a hung engine or reward) as dead."""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray

log = logging.getLogger(__name__)

MAX_RESTARTS_PER_SEARCHER = 3  # in one process's lifetime, before the run gives up


class SearcherSupervisor:
    """The searcher actors and their ``run`` loops; iterating yields the current actors.

    Args:
        new_searcher: ``new_searcher(i)`` creates searcher actor ``i`` (its shard is fixed by ``i``).
        num_searchers: N.
        buffer: the buffer actor the loops push to (its ``last_seen``: each searcher's newest call).
        stall_timeout_s: seconds without a call to the buffer (a delivered batch, or the call a loop
            starts with) after which a searcher counts as hung; None: never.
    """

    def __init__(self, new_searcher: Callable[[int], object], num_searchers: int, buffer,
                 stall_timeout_s: float | None = None):
        self._new = new_searcher
        self.buffer = buffer
        self.stall_timeout_s = stall_timeout_s
        self.actors = [new_searcher(i) for i in range(num_searchers)]
        self._started = [time.time()] * num_searchers  # when each actor's current loop was started
        # a replacement's construction (loading its models) is not a stall: its clock starts once it is ready
        self._ready: list = [None] * num_searchers
        self.runs: list = []
        self.restarts = 0

    def __iter__(self):
        return iter(self.actors)

    def __len__(self) -> int:
        return len(self.actors)

    def start(self) -> None:
        """Start every searcher's endless loop (async mode; it returns only after the buffer's stop flag)."""
        self.runs = [s.run.remote(self.buffer) for s in self.actors]
        self._started = [time.time()] * len(self.actors)

    def run_batches(self) -> int:
        """Sync mode: one batch from every searcher, each with the weights it is served. A searcher that
        has delivered nothing after ``stall_timeout_s`` is replaced and asked again. Returns the restarts.

        Raises:
            RuntimeError: too many restarts (see :meth:`replace`); a searcher's own error propagates.
        """
        todo, restarted = list(range(len(self.actors))), 0
        while todo:
            # a replacement first loads its models; its batch's clock starts when it is ready
            ray.get([self._ready[i] for i in todo if self._ready[i] is not None])
            for i in todo:
                self._ready[i] = None
            calls = {i: self.actors[i].run.remote(self.buffer, 1) for i in todo}
            self.runs = list(calls.values())
            _, late = ray.wait(self.runs, num_returns=len(self.runs), timeout=self.stall_timeout_s)
            ray.get([ref for ref in self.runs if ref not in late])
            todo = [i for i, ref in calls.items() if ref in late]
            for i in todo:
                restarted += self.replace(i, f"no batch in {self.stall_timeout_s:g} s (searcher.stall_timeout_s)",
                                          start=False)
        self.runs = []
        return restarted

    def restart_dead(self) -> int:
        """Async mode: replace every searcher whose loop died (exception or killed process) or stalled (no
        call to the buffer for ``stall_timeout_s``) by a fresh one that loads the newest weights; the
        trainer keeps going. Returns how many were restarted.

        Raises:
            RuntimeError: too many restarts (see :meth:`replace`).
        """
        if not self.runs:
            return 0
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        restarted = 0
        for ref in done:
            err = _failure(ref)
            if err is not None:  # None: returned normally, only after stop
                restarted += self.replace(self.runs.index(ref), err)
        if self.stall_timeout_s is not None:
            seen, now = ray.get(self.buffer.last_seen.remote()), time.time()
            for i in range(len(self.actors)):
                if self._ready[i] is not None:  # a replacement still loading: its clock starts once ready
                    if not ray.wait([self._ready[i]], timeout=0)[0]:
                        continue
                    self._ready[i], self._started[i] = None, now
                quiet = now - max(seen.get(i, 0.0), self._started[i])
                if quiet > self.stall_timeout_s:
                    restarted += self.replace(i, f"no batch for {quiet:.0f} s (searcher.stall_timeout_s "
                                                 f"{self.stall_timeout_s:g})")
        return restarted

    def replace(self, i: int, reason: str, start: bool = True) -> int:
        """Kill searcher ``i`` (if still alive) and create a fresh one, logging ``reason``; with ``start``
        its loop is started. Returns 1 (the restart to count).

        Raises:
            RuntimeError: more than ``MAX_RESTARTS_PER_SEARCHER`` x N restarts in this process.
        """
        self.restarts += 1
        if self.restarts > MAX_RESTARTS_PER_SEARCHER * len(self.actors):
            raise RuntimeError(f"searchers failed {self.restarts} times; last error: {reason}")
        log.warning("searcher %d died (%s); restarting it with the newest weights", i, reason)
        try:
            ray.kill(self.actors[i])
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.actors[i] = self._new(i)
        self._started[i], self._ready[i] = time.time(), self.actors[i].__ray_ready__.remote()
        if start:
            self.runs[i] = self.actors[i].run.remote(self.buffer)
        return 1


def _failure(ref) -> str | None:
    """None if the finished loop returned normally, else the last line of its error."""
    try:
        ray.get(ref)
        return None
    except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError or the searcher's own exception
        text = str(e).strip()
        return text.splitlines()[-1] if text else type(e).__name__
