"""Tasks: prompts + formatting + reward + eval set. ``build_task`` maps ``task.name`` to one."""

from __future__ import annotations

from typing import Any

from tba.tasks.base import Problem, Task

__all__ = ["Problem", "Task", "build_task"]


def build_task(name: str, *, source: str | None = None, dataset_config: dict[str, Any] | None = None,
               train_size: int = 2000, eval_size: int = 200, seed: int = 0, system_prompt: str | None = None,
               prompt_template: str = "{question}", answer_pattern: str | None = None) -> Task:
    """Build a task from its config name: ``gsm8k`` or ``reasoning_gym:<dataset>``.

    Raises:
        ValueError: unknown task name or invalid dataset settings.
    """
    fmt = {"system_prompt": system_prompt, "prompt_template": prompt_template}
    if name == "gsm8k":
        from tba.tasks.gsm8k import GSM8KTask

        return GSM8KTask(source, train_size, eval_size, **fmt)
    if name.startswith("reasoning_gym:"):
        from tba.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(name.split(":", 1)[1], dataset_config or {}, train_size, eval_size, seed,
                                answer_pattern, **fmt)
    raise ValueError(f"task.name '{name}' is unknown: use 'gsm8k' or 'reasoning_gym:<dataset>'")
