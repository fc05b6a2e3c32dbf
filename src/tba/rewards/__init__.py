"""Reward functions, and a guard that keeps one bad reward call from stopping a run."""

from __future__ import annotations

from math import isfinite
import threading
from typing import Any, Callable


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
    """``(float(value), None)`` for a finite number, else ``(None, reason)``."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None, f"reward is not a number: {value!r}"
    return (value, None) if isfinite(value) else (None, f"non-finite reward {value}")
