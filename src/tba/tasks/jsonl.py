"""Reading JSONL data files so that a bad line names its file and line and loses nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


class DataError(ValueError):
    """A malformed data row; the message starts ``<file>:<line>:`` (hub rows: ``<id>[split]:row N``).

    Subclasses ValueError, so ``except ValueError`` also catches it.
    """


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row_or_exception)`` for each non-blank line of a JSONL file."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, ValueError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})")
