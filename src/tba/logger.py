"""Metrics to JSONL, TensorBoard (and W&B when asked), plus the learning-curve PNG."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class MetricsLogger:
    """Appends one JSON line per record to ``RUN_DIR/metrics.jsonl`` and mirrors it to TensorBoard.

    A resumed run appends to the records of the run it continues; ``keep_through`` first drops the records of
    steps after the checkpoint (a killed run wrote them, and they are run again), so every step is recorded
    once.

    Args:
        run_dir: the run directory.
        tensorboard: also write event files under ``run_dir/tb``.
        wandb_project: also log to W&B (requires ``pip install wandb``), which mirrors the TensorBoard
            event files (``sync_tensorboard``), so they are written in that case too.
        config: stored with the W&B run.
        keep_through: resuming at this trainer step: keep only earlier records (steps <= it) in
            ``metrics.jsonl`` and TensorBoard; None for a new run.
    """

    def __init__(self, run_dir: Path, tensorboard: bool, wandb_project: str | None, config: dict | None,
                 keep_through: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if keep_through is not None and self.path.is_file():
            kept = [r for r in read_metrics(self.path) if r["step"] <= keep_through]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")
        self._tb = None
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("run.wandb_project is set but wandb is not installed: pip install wandb") from None
            # W&B mirrors the TensorBoard event files (created after this call), so every metric reaches it
            self._wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir), sync_tensorboard=True)
        if tensorboard or wandb_project:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides events at or after it that earlier files hold (the killed run's)
            purge = None if keep_through is None else keep_through + 1
            self._tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` (namespaced keys such as ``loss/tb``) at trainer ``step``."""
        record = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Flush and close every sink."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class RunStatus:
    """``RUN_DIR/status.json``: the phase a run is in, for people and monitors (``watch cat status.json``).

    Phases, in order: ``starting`` (Ray and the actors), ``fill`` (waiting for ``buffer.min_fill``),
    ``eval_before``, then per trainer step ``generate`` (sync mode), ``step`` (a trainer step in flight),
    ``publish`` (weights to the searchers), and as due ``eval`` and ``checkpoint``; then ``eval_after``,
    ``save`` (the final policy) and ``done``. Each record also holds the driver's ``pid`` (the process to
    signal) and the time. Written atomically (a temporary file renamed into place).
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "status.json"

    def set(self, phase: str, step: int) -> None:
        """Record that the run entered ``phase`` at trainer ``step``."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"phase": phase, "step": step, "pid": os.getpid(), "time": time.time()}))
        os.replace(tmp, self.path)


def read_metrics(path: Path) -> list[dict]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_learning_curve(metrics_path: Path, out_png: Path,
                        keys: tuple[str, ...] = ("train/reward_mean",)) -> Path:
    """Plot each key against trainer step (one panel per key, present keys only) to ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    keys = tuple(k for k in keys if any(k in r for r in records)) or ("train/reward_mean",)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key]) for r in records if key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, lw=0.8, alpha=0.5)
            w = max(1, len(ys) // 20)  # moving average to see the trend through sampling noise
            smooth = [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
            ax.plot(xs, smooth, lw=1.8)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("trainer step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)
