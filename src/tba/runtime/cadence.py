"""When a run publishes weights, evaluates, checkpoints and gives up: pure policy, no Ray, unit-tested.

The driver asks these after every trainer step; nothing here has side effects beyond the skip counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from tba.config import Config


class NoSamples(RuntimeError):
    """A sync-mode generation round left the buffer empty (every reward failed): training cannot start."""


class TooManySkippedSteps(RuntimeError):
    """More trainer steps in a row than ``trainer.max_consecutive_skips`` had a non-finite loss or gradient.

    The driver saves a checkpoint before this propagates.
    """


@dataclass(frozen=True)
class Cadence:
    """The step-indexed schedule of a run.

    Attributes:
        max_steps: trainer steps of the run.
        sync_period: k, steps between weight publications (1 in sync mode; docs/algorithm.md section 2).
        eval_every: steps between mid-run evals; 0 = none (evals before/after are the CLI's).
        checkpoint_every: steps between periodic checkpoints; 0 = none.
        max_consecutive_skips: non-finite steps in a row tolerated before the run stops.
    """

    max_steps: int
    sync_period: int
    eval_every: int
    checkpoint_every: int
    max_consecutive_skips: int

    @classmethod
    def from_config(cls, cfg: Config) -> "Cadence":
        """The schedule of ``cfg``; sync mode publishes after every step (k = 1)."""
        k = 1 if cfg.run.mode == "sync" else cfg.trainer.sync_period
        return cls(cfg.trainer.max_steps, k, cfg.run.eval_every, cfg.run.checkpoint_every,
                   cfg.trainer.max_consecutive_skips)

    def publish_due(self, step: int) -> bool:
        """Publish weights (and start a new recent set) after trainer ``step`` (every k steps)."""
        return step % self.sync_period == 0

    def eval_due(self, step: int) -> bool:
        """A mid-run eval after ``step``; never after the last step (the final eval covers it)."""
        return _every(self.eval_every, step, self.max_steps)

    def checkpoint_due(self, step: int) -> bool:
        """A periodic checkpoint after ``step``; never after the last step (the run is complete then)."""
        return _every(self.checkpoint_every, step, self.max_steps)

    def count_skip(self, consecutive: int, skipped: bool) -> int:
        """The new count of non-finite steps in a row after a step that was (not) ``skipped``.

        Raises:
            TooManySkippedSteps: the count exceeds ``max_consecutive_skips``.
        """
        consecutive = consecutive + 1 if skipped else 0
        if consecutive > self.max_consecutive_skips:
            raise TooManySkippedSteps(
                f"{consecutive} trainer steps in a row had a non-finite loss or gradient; lower trainer.lr or "
                "check the rewards")
        return consecutive


def _every(every: int, step: int, max_steps: int) -> bool:
    return bool(every) and step % every == 0 and step < max_steps
