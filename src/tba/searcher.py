"""Searcher: prompts -> sampled responses -> rewards -> reference log-probs -> Samples (docs/algorithm.md section 2).

A searcher never waits for the trainer: the runtime hands it new weights between generation batches.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from math import isfinite
from typing import Any, Callable

import torch

from tba.config import SearcherConfig
from tba.engines.base import Engine
from tba.scoring import token_logprobs, unpadded
from tba.tasks.base import Task
from tba.types import PackedWeights, Probe, Sample

log = logging.getLogger(__name__)

#: the sync check warns when the engine's log-probs moved less than this share of the trainer's since the
#: previous check. Measured (benchmarks/README.md, "Sync check"): correct bf16 syncs moved 0.42-2.7x as far as
#: the trainer (precision noise adds to the move; 64 checks, full weights and LoRA), an engine that kept its
#: weights exactly 0; 0.1 leaves the correct side a 4x margin.
MOVED_MIN = 0.1
#: ... judged only when the trainer's log-probs moved at least this much (RMS, nats per token): a smaller change
#: can vanish whole in the engine's bf16 rounding of the weights (a linear decay's last updates, ~lr/T each), so a
#: correct engine would not move either. Measured trainer moves per publication: 0.02 or more (young LoRA adapter)
TRAINER_MOVE_MIN = 1e-3


class Searcher:
    """Generates and scores responses for its own shard of the training prompts.

    Args:
        engine: generation engine (:class:`tba.engines.base.Engine`: ours or vLLM) holding this searcher's copy
            of the policy.
        ref_model: frozen reference model pi_ref, for ``Sample.ref_logprobs``; None when the trainer scores
            pi_ref (``model.reference_on: trainer``), and samples then carry None.
        task: the task (prompts, reward).
        tokenizer: shared tokenizer.
        problem_ids: this searcher's shard of ``task.train`` indices (disjoint across searchers).
        searcher_id: recorded on every sample.
        cfg: the ``searcher`` config section: prompts per batch, S responses per prompt, the response cap
            in tokens, the training
            ``temperature`` (reference log-probs use it, as does the trainer) or a ``temperature_range``
            drawn per batch (paper red-teaming; behaviour log-probs are then at that batch's temperature),
            and the reward guard (``reward_timeout_s`` per call, ``failed_reward`` or drop).
        score_micro_batch: responses per reference forward pass.
        seed: shuffles the shard order.

    Raises:
        ValueError: ``problem_ids`` is empty.
    """

    def __init__(self, engine: Engine, ref_model, task, tokenizer, problem_ids: list[int], searcher_id: int,
                 cfg: SearcherConfig, score_micro_batch: int, seed: int):
        if not problem_ids:
            raise ValueError(f"searcher {searcher_id} has no prompts: searcher.num_searchers is larger than the "
                             "number of training prompts")
        self.engine, self.ref_model, self.task, self.tokenizer = engine, ref_model, task, tokenizer
        self.searcher_id = searcher_id
        self.problem_ids = list(problem_ids)
        self.cfg = cfg
        self.score_micro_batch = score_micro_batch
        self.version = 0
        self._rng = random.Random(seed * 1000 + searcher_id)
        self._order: list[int] = []
        self._undelivered: list[int] = []  # prompts of the batch being generated, until the buffer has it
        self._prompt_ids = {i: task.encode(tokenizer, task.train[i]) for i in self.problem_ids}
        self.reward_failures = 0
        self.last_reward_error: str | None = None  # the newest failure's reason, for the run's error line
        self.sync_gap: float | None = None  # the newest sync check's gap, reported with the next batch
        self._gap_warnings = 0  # sync checks over searcher.sync_gap_bound since the last batch
        self.sync_moved: float | None = None  # the newest check's engine_moved, reported with the next batch
        # (version, probe responses, engine log-probs, trainer log-probs) of the previous sync check, for the next
        self._last_check: tuple[int, list[list[int]], list[list[float]], list[list[float]]] | None = None

    def load_weights(self, version: int, weights: PackedWeights) -> None:
        """Load published policy weights (:meth:`Trainer.publish_weights`) into the engine, in place; samples
        generated from now on record ``version``, the weights the engine has. Then the sync check
        (:meth:`check_sync`) on the pack's probe, if it has one.

        Raises:
            ValueError: the weights are of a different architecture (the old ones stay, and so does the
                version).
        """
        self.engine.load_weights(weights)
        self.version = version
        if weights.probe is not None:
            self.check_sync(version, weights.probe)

    def check_sync(self, version: int, probe: Probe) -> float | None:
        """The sync check: score the trainer's probe responses with the engine and compare with the trainer's
        log-probs of the same weights (docs/architecture.md, "The sync check"). Two tests, each a warning line
        counted in ``sync/gap_warnings``; ``searcher.sync_gap_bound`` None logs both and warns on neither:

        - the gap, mean |engine - trainer| log-prob over the probe's tokens (nats per token,
          ``sync/logprob_gap``), above ``searcher.sync_gap_bound``. A correct sync leaves only precision in it
          (bf16 against the trainer's autocast); weights that never reached the engine leave the policy's
          change since (measured: benchmarks/README.md, "Sync check");
        - from the second check on, how far the engine's log-probs moved since the previous check against how
          far the trainer's did (:func:`engine_moved`, ``sync/engine_moved``: about 1 fresh, 0 unchanged), below
          :data:`MOVED_MIN`. A load that does not arrive leaves the engine's log-probs exactly where they were,
          so this needs no precision bound and also sees weights that moved less than bf16 precision (a young
          LoRA adapter) fail to arrive.

        Returns:
            the gap, or None when the engine could not score the probe (logged as a warning).
        """
        try:
            scored = self.engine.score(probe.prompt_ids, probe.response_ids, probe.temperature)
            lengths, full = [len(x) for x in scored], [len(r) for r in probe.response_ids]
            # an engine with a shorter context scores a prefix of a response (Engine.score)
            if len(lengths) != len(full) or any(n > m for n, m in zip(lengths, full)) or not sum(lengths):
                raise ValueError(f"log-probs for {lengths} tokens of responses of {full}")
        except Exception as e:  # noqa: BLE001 - a check that cannot run is reported, never fatal
            log.warning("searcher %d: sync check of policy version %d skipped: the engine could not score the "
                        "probe (%s: %s)", self.searcher_id, version, type(e).__name__, e)
            return None
        diffs = [abs(a - b) for mine, theirs in zip(scored, probe.logprobs) for a, b in zip(mine, theirs)]
        gap = sum(diffs) / len(diffs)
        self.sync_gap = gap
        bound = self.cfg.sync_gap_bound
        if bound is not None and not gap <= bound:  # NaN counts as over
            self._gap_warnings += 1
            log.warning("searcher %d: policy version %d: the engine's log-probs differ from the trainer's by %.3f "
                        "nats per token on the probe responses (searcher.sync_gap_bound %g): the published weights "
                        "may not have reached the engine", self.searcher_id, version, gap, bound)
        last, self._last_check = self._last_check, (version, probe.response_ids, scored, probe.logprobs)
        if last is not None and last[0] != version and last[1] == probe.response_ids:  # the same responses
            self.sync_moved = engine_moved(last[2], scored, last[3], probe.logprobs)
            if bound is not None and self.sync_moved is not None and self.sync_moved < MOVED_MIN:
                self._gap_warnings += 1
                log.warning("searcher %d: policy version %d: since version %d the engine's log-probs of the probe "
                            "responses moved %.2fx as far as the trainer's (a fresh engine about 1, one that kept its "
                            "weights 0): the published weights may not have reached the engine", self.searcher_id,
                            version, last[0], self.sync_moved)
        return gap

    def next_prompts(self) -> list[int]:
        """The next ``searcher.prompts_per_batch`` problem ids: shuffled epochs over the shard, no repeats
        within one."""
        out = []
        while len(out) < self.cfg.prompts_per_batch:
            if not self._order:
                self._order = self.problem_ids[:]
                self._rng.shuffle(self._order)
            out.append(self._order.pop())
        self._undelivered = out
        return out

    def delivered(self) -> None:
        """The last batch reached the buffer: a checkpoint no longer needs to hand its prompts back."""
        self._undelivered = []

    def step(self) -> tuple[list[Sample], dict[str, float]]:
        """Generate one batch: prompts x S responses, scored, with reference log-probs.

        Returns:
            (samples, metrics) with ``searcher/*`` keys (reward mean, failures, tokens/s in generated tokens
            per second of this call), ``sync/gap_warnings`` (sync checks over the bound since the previous
            batch) and, after a sync check, its ``sync/logprob_gap``.
        """
        t0 = time.perf_counter()
        pids = self.next_prompts()
        prompts = [self._prompt_ids[i] for i in pids]
        c = self.cfg
        temp = self._rng.uniform(*c.temperature_range) if c.temperature_range else c.temperature
        # a seed per batch from the searcher's own RNG: a resumed searcher draws the same responses
        gens = self.engine.generate(prompts, c.samples_per_prompt, c.max_new_tokens, temp,
                                    seed=self._rng.randrange(2**31))
        t_gen = time.perf_counter() - t0
        flat = [(pid, prompt, g) for pid, prompt, group in zip(pids, prompts, gens) for g in group]
        ref = self._ref_logprobs([p for _, p, _ in flat], [g.response_ids for _, _, g in flat])
        texts = [self.tokenizer.decode(g.response_ids, skip_special_tokens=True) for _, _, g in flat]
        scored = self._score(texts, [self.task.train[pid] for pid, _, _ in flat])
        samples, failures = [], 0
        for (pid, prompt, g), ref_lp, (reward, err) in zip(flat, ref, scored):
            if err is not None:
                failures += 1
                self.last_reward_error = err
                log.warning("searcher %d: reward failed for prompt %d: %s", self.searcher_id, pid, err)
                if self.cfg.failed_reward is None:
                    continue
                reward = self.cfg.failed_reward
            samples.append(Sample(pid, prompt, g.response_ids, reward, g.logprobs, ref_lp, self.version,
                                  self.searcher_id, g.finished))
        self.reward_failures += failures
        n_tokens = sum(len(g.response_ids) for _, _, g in flat)
        rewards = [s.reward for s in samples]
        metrics = {
            "searcher/reward_mean": sum(rewards) / max(1, len(rewards)),
            "searcher/reward_failures": float(failures),
            "searcher/gen_tokens_per_s": n_tokens / max(t_gen, 1e-9),
            "searcher/response_len_mean": n_tokens / max(1, len(flat)),
            # distinct responses per prompt / S: 1 = every sample differs, 1/S = the policy has collapsed
            "searcher/distinct_frac": sum(len({tuple(g.response_ids) for g in group}) / max(1, len(group))
                                          for group in gens) / max(1, len(gens)),
            "searcher/step_s": time.perf_counter() - t0,
            "sync/gap_warnings": float(self._gap_warnings),
        }
        if self.sync_gap is not None:
            metrics["sync/logprob_gap"] = self.sync_gap
        if self.sync_moved is not None:
            metrics["sync/engine_moved"] = self.sync_moved
        self.sync_gap, self.sync_moved, self._gap_warnings = None, None, 0
        return samples, metrics

    def _score(self, texts: list[str], problems: list) -> list[tuple[float | None, str | None]]:
        """(reward, None) or (None, reason) per response, never raising; batched when the task batches."""
        if type(self.task).reward_batch is not Task.reward_batch:
            values, err = call_with_timeout(self.task.reward_batch, texts, problems,
                                            timeout_s=self.cfg.reward_timeout_s * len(texts))
            if err is None and isinstance(values, (list, tuple)) and len(values) == len(texts):
                return [check_reward(v) for v in values]
            log.warning("searcher %d: batched reward failed (%s); scoring one by one", self.searcher_id,
                        err or f"returned {type(values).__name__} of the wrong length")
        out = []
        for text, problem in zip(texts, problems):
            value, err = call_with_timeout(self.task.reward, text, problem, timeout_s=self.cfg.reward_timeout_s)
            out.append((None, err) if err is not None else check_reward(value))
        return out

    @torch.no_grad()
    def _ref_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float] | None]:
        if self.ref_model is None:  # the trainer scores pi_ref
            return [None] * len(prompts)
        out = []
        pad = self.tokenizer.pad_token_id
        for s in range(0, len(prompts), self.score_micro_batch):
            lp, mask = token_logprobs(self.ref_model, prompts[s : s + self.score_micro_batch],
                                      responses[s : s + self.score_micro_batch], self.cfg.temperature, pad)
            out += unpadded(lp, mask)
        return out

    def state_dict(self) -> dict:
        """Prompt cursor and RNGs, so a resumed searcher skips no prompt (JSON-safe). The prompts of a batch
        not yet delivered to the buffer go back on the cursor (next in line): a checkpoint taken while they
        are generated then makes the resumed searcher generate them again rather than never. Safe to call
        from another thread while :meth:`step` runs."""
        undelivered = list(self._undelivered)
        return {"order": list(self._order) + undelivered[::-1], "rng": _rng_to_json(self._rng.getstate()),
                "version": self.version, "torch_rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self._order = [i for i in state["order"] if i in self._prompt_ids]
        self._rng.setstate(_rng_from_json(state["rng"]))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))


def _rng_to_json(state):
    return [state[0], list(state[1]), state[2]]


def _rng_from_json(state):
    return (state[0], tuple(state[1]), state[2])


# -- the reward fault guard: one bad reward call marks its sample(s), never stops the searcher ---------
def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout_s: float) -> tuple[Any, str | None]:
    """Run ``fn(*args)`` in a daemon thread, waiting at most ``timeout_s`` seconds.

    A reward that raises or hangs marks only its own sample(s); a hung call is
    abandoned in its daemon thread (Python cannot kill a thread), so the searcher never blocks.

    Returns:
        ``(value, None)`` on success, ``(None, reason)`` on failure.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - any scorer failure is reported, never raised
            box["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=target, daemon=True, name="tba-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"timeout after {timeout_s:g} s"
    if "error" in box:
        return None, box["error"]
    return box["value"], None


def check_reward(value: Any) -> tuple[float | None, str | None]:
    """``(float(value), None)`` for a finite number, else ``(None, reason)``; a string or a bool is not a
    number, though ``float`` takes ``"0.5"`` and ``True`` (a scorer returning one has a bug to surface)."""
    if isinstance(value, (str, bytes, bool)):
        return None, f"reward is not a number: {value!r}"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None, f"reward is not a number: {value!r}"
    return (value, None) if isfinite(value) else (None, f"non-finite reward {value}")


def engine_moved(engine_before: list[list[float]], engine_after: list[list[float]],
                 trainer_before: list[list[float]], trainer_after: list[list[float]]) -> float | None:
    """How far the engine's log-probs of the probe responses moved between two sync checks, against how far
    the trainer's moved: sqrt(sum(g^2) / sum(d^2)) over the D tokens both sides scored at both checks, with g
    the engine's per-token change and d the trainer's (nats). About 1 when the engine took the new weights
    (precision noise adds to it), exactly 0 when its log-probs did not move.

    Args:
        engine_before, engine_after: the engine's per-token log-probs of the probe responses at the previous
            and at this check (a list per response, possibly a prefix: ``Engine.score``).
        trainer_before, trainer_after: the trainer's, at the same two checks.

    Returns:
        the ratio, or None when no token was scored at both checks or the trainer's log-probs moved less than
        :data:`TRAINER_MOVE_MIN` (RMS): too little for the engine's precision to be sure to show it.
    """
    pairs = [(ea - eb, ta - tb) for e0, e1, t0, t1 in zip(engine_before, engine_after, trainer_before, trainer_after)
             for eb, ea, tb, ta in zip(e0, e1, t0, t1)]
    dd = sum(d * d for _, d in pairs)
    if not pairs or not (dd / len(pairs)) ** 0.5 >= TRAINER_MOVE_MIN:
        return None
    return (sum(g * g for g, _ in pairs) / dd) ** 0.5
