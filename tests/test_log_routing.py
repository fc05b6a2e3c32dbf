"""Where log lines go (tba.logger): tba's on the console; a library's in RUN_DIR/third_party.log, and each
distinct library warning once on the console. In-process, on the real logging and warnings modules."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from tba.logger import LIBRARY_LOG, remove_routes, route_console, route_library_file


@pytest.fixture()
def routed(tmp_path):
    """(console stream, library log path) with both routes installed; removed afterwards."""
    stream = io.StringIO()
    route_console(stream)
    route_library_file(tmp_path, "searcher 0")
    yield stream, tmp_path / LIBRARY_LOG
    remove_routes()


def test_library_warning_once_on_console_every_one_in_the_file(routed):
    stream, path = routed
    lib, own = logging.getLogger("somelib.loader"), logging.getLogger("tba.searcher")
    lib.warning("RotaryEmbedding: failed to load weights")
    lib.warning("RotaryEmbedding: failed to load weights")  # the same again: file only
    for name in ("embed.weight", "norm.weight"):  # one template, two texts: one message
        lib.warning("weight %s has dtype %s", name, "float32")
    lib.info("weights reloaded in %.2f s", 0.25)  # below WARNING: file only
    for text in ("cache reset", "cache reset", "engine rebuilt"):  # a template of placeholders only: its text
        lib.warning("%s", text)
    lib.warning("a table:\nrow 1\nrow 2")  # cut to its first line on the console
    own.warning("searcher %d died", 0)
    own.warning("searcher %d died", 0)  # tba's own lines are never deduplicated, nor filed
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for text in ("old API a", "old API a", "old API b"):  # Python warnings, through logging
            warnings.warn(text, FutureWarning, stacklevel=1)
    for handler in logging.getLogger().handlers:
        handler.flush()

    console = stream.getvalue().splitlines()
    assert console[:7] == [
        "WARNING somelib.loader: RotaryEmbedding: failed to load weights",
        "WARNING somelib.loader: weight embed.weight has dtype float32",
        "WARNING somelib.loader: cache reset",
        "WARNING somelib.loader: engine rebuilt",
        "WARNING somelib.loader: a table: [...]",
        "WARNING tba.searcher: searcher 0 died",
        "WARNING tba.searcher: searcher 0 died",
    ]
    assert len(console) == 9 and all(line.startswith("WARNING py.warnings: ") for line in console[7:])
    assert "FutureWarning: old API a" in console[7] and "FutureWarning: old API b" in console[8]

    filed = path.read_text().splitlines()
    assert sum("RotaryEmbedding: failed to load weights" in line for line in filed) == 2
    assert sum("has dtype float32" in line for line in filed) == 2
    assert sum("weights reloaded in 0.25 s" in line for line in filed) == 1
    assert sum("cache reset" in line for line in filed) == 2
    assert "row 2" in filed and sum("old API a" in line for line in filed) == 2
    assert not any("searcher 0 died" in line for line in filed)
    assert all("[searcher 0 pid " in line for line in filed if line.startswith("20"))


def test_remove_routes_gives_logging_back(tmp_path):
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    route_console(io.StringIO())
    route_console(io.StringIO())  # again, another stream: replaces the handler
    route_library_file(tmp_path, "driver")
    assert len(root.handlers) == len(handlers) + 2
    remove_routes()
    assert root.level == level and root.handlers == handlers
