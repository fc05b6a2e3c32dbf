"""Reward functions, and a guard that keeps one bad reward call from stopping a run."""

from __future__ import annotations

from math import isfinite
import threading
from typing import Any, Callable


def call_with_timeout(fn: Callable[..., float], *args: Any, timeout_s: float) -> tuple[float | None, str | None]:
    """Run ``fn(*args)`` in a daemon thread, waiting at most ``timeout_s`` seconds.

    A reward that raises, hangs or returns a non-finite value marks only its own sample; a hung call is
    abandoned in its daemon thread (Python cannot kill a thread), so the searcher never blocks.

    Returns:
        ``(reward, None)`` on success, ``(None, reason)`` on failure.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = float(fn(*args))
        except BaseException as e:  # noqa: BLE001 - any scorer failure is reported, never raised
            box["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=target, daemon=True, name="tba-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"timeout after {timeout_s:g} s"
    if "error" in box:
        return None, box["error"]
    if not isfinite(box["value"]):
        return None, f"non-finite reward {box['value']}"
    return box["value"], None
