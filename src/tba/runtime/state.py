"""What the driver tracks over a run, saved in every checkpoint (``driver.json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunState:
    """Driver-side run state; JSON-safe except ``last`` (the latest metrics, not saved).

    Attributes:
        step: trainer steps recorded by the driver.
        staleness_sum, staleness_max: sum of per-step mean staleness and the largest staleness seen
            (trainer steps between a sample's policy version and the step that trained on it).
        searcher_restarts: searchers restarted after dying.
        consecutive_skips: non-finite steps in a row (see :class:`tba.runtime.cadence.Cadence`).
        train_s: seconds inside trainer steps, out of ``loop_s`` seconds of training loop (no evals or
            checkpoints).
        extra: values carried across resumes (e.g. ``eval_before``).
    """

    step: int = 0
    staleness_sum: float = 0.0
    staleness_max: float = 0.0
    searcher_restarts: int = 0
    consecutive_skips: int = 0
    train_s: float = 0.0
    loop_s: float = 0.0
    extra: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)

    @property
    def trainer_idle_frac(self) -> float | None:
        """Share of the training loop the trainer spent outside its steps (1 - train_s / loop_s; in sync
        mode this includes waiting for generation); None before a step."""
        return max(0.0, 1.0 - self.train_s / self.loop_s) if self.loop_s > 0 else None

    def record(self, metrics: dict[str, float], loop_s: float) -> None:
        """Account one recorded trainer step: its ``perf/train_step_s`` out of ``loop_s`` seconds of loop,
        and its staleness metrics."""
        self.train_s += metrics.get("perf/train_step_s", 0.0)
        self.loop_s += loop_s
        self.staleness_sum += metrics.get("buffer/staleness_mean", 0.0)
        self.staleness_max = max(self.staleness_max, metrics.get("buffer/staleness_max", 0.0))
        self.last = metrics

    def to_json(self) -> dict:
        """Everything but ``last``, for ``driver.json``."""
        return {k: v for k, v in asdict(self).items() if k != "last"}
