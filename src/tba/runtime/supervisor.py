"""Keeps the searchers running: starts their loops and restarts any that dies (async mode)."""

from __future__ import annotations

import logging
from typing import Callable

import ray

log = logging.getLogger(__name__)

MAX_RESTARTS_PER_SEARCHER = 3  # in one process's lifetime, before the run gives up


class SearcherSupervisor:
    """The searcher actors and their endless ``run`` loops; iterating yields the current actors.

    Args:
        new_searcher: ``new_searcher(i)`` creates searcher actor ``i`` (its shard is fixed by ``i``).
        num_searchers: N.
        buffer: the buffer actor the loops push to.
    """

    def __init__(self, new_searcher: Callable[[int], object], num_searchers: int, buffer):
        self._new = new_searcher
        self.buffer = buffer
        self.actors = [new_searcher(i) for i in range(num_searchers)]
        self.runs: list = []
        self.restarts = 0

    def __iter__(self):
        return iter(self.actors)

    def __len__(self) -> int:
        return len(self.actors)

    def start(self) -> None:
        """Start every searcher's loop (it returns only after the buffer's stop flag)."""
        self.runs = [s.run.remote(self.buffer) for s in self.actors]

    def restart_dead(self) -> int:
        """Replace every searcher whose loop died (exception or killed process) by a fresh one that loads the
        newest weights; the trainer keeps going. Returns how many were restarted.

        Raises:
            RuntimeError: more than ``MAX_RESTARTS_PER_SEARCHER`` x N restarts in this process.
        """
        if not self.runs:
            return 0
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        restarted = 0
        for ref in done:
            err = _failure(ref)
            if err is None:
                continue  # returned normally: only after stop
            i = self.runs.index(ref)
            self.restarts += 1
            restarted += 1
            if self.restarts > MAX_RESTARTS_PER_SEARCHER * len(self.actors):
                raise RuntimeError(f"searchers failed {self.restarts} times; last error: {err}")
            log.warning("searcher %d died (%s); restarting it with the newest weights", i, err)
            try:
                ray.kill(self.actors[i])
            except Exception:  # noqa: BLE001 - already dead
                pass
            self.actors[i] = self._new(i)
            self.runs[i] = self.actors[i].run.remote(self.buffer)
        return restarted


def _failure(ref) -> str | None:
    """None if the finished loop returned normally, else the last line of its error."""
    try:
        ray.get(ref)
        return None
    except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError or the searcher's own exception
        text = str(e).strip()
        return text.splitlines()[-1] if text else type(e).__name__
