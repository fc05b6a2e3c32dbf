"""One loader for task data: a JSONL file, a folder of split files, or a Hugging Face hub dataset id.

Every data-backed task (``gsm8k``, ``summarize``) loads through :func:`load_splits`, so the rules below are
the same for all of them.

Sources
    :func:`is_local` is the one rule that tells a local path from a hub id. A local source is either

    * a folder holding ``train.jsonl`` and ``{eval_split}.jsonl`` (``test.jsonl`` if that is missing), or
    * one JSONL file: its last ``eval_size`` rows are the eval set, the rows before them the train set
      (so train and eval never share a row).

    Anything else is a hub id, loaded with ``datasets.load_dataset(source, hub_config, split=...)`` (the
    ``datasets`` package is imported only then; it needs network or a populated hub cache).

Reading JSONL
    Local files are read line by line here rather than through ``datasets.load_dataset("json", ...)``:
    that builder infers one schema for the whole file (a missing field silently becomes ``None``) and
    reports a malformed line without its line number, while the messages below name file and line.
    The file is UTF-8; a byte-order mark at its start (written by some Windows tools) is skipped.
    Blank lines are ignored but still counted in line numbers.

Bad rows (one policy for every task)
    A malformed row (invalid UTF-8 or JSON, not an object, a missing, non-string or empty field, or a
    task-specific check such as GSM8K's ``#### <answer>`` line) raises :class:`DataError` whose message is
    ``<file>:<line>: <what is wrong>`` (hub rows: ``<id>[<split>]:row <n>``). With ``skip_bad_rows=True``
    (the task option ``task.options.skip_bad_rows``) such rows are skipped instead, and one warning on the
    ``tba.tasks.data`` logger counts them and quotes the first few. Either way a split with no usable row
    (an empty file, only blank lines, or only bad rows) raises :class:`DataError` naming the file. Tasks
    are built in the CLI before Ray starts, so these errors stop a run before anything is launched.

``train_size`` / ``eval_size`` keep the first that many good rows; reading stops there, so a bad row
after them is not seen.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["DataError", "is_local", "jsonl_rows", "load_rows", "load_splits", "row_strings", "split_file"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Check = Callable[[Any], T]
"""A row check: the parsed JSON row -> the task's record, or ``ValueError`` saying what is wrong."""

_MAX_REPORTED = 5  # bad rows quoted in the skip warning


class DataError(ValueError):
    """Malformed or missing task data; the message starts with the file (``<file>:<line>:`` for one row).

    Hub rows are named ``<id>[<split>]:row <n>``. Subclasses ValueError, so ``except ValueError`` catches it.
    """


def is_local(source: str) -> bool:
    """Whether ``source`` names a local path rather than a hub dataset id.

    The one rule for every task: a path is something that exists on disk, starts with ``/``, ``.`` or
    ``~``, ends with ``.jsonl`` or ``.json``, holds more than one ``/`` (hub ids are ``name`` or
    ``owner/name``), or holds the platform's own path separator where that is not ``/``.

    Examples::

        is_local("openai/gsm8k")        -> False   (unless a folder of that name exists here)
        is_local("data/gsm8k/train")    -> True
        is_local("./gsm8k")             -> True
        is_local("train.jsonl")         -> True
    """
    if os.path.exists(source):
        return True
    if source.startswith(("/", ".", "~")) or source.endswith((".jsonl", ".json")):
        return True
    return source.count("/") > 1 or (os.sep != "/" and os.sep in source)


def row_strings(row: Any, fields: Iterable[str | tuple[str, ...]]) -> list[str]:
    """The values of string ``fields`` of one JSON row, checked.

    Args:
        row: the parsed JSON value of one line.
        fields: field names; a tuple lists alternative names, the first present one is used
            (``("reference", "completion")``).

    Returns:
        The values as written (not stripped), in the order of ``fields``.

    Raises:
        ValueError: ``row`` is not an object, or a field is missing, not a string or blank.
    """
    names = [f if isinstance(f, tuple) else (f,) for f in fields]
    if not isinstance(row, dict):
        wanted = " and ".join(repr(n[0]) for n in names)
        raise ValueError(f"expected a JSON object with {wanted}, got {type(row).__name__}")
    out = []
    for alternatives in names:
        key = next((k for k in alternatives if k in row), None)
        if key is None:
            others = "".join(f" (or {k!r})" for k in alternatives[1:])
            raise ValueError(f"missing field {alternatives[0]!r}{others}")
        if not isinstance(row[key], str):
            raise ValueError(f"field {key!r} must be a string, got {type(row[key]).__name__}")
        if not row[key].strip():
            raise ValueError(f"empty {key!r}")
        out.append(row[key])
    return out


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``("<path>:<line>", row)`` for each non-blank line of a JSONL file.

    ``row`` is the parsed JSON value, or a ``ValueError`` describing why the line is not valid UTF-8 or
    JSON (yielded, not raised, so the caller applies its bad-row policy). A UTF-8 byte-order mark at the
    start of the file is skipped. Line numbers are 1-based and count blank lines.
    """
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield where, ValueError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})")


def _hub_rows(source: str, split: str, hub_config: str | None) -> Iterator[tuple[str, Any]]:
    try:
        import datasets  # lazy: heavy, and only needed for hub sources
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise ImportError(f"loading the hub dataset {source!r} needs the 'datasets' package; install it "
                          "or pass a local JSONL file or folder") from exc
    try:
        ds = datasets.load_dataset(source, hub_config, split=split)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"tba: {source!r} was read as a hub dataset id because no local path of that name "
                         "exists; pass a JSONL file or a folder holding train.jsonl for local data")
        raise
    for i, row in enumerate(ds, start=1):
        yield f"{source}[{split}]:row {i}", row


def _collect(rows: Iterable[tuple[str, Any]], check: Check, where: str, limit: int | None,
             skip_bad_rows: bool, empty: str) -> list:
    """Checked rows (the first ``limit`` good ones) under the module's bad-row policy."""
    out: list = []
    bad: list[str] = []
    seen = 0
    for loc, row in rows:
        if limit is not None and len(out) >= limit:
            break
        seen += 1
        try:
            if isinstance(row, Exception):
                raise row
            out.append(check(row))
        except ValueError as exc:
            if not skip_bad_rows:
                raise DataError(f"{loc}: {exc}") from None
            bad.append(f"{loc}: {exc}")
    if bad:
        more = f" (and {len(bad) - _MAX_REPORTED} more)" if len(bad) > _MAX_REPORTED else ""
        logger.warning("skipped %d bad row(s) in %s: %s%s", len(bad), where, "; ".join(bad[:_MAX_REPORTED]), more)
    if not out:
        if not seen:
            raise DataError(f"{where}: no rows ({empty})")
        raise DataError(f"{where}: no usable rows (all {seen} are malformed; the first: {bad[0]})")
    return out


def _read_file(path: Path, check: Check, limit: int | None, skip_bad_rows: bool) -> list:
    empty = "the file is empty" if path.stat().st_size == 0 else "only blank lines"
    return _collect(jsonl_rows(path), check, str(path), limit, skip_bad_rows, empty)


def split_file(folder: Path, split: str, fallback: str | None = None) -> Path:
    """The file of ``split`` in a data folder: ``<folder>/<split>.jsonl``, else ``<folder>/<fallback>.jsonl``.

    Raises:
        FileNotFoundError: neither exists; the message lists the folder's ``.jsonl`` files.
    """
    for name in (split, fallback):
        if name and (folder / f"{name}.jsonl").is_file():
            return folder / f"{name}.jsonl"
    wanted = f"{split}.jsonl" + (f" (or {fallback}.jsonl)" if fallback and fallback != split else "")
    found = ", ".join(sorted(p.name for p in folder.glob("*.jsonl"))) or "no .jsonl files"
    raise FileNotFoundError(f"no {wanted} in folder {folder} (found: {found})")


def _local_path(source: str, hint: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data not found at {path}; pass a JSONL file, a folder holding train.jsonl and "
                                f"test.jsonl, or a hub dataset id{hint}")
    return path


def load_rows(source: str, split: str, check: Check, *, limit: int | None = None, hub_config: str | None = None,
              skip_bad_rows: bool = False, fallback: str | None = None, hint: str = "") -> list:
    """The checked rows of one split: a JSONL file (all of it), ``<folder>/<split>.jsonl`` or a hub split.

    Args:
        source: file, folder or hub id (:func:`is_local` decides).
        split: split name (folder file name, hub split).
        check: row check (see :data:`Check`); its ValueError becomes a :class:`DataError` naming the row.
        limit: keep the first ``limit`` good rows (None: all).
        hub_config: hub dataset config (GSM8K: ``main``).
        skip_bad_rows: skip malformed rows with one warning instead of raising.
        fallback: folder split read when ``<split>.jsonl`` is missing.
        hint: appended to the not-found message, e.g. ``" such as openai/gsm8k"``.

    Raises:
        DataError: a malformed row, or no usable row. FileNotFoundError: a missing local path or split file.
    """
    if not is_local(source):
        return _collect(_hub_rows(source, split, hub_config), check, f"{source}[{split}]", limit, skip_bad_rows,
                        "the split is empty")
    path = _local_path(source, hint)
    if path.is_dir():
        path = split_file(path, split, fallback)
    return _read_file(path, check, limit, skip_bad_rows)


def load_splits(source: str, check: Check, *, train_size: int, eval_size: int, eval_split: str = "test",
                hub_config: str | None = None, skip_bad_rows: bool = False, hint: str = "") -> tuple[list, list]:
    """Train and eval records of a task: the first ``train_size`` / ``eval_size`` good rows of each split.

    Folder: ``train.jsonl`` and ``{eval_split}.jsonl`` (else ``test.jsonl``). Hub id: splits ``train`` and
    ``eval_split``. One file: the last ``eval_size`` rows are held out for eval, the first ``train_size`` of
    the rest are the train set (the whole file is read). Other arguments as in :func:`load_rows`.

    Raises:
        DataError: a malformed row, a split without a usable row, or one file with no more rows than
            ``eval_size``.
        FileNotFoundError: a missing local path or split file.
    """
    path = _local_path(source, hint) if is_local(source) else None
    if path is not None and path.is_file():
        rows = _read_file(path, check, None, skip_bad_rows)
        if len(rows) <= eval_size:
            raise DataError(f"{path}: {len(rows)} usable rows; one file needs more than task.eval_size="
                            f"{eval_size} (its last eval_size rows are held out for eval)")
        return rows[: len(rows) - eval_size][:train_size], rows[len(rows) - eval_size :]
    common = {"hub_config": hub_config, "skip_bad_rows": skip_bad_rows, "hint": hint}
    train = load_rows(source, "train", check, limit=train_size, **common)
    evals = load_rows(source, eval_split, check, limit=eval_size, fallback="test", **common)
    return train, evals
