"""Tasks: prompts + formatting + reward + eval set. :func:`build_task` builds the one a config names.

Modules: :mod:`~tba.tasks.base` (``Task``, ``Problem``), :mod:`~tba.tasks.data` (the one data loader and
:class:`~tba.tasks.data.DataError`), :mod:`~tba.tasks.evaluation` (greedy eval accuracy), and one module
per task (``gsm8k``, ``known_optimum``, ``reasoning_gym``, ``redteam``, ``summarize``).
"""

from __future__ import annotations

import importlib

from tba.config import Config
from tba.tasks.base import Problem, Task

__all__ = ["Problem", "Task", "build_task", "task_class", "task_classes"]

# task.name (a name ending in ':' takes a suffix, e.g. reasoning_gym:chain_sum) -> "module:Class";
# imported only when named, so a run loads the dependencies of its own task only
_TASKS = {
    "gsm8k": "tba.tasks.gsm8k:GSM8KTask",
    "known_optimum": "tba.tasks.known_optimum:KnownOptimumTask",
    "reasoning_gym:": "tba.tasks.reasoning_gym:ReasoningGymTask",
    "redteam": "tba.tasks.redteam:RedTeamTask",
    "summarize": "tba.tasks.summarize:SummarizeTask",
}


def task_class(name: str) -> type[Task]:
    """The Task subclass of a ``task.name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    key = name.split(":", 1)[0] + ":" if ":" in name else name
    if key not in _TASKS:
        known = ", ".join(f"'{_shown(k)}'" for k in _TASKS)
        raise ValueError(f"task.name '{name}' is unknown: use one of {known}")
    return _import(key)


def _import(key: str) -> type[Task]:
    module, cls = _TASKS[key].split(":")
    return getattr(importlib.import_module(module), cls)


def task_classes() -> dict[str, type[Task]]:
    """Every task class by its ``task.name`` (``reasoning_gym:<dataset>`` for a suffixed one), for ``--help``;
    imports every task module."""
    return {_shown(k): _import(k) for k in _TASKS}


def _shown(key: str) -> str:
    """A ``_TASKS`` key as users write it: ``reasoning_gym:<dataset>`` for one that takes a suffix."""
    return f"{key}<dataset>" if key.endswith(":") else key


def build_task(cfg: Config) -> Task:
    """Build the task of ``cfg.task`` with its data loaded (prompts are formatted lazily).

    The task class gets a copy of the ``task`` section whose ``options`` are the class's
    :meth:`~tba.tasks.Task.run_options` (settings it takes from other sections, e.g. the GGUF cache)
    updated with the user's ``task.options`` (the user's values win), which the task validates against its
    ``Options`` model first thing. Runs in the CLI before Ray starts, so bad options and data fail there.

    Raises:
        ValueError: unknown task name, an unknown or ill-typed option (one line, ``task.options.X: ...``),
            invalid task settings, or a task left with no training problems
            (the message names the task and its source). :class:`tba.tasks.data.DataError` (a ValueError)
            for malformed or empty data, naming the file. FileNotFoundError: a missing local data path.
    """
    cls = task_class(cfg.task.name)
    section = cfg.task.model_copy(update={"options": {**cls.run_options(cfg), **cfg.task.options}})
    task = cls(section)
    if not task.train:
        source = f" (source {cfg.task.source!r})" if cfg.task.source else ""
        raise ValueError(f"task '{cfg.task.name}'{source} has no training problems; check task.source, "
                         "task.train_size and task.options")
    return task
