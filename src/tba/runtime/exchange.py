"""What searchers and the trainer exchange through the buffer actor, as plain objects (no Ray).

The buffer actor holds the replay buffer, a :class:`WeightBoard` and a :class:`SearcherMetrics`, so one
round trip of a searcher both delivers its samples and fetches newer weights; it answers with an
:class:`AddReply`.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any


class WeightBoard:
    """The policy version searchers are served and its handle (an object-store reference, opaque here).

    Args:
        lag: serve the weights published ``lag`` publications before the newest (``trainer.generation_lag``:
            staleness without extra reuse, for off-policy studies); 0 serves the newest. Until that many
            publications exist, searchers keep the initial weights (version 0); after a resume
            (``publish(..., reset=True)``) the window refills from the resumed version.
    """

    def __init__(self, lag: int = 0) -> None:
        # (version, handle), oldest first; version 0 is the initial policy every searcher starts with
        self._kept: collections.deque = collections.deque([(0, None)], maxlen=lag + 1)

    @property
    def version(self) -> int:
        """The version searchers are served (trainer steps taken when it was published)."""
        return self._kept[0][0]

    def publish(self, version: int, handle: Any, reset: bool = False) -> None:
        """Add ``handle`` as the weights of policy ``version``; ``reset`` forgets the older ones (a resume)."""
        if reset:
            self._kept.clear()
        self._kept.append((version, handle))

    def newer_than(self, version: int) -> Any:
        """The served handle if it is newer than ``version``, else None."""
        served, handle = self._kept[0]
        return handle if served > version and handle is not None else None


@dataclass(frozen=True)
class AddReply:
    """The buffer actor's answer to a searcher's ``add`` (what ``SearcherActor.run`` acts on next).

    Attributes:
        stop: the run is ending (``BufferActor.set_stop``): the searcher makes no further batch and returns.
        version: the policy version searchers are served now (:attr:`WeightBoard.version`: trainer steps
            taken when it was published; 0 is the initial policy), whether or not ``weights`` is set.
        weights: the handle of the weights of ``version`` (as published: a one-element list holding the
            object-store reference of a ``PackedWeights``) when ``version`` is newer than the version the
            searcher reported; None when the searcher already has them.
    """

    stop: bool
    version: int
    weights: Any = None


class SearcherMetrics:
    """Counters over the run and searcher metrics averaged between two drains (one per trainer step)."""

    def __init__(self) -> None:
        self.samples_added = 0
        self.reward_failures = 0
        self.gap_warnings = 0  # sync checks over searcher.sync_gap_bound (each batch reports its new ones)
        self.versions: dict[int, int] = {}  # searcher id -> policy version it generated its last batch with
        self.last_seen: dict[int, float] = {}  # searcher id -> wall time (time.time()) of its newest call
        self._pending: dict[str, list[float]] = {}

    def add(self, n_samples: int, metrics: dict[str, float], searcher_id: int, version: int) -> None:
        """Count one searcher batch of ``n_samples`` with its ``searcher/*`` and ``sync/*`` metrics; the empty
        call a searcher makes when it (re)starts, before its first batch, leaves its version as it was.
        ``sync/gap_warnings`` (the batch's new warnings) is added to the run's count, not averaged."""
        self.last_seen[searcher_id] = time.time()
        self.samples_added += n_samples
        self.reward_failures += int(metrics.get("searcher/reward_failures", 0))
        self.gap_warnings += int(metrics.get("sync/gap_warnings", 0))
        if n_samples or metrics:  # a (re)started searcher's first call (no batch yet) generated nothing
            self.versions[searcher_id] = version
        for k, v in metrics.items():
            if k != "sync/gap_warnings":
                self._pending.setdefault(k, []).append(v)

    def summary(self, drain: bool) -> dict[str, float]:
        """Run counters, the oldest/newest searcher policy version, and each metric's mean since the last
        drain (emptied when ``drain``)."""
        out = {"buffer/samples_added": float(self.samples_added),
               "searcher/reward_failures_total": float(self.reward_failures),
               "sync/gap_warnings": float(self.gap_warnings),
               "searcher/min_version": float(min(self.versions.values(), default=0)),
               "searcher/max_version": float(max(self.versions.values(), default=0))}
        out.update({k: sum(vs) / len(vs) for k, vs in self._pending.items() if vs})
        if drain:
            self._pending = {}
        return out

    def state_dict(self) -> dict:
        """Run counters (JSON-safe) for checkpoints."""
        return {"samples_added": self.samples_added, "reward_failures": self.reward_failures,
                "gap_warnings": self.gap_warnings}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a checkpoint older than the sync check: no warnings)."""
        self.samples_added, self.reward_failures = state["samples_added"], state["reward_failures"]
        self.gap_warnings = state.get("gap_warnings", 0)
