"""Replay buffer: per-prompt groups of scored responses, and the TBA batch-sampling rule.

Source: docs/algorithm.md section 3 / TBA paper (arXiv 2503.18929). Samples are grouped by ``prompt_id``;
a batch mixes an "on-policy" branch (prompts whose samples arrived at the most recent weight sync, their
newest samples) and an off-policy branch (all prompts so far, responses by softmax(inv_temp * reward)).

Async semantics in brief. Searchers call :meth:`ReplayBuffer.add` whenever they finish a batch. Every
time the trainer publishes weights (every k trainer steps) it calls ``sync(published_step - k)``: the
prompts that received samples since the previous sync, restricted to samples with
``policy_version >= published_step - k``, become the "recent" set the on-policy branch draws from until
the next sync. Those samples are used at trainer steps ``published_step .. published_step + k - 1``, so
their staleness ``step - policy_version`` is at most ``2k - 1`` (plus L x k with ``trainer.generation_lag``
L, where the driver syncs from ``published_step - k - L x k``). Imports only ``tba.types``, ``tba.config``
and the standard library; the Ray actor serving it lives in ``tba.runtime``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from tba.config import BufferConfig
from tba.types import Batch, Sample

_STATE_FORMAT = 1


def _plain(x: Any) -> Any:
    """Turn numpy/torch scalars and arrays (anything with ``tolist``) into JSON-friendly Python values."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    return x


class _Group:
    """All stored responses to one prompt.

    ``entries`` maps an insertion sequence number to its sample; dict order is insertion order, which is
    also increasing ``seq`` order. ``by_response`` maps ``tuple(response_ids)`` to the seq holding it, for
    deduplication.
    """

    __slots__ = ("entries", "by_response")

    def __init__(self) -> None:
        self.entries: dict[int, Sample] = {}
        self.by_response: dict[tuple[int, ...], int] = {}


class ReplayBuffer:
    """Per-prompt replay buffer with TBA's recency / reward-prioritised sampling (docs/algorithm.md section 3).

    Not thread-safe: one owner (the buffer's Ray actor, or a test) calls it.

    Args:
        cfg: the ``buffer`` config section: ``capacity_per_prompt`` (most responses kept per prompt; paper
            100), ``on_policy_prob`` m (probability that each prompt of a batch comes from the recent set;
            paper 0.95 for GSM8K, 0.5-0.6 for red-teaming) and ``inv_temp`` (inverse temperature of the
            off-policy branch's softmax(inv_temp * reward) response weights; 0 is exactly uniform (GSM8K),
            1 the paper's "reward-prioritised sampling" (TL;DR)). Ranges are checked by the config.
        seed: seed of the buffer's own ``random.Random``; all sampling randomness comes from it.
    """

    def __init__(self, cfg: BufferConfig, seed: int) -> None:
        self.capacity_per_prompt = cfg.capacity_per_prompt
        self.on_policy_prob = cfg.on_policy_prob
        self.inv_temp = cfg.inv_temp
        self._rng = random.Random(seed)
        self._reset()

    def _reset(self) -> None:
        self._groups: dict[int, _Group] = {}
        self._size = 0
        self._next_seq = 0
        # prompt_id -> seqs added since the last sync (still stored), in insertion order
        self._pending: dict[int, list[int]] = {}
        # prompt_id -> seqs that count as recent (set by the last effective sync, still stored)
        self._recent: dict[int, list[int]] = {}
        # cursors: a shuffled pass over the recent set, and a shuffled epoch over all prompts
        self._recent_order: list[int] = []
        self._recent_pos = 0
        self._epoch_order: list[int] = []
        self._epoch_pos = 0
        # seq -> times the sample was drawn into a training batch (reuse, logged beside staleness)
        self._draws: dict[int, int] = {}

    def add(self, samples: list[Sample]) -> int:
        """Store scored responses, deduplicating and evicting per prompt (docs/algorithm.md section 3).

        A response whose ``response_ids`` equal a stored response of the same prompt replaces it (the
        copy being added wins, and counts as newly added). When a prompt then holds more than
        ``capacity_per_prompt`` responses, the oldest by ``policy_version`` are evicted (ties: earliest
        inserted first); this may evict a sample of this very call when it is the oldest.
        Every stored sample of this call is marked "added since the last sync" for :meth:`sync`.

        Args:
            samples: responses in any prompt order; the objects are stored, not copied.

        Returns:
            How many samples of this call are stored when it returns (after dedup and eviction).

        Raises:
            TypeError: an element is not a :class:`~tba.types.Sample`.
        """
        added: list[tuple[int, int]] = []
        for s in samples:
            if not isinstance(s, Sample):
                raise TypeError(f"ReplayBuffer.add expects tba.types.Sample, got {type(s).__name__}")
            added.append((s.prompt_id, self._insert(s)))
        return sum(1 for pid, seq in added if seq in self._groups[pid].entries)

    def _insert(self, s: Sample) -> int:
        """Insert one sample (dedup, then evict to capacity); returns its seq."""
        pid = s.prompt_id
        group = self._groups.setdefault(pid, _Group())
        key = tuple(s.response_ids)
        old = group.by_response.get(key)
        if old is not None:
            self._remove(pid, old)
        seq = self._next_seq
        self._next_seq += 1
        group.entries[seq] = s
        group.by_response[key] = seq
        self._pending.setdefault(pid, []).append(seq)
        self._size += 1
        while len(group.entries) > self.capacity_per_prompt:
            oldest = min(group.entries, key=lambda q: (group.entries[q].policy_version, q))
            self._remove(pid, oldest)
        return seq

    def _remove(self, pid: int, seq: int) -> None:
        """Drop one stored sample and every reference to it (pending list, recent set)."""
        group = self._groups[pid]
        s = group.entries.pop(seq)
        del group.by_response[tuple(s.response_ids)]
        self._draws.pop(seq, None)
        self._size -= 1
        pending = self._pending.get(pid)
        if pending is not None and seq in pending:
            pending.remove(seq)
            if not pending:
                del self._pending[pid]
        recent = self._recent.get(pid)
        if recent is not None and seq in recent:
            recent.remove(seq)
            if not recent:  # the on-policy cursor skips prompts no longer in the set
                del self._recent[pid]

    def sync(self, min_version: int) -> int:
        """Start a new "recent" set; call each time the trainer publishes weights (docs/algorithm.md section 3).

        The trainer publishing version ``v`` every k steps calls ``sync(v - k)``. The new recent set is the
        prompts that received, since the previous sync, a sample with ``policy_version >= min_version``; for
        each, exactly those samples are recent. Samples added since the previous sync stop being "pending",
        qualified or not. If no prompt qualifies, the previous recent set is kept so the on-policy branch
        never starves (the 2k - 1 bound then holds once fresh samples arrive again).

        Args:
            min_version: oldest policy version (trainer step) that still counts as recent.

        Returns:
            Number of prompts in the recent set in effect after the call (the kept one if none qualified).
        """
        new: dict[int, list[int]] = {}
        for pid, seqs in self._pending.items():
            entries = self._groups[pid].entries
            fresh = [q for q in seqs if entries[q].policy_version >= min_version]
            if fresh:
                new[pid] = fresh
        self._pending = {}
        if new:
            self._recent = new
            self._recent_order, self._recent_pos = [], 0  # reshuffled at the next on-policy draw
        return len(self._recent)

    def sample(self, num_prompts: int, group_size: int, step: int) -> Batch:
        """Draw a training batch of B prompts x K responses, group-major (docs/algorithm.md section 3).

        For each of the B prompts independently: with probability ``on_policy_prob`` (and only when the
        recent set is non-empty) take the next prompt of a shuffled pass over the recent set and its K
        newest recent samples by ``policy_version`` (ties: latest inserted first), topping up with
        uniform draws with replacement from its recent samples when it has fewer than K. Otherwise
        take the next prompt of a shuffled epoch over all prompts seen so far (prompts added
        mid-epoch join the next epoch) and draw K of its samples with probability
        softmax(inv_temp * reward): without replacement when it holds >= K samples, else with
        replacement. Both passes reshuffle when exhausted, so a prompt can repeat within a batch only
        when B exceeds the number of prompts left in the pass.

        Args:
            num_prompts: B >= 1.
            group_size: K >= 1, responses per prompt.
            step: the trainer step this batch is for; staleness is ``step - policy_version``.

        Returns:
            ``Batch(samples=B*K stored Sample objects, group_size=K, metrics)`` with metrics
            ``buffer/staleness_mean`` / ``_min`` / ``_max`` (trainer steps, over the B*K samples),
            ``buffer/on_policy_frac`` (fraction of the B prompts drawn from the recent set) and
            ``buffer/reuse_mean`` / ``buffer/reuse_max`` (over the B*K entries: how many times that sample
            has been drawn for training, this batch included; 1 = first use).

        Raises:
            ValueError: the buffer is empty, or B or K is < 1.
        """
        if num_prompts < 1 or group_size < 1:
            raise ValueError(
                "num_prompts and group_size must be >= 1, "
                f"got num_prompts={num_prompts}, group_size={group_size}"
            )
        if self._size == 0:
            raise ValueError("cannot sample from an empty ReplayBuffer: add samples first")
        out: list[Sample] = []
        on_policy = 0
        for _ in range(num_prompts):
            take_recent = self._rng.random() < self.on_policy_prob
            if take_recent and self._recent:
                on_policy += 1
                out.extend(self._draw_recent(self._next_recent_prompt(), group_size))
            else:
                out.extend(self._draw_weighted(self._next_epoch_prompt(), group_size))
        staleness = [step - s.policy_version for s in out]
        reuse = self._count_draws(out)
        metrics = {
            "buffer/staleness_mean": sum(staleness) / len(staleness),
            "buffer/staleness_min": float(min(staleness)),
            "buffer/staleness_max": float(max(staleness)),
            "buffer/on_policy_frac": on_policy / num_prompts,
            "buffer/reuse_mean": sum(reuse) / len(reuse),
            "buffer/reuse_max": float(max(reuse)),
        }
        return Batch(samples=out, group_size=group_size, metrics=metrics)

    def _count_draws(self, drawn: list[Sample]) -> list[int]:
        """Count a draw per entry of ``drawn``; returns each entry's draws so far, this one included."""
        seqs = [self._groups[s.prompt_id].by_response[tuple(s.response_ids)] for s in drawn]
        for q in seqs:
            self._draws[q] = self._draws.get(q, 0) + 1
        return [self._draws[q] for q in seqs]

    def _next_recent_prompt(self) -> int:
        """Next prompt of the shuffled pass over the recent set (caller checks it is non-empty)."""
        while True:
            while self._recent_pos < len(self._recent_order):
                pid = self._recent_order[self._recent_pos]
                self._recent_pos += 1
                if pid in self._recent:
                    return pid
            self._recent_order = sorted(self._recent)
            self._rng.shuffle(self._recent_order)
            self._recent_pos = 0

    def _next_epoch_prompt(self) -> int:
        """Next prompt of the shuffled epoch over all prompts (groups never become empty)."""
        if self._epoch_pos >= len(self._epoch_order):
            self._epoch_order = sorted(self._groups)
            self._rng.shuffle(self._epoch_order)
            self._epoch_pos = 0
        pid = self._epoch_order[self._epoch_pos]
        self._epoch_pos += 1
        return pid

    def _draw_recent(self, pid: int, k: int) -> list[Sample]:
        """K newest recent samples of ``pid``; uniform with replacement for the shortfall."""
        entries = self._groups[pid].entries
        seqs = sorted(self._recent[pid], key=lambda q: (entries[q].policy_version, q), reverse=True)
        picked = seqs[:k]
        if len(picked) < k:
            picked += self._rng.choices(seqs, k=k - len(picked))
        return [entries[q] for q in picked]

    def _draw_weighted(self, pid: int, k: int) -> list[Sample]:
        """K samples of ``pid`` with probability softmax(inv_temp * reward)."""
        pool = list(self._groups[pid].entries.values())
        if self.inv_temp == 0.0:  # exact uniform, no float weights involved
            return self._rng.sample(pool, k) if len(pool) >= k else self._rng.choices(pool, k=k)
        weights = self._softmax_weights(pool)
        if len(pool) < k:
            return self._rng.choices(pool, weights=weights, k=k)
        picked = []
        for _ in range(k):  # successive draws, renormalised over what is left
            i = self._rng.choices(range(len(pool)), weights=weights)[0]
            picked.append(pool.pop(i))
            weights.pop(i)
        return picked

    def _softmax_weights(self, pool: list[Sample]) -> list[float]:
        """Unnormalised softmax(inv_temp * reward) weights, max-shifted; uniform if rewards are unusable."""
        rewards = [float(s.reward) for s in pool]
        finite = [r for r in rewards if math.isfinite(r)]
        if not finite:
            return [1.0] * len(pool)
        top = max(finite)
        weights = [math.exp(self.inv_temp * (r - top)) if not math.isnan(r) else 0.0 for r in rewards]
        return weights if sum(weights) > 0.0 else [1.0] * len(pool)

    def responses(self, prompt_id: int) -> list[Sample]:
        """The samples stored for ``prompt_id`` in insertion order (empty if none): a read-only view for logs
        and tests."""
        group = self._groups.get(prompt_id)
        return list(group.entries.values()) if group is not None else []

    def __len__(self) -> int:
        """Total number of stored samples, over all prompts."""
        return self._size

    @property
    def num_prompts(self) -> int:
        """Number of prompts holding at least one sample."""
        return len(self._groups)

    def stats(self) -> dict[str, float]:
        """Gauges for logging, O(stored samples): ``buffer/size`` (samples), ``buffer/prompts``,
        ``buffer/recent_prompts``, ``buffer/recent_samples``, ``buffer/pending_samples`` (added since the last
        sync), ``buffer/largest_group`` (at most the capacity) and, when non-empty, ``buffer/version_min`` /
        ``buffer/version_max`` (trainer steps)."""
        out = {
            "buffer/size": float(self._size),
            "buffer/prompts": float(len(self._groups)),
            "buffer/recent_prompts": float(len(self._recent)),
            "buffer/recent_samples": float(sum(len(v) for v in self._recent.values())),
            "buffer/pending_samples": float(sum(len(v) for v in self._pending.values())),
            "buffer/largest_group": float(max((len(g.entries) for g in self._groups.values()), default=0)),
        }
        if self._size:
            versions = [s.policy_version for g in self._groups.values() for s in g.entries.values()]
            out["buffer/version_min"] = float(min(versions))
            out["buffer/version_max"] = float(max(versions))
        return out

    def state_dict(self) -> dict:
        """Everything needed to resume sampling exactly: JSON-serialisable plain Python data.

        Holds all samples (with their insertion sequence numbers), the pending and recent sets, both
        sampling cursors and the RNG state. The constructor hyperparameters are not part of the state.

        Returns:
            A dict of lists/dicts/ints/floats/strs/bools/None (``json.dumps`` accepts it as is).
        """
        version, internal, gauss_next = self._rng.getstate()
        samples = []
        for group in self._groups.values():
            for seq, s in group.entries.items():
                samples.append([seq, {k: _plain(v) for k, v in dataclasses.asdict(s).items()}])
        samples.sort(key=lambda item: item[0])
        return {
            "format": _STATE_FORMAT,
            "next_seq": self._next_seq,
            "samples": samples,
            "pending": [[pid, list(seqs)] for pid, seqs in self._pending.items()],
            "recent": [[pid, list(seqs)] for pid, seqs in self._recent.items()],
            "recent_order": list(self._recent_order),
            "recent_pos": self._recent_pos,
            "epoch_order": list(self._epoch_order),
            "epoch_pos": self._epoch_pos,
            "rng": [version, list(internal), gauss_next],
            "draws": [[q, n] for q, n in self._draws.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace this buffer's contents with ``state`` (from :meth:`state_dict`, possibly via JSON).

        After loading, :meth:`sample` returns exactly what the saved buffer would have returned. This
        buffer's own hyperparameters are kept; if its ``capacity_per_prompt`` is smaller than the saved
        groups, each is trimmed by the usual eviction rule (oldest policy version first).

        Raises:
            ValueError: ``state`` has an unknown format or is missing a key.
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"unsupported ReplayBuffer state format {got!r}; expected {_STATE_FORMAT}")
        try:
            self._reset()
            for seq, fields in state["samples"]:
                s = Sample(**fields)
                group = self._groups.setdefault(s.prompt_id, _Group())
                group.entries[int(seq)] = s
                group.by_response[tuple(s.response_ids)] = int(seq)
                self._size += 1
            self._next_seq = int(state["next_seq"])
            self._pending = {int(pid): [int(q) for q in seqs] for pid, seqs in state["pending"]}
            self._recent = {int(pid): [int(q) for q in seqs] for pid, seqs in state["recent"]}
            self._recent_order = [int(p) for p in state["recent_order"]]
            self._recent_pos = int(state["recent_pos"])
            self._epoch_order = [int(p) for p in state["epoch_order"]]
            self._epoch_pos = int(state["epoch_pos"])
            self._draws = {int(q): int(n) for q, n in state.get("draws", [])}  # absent in older checkpoints
            version, internal, gauss_next = state["rng"]
            self._rng.setstate((version, tuple(internal), gauss_next))
        except KeyError as e:
            raise ValueError(f"ReplayBuffer state is missing key {e.args[0]!r}") from e
        for pid, group in self._groups.items():
            while len(group.entries) > self.capacity_per_prompt:
                self._remove(pid, min(group.entries, key=lambda q: (group.entries[q].policy_version, q)))
