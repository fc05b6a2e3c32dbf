"""Loading GSM8K (Cobbe et al. 2021) as (question, gold final answer) pairs.

A source is either a local JSONL file, a directory holding ``{split}.jsonl`` (the layout of the
``openai/gsm8k`` dataset exported to JSONL, e.g. ``shared/data/gsm8k``), or a Hugging Face hub
dataset id such as ``openai/gsm8k`` (config ``main``; needs the ``datasets`` package and network or
a populated hub cache).  Every row needs a non-empty string ``question`` and a string ``answer``:
the worked solution whose last line is ``#### <final answer>``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tba.rewards.math import normalize_number
from tba.tasks.jsonl import DataError, jsonl_rows

__all__ = ["DataError", "load_gsm8k"]

logger = logging.getLogger(__name__)

_MAX_REPORTED = 5  # bad rows quoted in the skip warning


def _looks_like_path(source: str) -> bool:
    """Whether ``source`` names a local path rather than a hub id (``name`` or ``owner/name``)."""
    if os.path.exists(source):
        return True
    if source.startswith(("/", ".", "~")) or source.endswith((".jsonl", ".json")):
        return True
    return source.count("/") > 1 or os.sep != "/" and os.sep in source


def _final_answer(answer: str) -> str | None:
    """The text after the last ``####`` of a solution, normalised (``1,200`` -> ``1200``)."""
    if "####" not in answer:
        return None
    tail = answer.rsplit("####", 1)[1].strip()
    if not tail:
        return None
    return normalize_number(tail) or tail


def _check_row(row: Any) -> tuple[str, str]:
    """Validate one row: (question, final answer), or ValueError saying what is wrong."""
    if not isinstance(row, dict):
        kind = type(row).__name__
        raise ValueError(f"expected a JSON object with 'question' and 'answer', got {kind}")
    for field in ("question", "answer"):
        if field not in row:
            raise ValueError(f"missing field {field!r}")
        if not isinstance(row[field], str):
            raise ValueError(f"field {field!r} must be a string, got {type(row[field]).__name__}")
    question = row["question"].strip()
    if not question:
        raise ValueError("empty 'question'")
    final = _final_answer(row["answer"])
    if final is None:
        if "####" in row["answer"]:
            raise ValueError("empty final answer after '####' in field 'answer'")
        raise ValueError("field 'answer' has no '#### <final answer>' line")
    return question, final


def _hub_rows(source: str, split: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets  # lazy: heavy, and only needed for hub sources
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise ImportError(
            f"loading GSM8K from the hub id {source!r} needs the 'datasets' package; "
            "install it or pass a local JSONL file / directory"
        ) from exc
    try:
        ds = datasets.load_dataset(source, "main", split=split)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(
                f"tba: {source!r} was read as a hub dataset id because no local path of that name "
                "exists; pass a JSONL file or a directory containing '{split}.jsonl' for local data"
            )
        raise
    for i, row in enumerate(ds, start=1):
        yield f"{source}[{split}]:row {i}", row


def _resolve_local(source: str, split: str) -> Path:
    path = Path(source).expanduser()
    hint = (
        "pass a JSONL file, a directory containing '{split}.jsonl', "
        "or a hub dataset id such as 'openai/gsm8k'"
    )
    if not path.exists():
        raise FileNotFoundError(f"GSM8K data not found at {path}; {hint.format(split=split)}")
    if path.is_dir():
        file = path / f"{split}.jsonl"
        if not file.is_file():
            available = sorted(p.name for p in path.glob("*.jsonl"))
            raise FileNotFoundError(
                f"no {split}.jsonl in directory {path} "
                f"(found: {', '.join(available) or 'no .jsonl files'}); {hint.format(split=split)}"
            )
        return file
    return path


def _collect(
    rows: Iterable[tuple[str, Any]], limit: int | None, skip_bad_rows: bool, source: str
) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    bad: list[str] = []
    for where, row in rows:
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(row, Exception):
                raise row
            out.append(_check_row(row))
        except ValueError as exc:
            message = f"{where}: {exc}"
            if not skip_bad_rows:
                raise DataError(message) from None
            bad.append(message)
    if bad:
        shown = "; ".join(bad[:_MAX_REPORTED])
        more = f" (and {len(bad) - _MAX_REPORTED} more)" if len(bad) > _MAX_REPORTED else ""
        logger.warning("skipped %d bad GSM8K row(s) in %s: %s%s", len(bad), source, shown, more)
    return out


def load_gsm8k(
    source: str, split: str = "train", limit: int | None = None, *, skip_bad_rows: bool = False
) -> list[tuple[str, str]]:
    """Load GSM8K as a list of ``(question, gold final answer)`` pairs.

    ``source`` is a local JSONL file, a directory containing ``{split}.jsonl``, or a Hugging Face
    hub dataset id (``openai/gsm8k``, loaded with ``datasets.load_dataset(source, "main",
    split=split)``).  The gold final answer is the text after the solution's last ``####``, with
    thousands separators removed (``"#### 1,200"`` -> ``"1200"``); pass it to
    :func:`tba.rewards.math.gsm8k_reward`.  ``limit`` keeps the first ``limit`` good rows.

    A malformed row (bad JSON, not an object, missing or non-string ``question``/``answer``, empty
    question, no ``#### x`` final answer) raises :class:`DataError` whose message names the file
    and 1-based line, e.g. ``data/train.jsonl:17: missing field 'answer'``.  With
    ``skip_bad_rows=True`` such rows are skipped instead and one warning on the ``logging`` logger
    ``tba.tasks.gsm8k_data`` reports how many, quoting the first few.  Blank lines are ignored.

    Raises ``FileNotFoundError`` (naming the path) when a local source does not exist.

    Example::

        pairs = load_gsm8k("shared/data/gsm8k", split="test")   # 1319 pairs
        pairs[0][1]                                             # "18"
    """
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")
    if _looks_like_path(source):
        path = _resolve_local(source, split)
        return _collect(jsonl_rows(path), limit, skip_bad_rows, str(path))
    return _collect(_hub_rows(source, split), limit, skip_bad_rows, f"{source}[{split}]")
