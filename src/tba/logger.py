"""Metrics to JSONL, TensorBoard (and W&B when asked), the learning-curve PNG, and where log lines go.

Log lines: every process of a run (the driver and each Ray actor) sends its records through the root logger
to two handlers. The console handler (stderr; Ray forwards an actor's stderr to the driver's terminal)
shows tba's own records, and a library's (vLLM, Ray, transformers, torch, Python warnings) only at WARNING
and above and only the first time that logger emits that message (:class:`OncePerMessage`), on one line.
The file handler appends every library record at INFO and above to ``RUN_DIR/third_party.log``
(:data:`LIBRARY_LOG`), each tagged with the process's role and pid.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

#: the file in the run directory that receives the libraries' log records (every process of the run appends)
LIBRARY_LOG = "third_party.log"
_CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"
# a %-style placeholder: a message template made only of these (``log.warning("%s", text)``) is keyed by its text
_PLACEHOLDER = re.compile(r"%(\([^)]*\))?[-#0 +]*(\d+|\*)?(\.(\d+|\*))?[diouxXeEfFgGcrsa%]")


def _is_tba(record: logging.LogRecord) -> bool:
    return record.name == "tba" or record.name.startswith("tba.")


def message_key(record: logging.LogRecord) -> tuple[str, str]:
    """What makes two records "the same message": the logger and the message template before its arguments
    (vLLM's "Attempted to load weight %s ..." is one message for every weight), or the text itself when the
    template is only placeholders (``log.warning("%s", text)``, as some libraries write)."""
    template = record.msg if isinstance(record.msg, str) else str(record.msg)
    if not (record.args and _PLACEHOLDER.sub("", template).strip()):
        template = record.getMessage()
    return record.name, template


class LibraryRecords(logging.Filter):
    """Passes the records of libraries: every logger outside ``tba``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_tba(record)


class OncePerMessage(logging.Filter):
    """The console's filter: tba's records pass; a library's record passes only at WARNING and above, and
    only the first time its :func:`message_key` is seen by this filter (so once per process)."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if _is_tba(record):
            return True
        if record.levelno < logging.WARNING:
            return False
        key = message_key(record)
        with self._lock:
            if key in self.seen:
                return False
            self.seen.add(key)
        return True


class _TrimmedFormatter(logging.Formatter):
    """A formatter that drops trailing blank space (Python's warnings end their text with a newline)."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).rstrip()


class ConsoleFormatter(_TrimmedFormatter):
    """``LEVEL logger: message``; a library's record is cut to its first line (the whole of it, traceback
    included, is in :data:`LIBRARY_LOG`)."""

    def __init__(self):
        super().__init__(_CONSOLE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if _is_tba(record) or "\n" not in text:
            return text
        return text.split("\n", 1)[0] + " [...]"


def release_library_loggers() -> None:
    """Make the libraries that print through a console handler of their own send their records up to the
    root logger (and so to the handlers of :func:`route_console` and :func:`route_library_file`) instead:
    Ray (its ``ray`` logger, set up again by ``import ray``), transformers (its default handler; only once
    imported, as importing it takes seconds) and vLLM (which then configures no logging when imported;
    ``VLLM_CONFIGURE_LOGGING=1`` set by the user keeps vLLM's own). Idempotent: call it again after importing
    Ray or transformers."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        ray_logger.removeHandler(handler)
    ray_logger.propagate = True
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()


def route_console(stream=None) -> logging.Handler:
    """Send this process's log records to the console as the module docstring says: tba's records at WARNING
    and above, each distinct library warning once. Also routes Python warnings through logging, releases the
    libraries' loggers (:func:`release_library_loggers`) and sets the root level to INFO, so the libraries'
    INFO records reach :func:`route_library_file`'s file. A console handler installed before is kept (with
    the warnings it has seen) unless ``stream`` names another stream.

    Args:
        stream: where the lines go; None: ``sys.stderr`` as it is now.

    Returns:
        the handler (see :func:`remove_routes`).
    """
    root = logging.getLogger()
    release_library_loggers()
    logging.captureWarnings(True)
    stream = stream if stream is not None else sys.stderr
    handler = next((h for h in root.handlers if getattr(h, "_tba_route", None) == "console"), None)
    if handler is not None and handler.stream is stream:
        return handler
    level = handler._tba_root_level if handler is not None else root.level
    _remove(root, "console")
    root.setLevel(logging.INFO)
    handler = logging.StreamHandler(stream)
    handler._tba_root_level = level  # restored by remove_routes
    handler.setLevel(logging.WARNING)
    handler.addFilter(OncePerMessage())
    handler.setFormatter(ConsoleFormatter())
    handler._tba_route = "console"
    root.addHandler(handler)
    return handler


def route_library_file(run_dir: str | Path, role: str) -> logging.Handler | None:
    """Append this process's library records (INFO and above, as far as the loggers' levels let them
    through) to ``run_dir/third_party.log``, each line tagged with ``role`` (e.g. 'driver', 'searcher 0')
    and the pid. Replaces a file handler installed before.

    Returns:
        the handler, or None when ``run_dir`` does not exist here (a cluster node that cannot reach the
        run directory: its library records then reach only the console).
    """
    root = logging.getLogger()
    _remove(root, "file")
    release_library_loggers()
    try:
        handler = logging.FileHandler(Path(run_dir) / LIBRARY_LOG, encoding="utf-8")
    except OSError:
        return None
    handler.setLevel(logging.INFO)
    handler.addFilter(LibraryRecords())
    handler.setFormatter(_TrimmedFormatter(f"%(asctime)s %(levelname)s [{role} pid %(process)d] %(name)s: "
                                           "%(message)s"))
    handler._tba_route = "file"
    root.addHandler(handler)
    return handler


def route_worker(run_dir: str | Path | None, role: str) -> None:
    """An actor's routing: :func:`route_console`, and :func:`route_library_file` into ``run_dir`` (when
    given) with its lines tagged ``role``."""
    route_console()
    if run_dir is not None:
        route_library_file(run_dir, role)


def remove_routes() -> None:
    """Remove (and close) the handlers :func:`route_console` and :func:`route_library_file` installed, give
    the root logger back the level it had, and stop routing Python warnings through logging."""
    root = logging.getLogger()
    console = next((h for h in root.handlers if getattr(h, "_tba_route", None) == "console"), None)
    if console is not None:
        root.setLevel(console._tba_root_level)
    _remove(root, "console")
    _remove(root, "file")
    logging.captureWarnings(False)


def _remove(logger: logging.Logger, route: str) -> None:
    for handler in [h for h in logger.handlers if getattr(h, "_tba_route", None) == route]:
        logger.removeHandler(handler)
        handler.close()


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


#: the held-out eval's main number per task, in the order looked for (the first present is plotted)
EVAL_MAIN_KEYS = ("accuracy", "attack_success_rate", "win_rate", "kl")


def eval_series(records: list[dict], before: dict | None = None, after: dict | None = None,
                last_step: int | None = None) -> tuple[str, list[tuple[int, float, float | None]]] | None:
    """The held-out eval's main number over training: (its name, [(step, value, standard error or None)]),
    from the ``eval/*`` records of ``run.eval_every`` plus the evals before training (step 0) and after it
    (``last_step``), as the summary holds them (``{"accuracy": ..., "stderr": ...}``). None without any eval.
    The main number is the first of :data:`EVAL_MAIN_KEYS` present; a task without a ``stderr`` (the
    known-optimum task's exact quantities) has None there."""
    points = [(0, before)] if before else []
    points += [(r["step"], {k[5:]: v for k, v in r.items() if k.startswith("eval/")}) for r in records
               if any(k.startswith("eval/") for k in r)]
    if after and last_step is not None:
        points.append((last_step, after))
    key = next((k for k in EVAL_MAIN_KEYS if any(k in e for _, e in points)), None)
    if key is None:
        return None
    return key, [(step, float(e[key]), e.get("stderr")) for step, e in points if key in e]


def plot_learning_curve(metrics_path: Path, out_png: Path, keys: tuple[str, ...] = ("train/reward_mean",),
                        before: dict | None = None, after: dict | None = None) -> Path:
    """Plot to ``out_png``: first the held-out eval's main number with one standard error bars
    (:func:`eval_series`; ``before`` / ``after``: the evals before and after training), then each of
    ``keys`` against trainer step (one panel per key, present keys only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    keys = tuple(k for k in keys if any(k in r for r in records)) or ("train/reward_mean",)
    last = max((r["step"] for r in records if "step" in r), default=None)
    evals = eval_series(records, before, after, last)
    fig, axes = plt.subplots(len(keys) + bool(evals), 1, figsize=(7, 2.4 * (len(keys) + bool(evals))), sharex=True,
                             squeeze=False)
    if evals:
        name, pts = evals
        ax = axes[0, 0]
        ax.errorbar([s for s, _, _ in pts], [v for _, v, _ in pts],
                    yerr=[e or 0.0 for _, _, e in pts], fmt="o-", ms=4, capsize=3, lw=1.2, color="C3")
        ax.set_ylabel(f"held-out {name}" + (" (± 1 s.e.)" if any(e for _, _, e in pts) else ""), fontsize=8)
        ax.grid(alpha=0.3)
    for ax, key in zip(axes[int(bool(evals)):, 0], keys):
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
