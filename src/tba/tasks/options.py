"""Validation of ``task.options`` for tasks that take a fixed set of keys."""

from __future__ import annotations

from typing import Any


def task_options(given: dict[str, Any] | None, defaults: dict[str, Any], task: str) -> dict[str, Any]:
    """``defaults`` updated with ``given``.

    Raises:
        ValueError: a key of ``given`` is not one of ``defaults`` (a typo), naming the allowed keys.
    """
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"task '{task}': unknown task.options {unknown}; allowed: {', '.join(sorted(defaults))}")
    return {**defaults, **given}
