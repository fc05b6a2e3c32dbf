"""Helpers shared by the benchmark scripts in this folder (not part of the ``tba`` package).

The scripts import it as ``_common`` (they put this folder on ``sys.path`` first, so that also works when a
test loads a script by its path). Only the standard library is imported at module level: Ray workers of
``throughput.py`` import this module too, to report their memory.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items -> {dotted key: value}, parsed by tba's own override parser."""
    from tba.config import parse_assignments

    return parse_assignments(items, "--set")


def quiet_env() -> None:
    """Silence transformers' info logs and the tokenizers fork warning (unless the caller set them)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def warnings_only_logging() -> None:
    """Root logging at WARNING, one line per record with the logger's name."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def pick_device(name: str) -> str:
    """``auto`` -> ``cuda`` if a GPU is available, else ``cpu``; any other name as given."""
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def peak_rss_mib() -> float:
    """Peak resident set size of this process, MiB (Linux reports KiB, macOS bytes)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def command_line(argv: list[str]) -> str:
    """The command that ran this script, for a report: ``python <script> <argv...>``."""
    return "python " + " ".join([sys.argv[0], *argv])


def error_line(e: BaseException, line: int = 0) -> str:
    """``Type: message`` with one line of the message (``line``: 0 the first, -1 the last)."""
    msg = (str(e).strip().splitlines() or [""])[line]
    return f"{type(e).__name__}: {msg}"


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON (anything JSON cannot encode is written as its ``str``)."""
    Path(path).write_text(json.dumps(obj, indent=2, default=str))


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (120 dpi; parent folders created) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def read_results(path: Path) -> list[dict]:
    """Records of ``results.jsonl`` (a torn last line, from a killed run, is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def write_jsonl_gz(path: Path, records: list[dict]) -> None:
    """``records`` as gzip-compressed JSON lines (no time or file name in the header, so the bytes depend on the
    records alone and an unchanged curve is an unchanged file in git). Study curves are committed, and
    compressed they take a sixth of the room: the whole tracked tree must fit the GPU machine's carry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records).encode())


def read_jsonl_gz(path: Path) -> list[dict]:
    """The records written by :func:`write_jsonl_gz`."""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def append_result(path: Path, rec: dict) -> None:
    """Append ``rec`` as one JSON line to ``path`` and fsync it, so a finished cell survives a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def setup_id(config: str, steps: int, eval_size: int, extra: dict) -> str:
    """Short fingerprint of what a study's cells share (config file contents, steps, eval size, --set), so a
    resumed study skips only cells of the same setup."""
    text = Path(config).read_text() if Path(config).is_file() else config
    blob = json.dumps({"config": text, "steps": steps, "eval_size": eval_size, "extra": extra}, sort_keys=True,
                      default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def study_parser(doc: str, config: str, seeds: list[int], out: str):
    """The parser every resumable study starts from (``offpolicy.py``, ``known_optimum.py``,
    ``recipe_sweep.py``): the description (``doc``'s first paragraph), ``--config`` (default ``config``),
    ``--steps``, ``--seeds`` (default ``seeds``), ``--set``, ``--out`` (default ``out``), ``--resume`` and
    ``--report-only``; the study adds its own options."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                epilog="See the module docstring for the design and full commands.")
    p.add_argument("--config", default=config, help="base config shared by every cell")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per cell; default: the config's")
    p.add_argument("--seeds", type=int, nargs="+", default=seeds, help="paired run.seed values")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every cell, repeatable (e.g. model.num_hidden_layers=2)")
    p.add_argument("--out", default=out, help="results folder")
    p.add_argument("--resume", action="store_true", help="continue <out>/results.jsonl, skipping finished cells")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from results.jsonl")
    return p


def start_study(args, defaults: dict[str, Any]):
    """The shared start of a resumable study's ``run_study``.

    Returns:
        ``(extra, base_cfg, out, previous)``: the overrides of every cell (``defaults`` updated with ``--set``),
        the base config they give (loaded, so a bad ``--set`` fails before any model loads), the results
        folder (created) and its earlier records.

    Raises:
        FileExistsError: the folder has records and ``--resume`` was not given (one line for ``study_main``).
    """
    from tba.config import load_config

    extra = {**defaults, **parse_sets(args.set)}
    base_cfg = load_config(args.config, extra)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = read_results(out / "results.jsonl")
    if previous and not args.resume:
        raise FileExistsError(f"{out / 'results.jsonl'} already has {len(previous)} records; add --resume to "
                              "continue it or choose another --out")
    return extra, base_cfg, out, previous


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def study_main(args, run_study: Callable[[Any], int], report: Callable[[Path], str]) -> int:
    """Entry point of the resumable studies (``offpolicy.py``, ``known_optimum.py``).

    ``--report-only``: print ``report(out)`` from ``<out>/results.jsonl`` (exit 1 if there is none). Otherwise
    run ``run_study(args)`` with SIGTERM raising KeyboardInterrupt (the study then keeps its finished cells and
    exits 130); a bad config or a missing file is one ``error:`` line and exit 2.
    """
    out = Path(args.out)
    if args.report_only:
        if not (out / "results.jsonl").is_file():
            print(f"error: no {out / 'results.jsonl'}", file=sys.stderr)
            return 1
        print(report(out))
        return 0
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings_only_logging()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    from tba.config import ConfigError

    try:
        return run_study(args)
    except (ConfigError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
