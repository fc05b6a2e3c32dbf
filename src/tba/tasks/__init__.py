"""Tasks: prompts + formatting + reward + eval set. ``build_task`` maps ``task.name`` to one."""

from __future__ import annotations

from typing import Any

from tba.tasks.base import Problem, Task

__all__ = ["Problem", "Task", "build_task"]


def build_task(name: str, *, source: str | None = None, options: dict[str, Any] | None = None,
               train_size: int = 2000, eval_size: int = 200, seed: int = 0, system_prompt: str | None = None,
               prompt_template: str = "{question}", answer_pattern: str | None = None) -> Task:
    """Build a task from its config name: ``gsm8k``, ``reasoning_gym:<dataset>``, ``redteam`` or ``summarize``.

    ``redteam`` and ``summarize`` take their settings from ``options`` (documented in
    :mod:`tba.tasks.redteam` / :mod:`tba.tasks.summarize`); ``summarize`` reads ``source`` (hub id, JSONL,
    folder, or ``sample``).

    Raises:
        ValueError: unknown task name or invalid dataset settings.
    """
    fmt = {"system_prompt": system_prompt, "prompt_template": prompt_template}
    if name == "gsm8k":
        from tba.tasks.gsm8k import GSM8KTask

        return GSM8KTask(source, train_size, eval_size, **fmt)
    if name.startswith("reasoning_gym:"):
        from tba.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(name.split(":", 1)[1], options or {}, train_size, eval_size, seed,
                                answer_pattern, **fmt)
    if name == "redteam":
        from tba.tasks.redteam import RedTeamTask

        return RedTeamTask(options, train_size, eval_size, **fmt)
    if name == "summarize":
        from tba.tasks.summarize import SummarizeTask

        return SummarizeTask(source, options, train_size, eval_size, **fmt)
    raise ValueError(f"task.name '{name}' is unknown: use 'gsm8k', 'reasoning_gym:<dataset>', 'redteam' "
                     "or 'summarize'")
