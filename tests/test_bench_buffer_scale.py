"""The buffer-scale benchmark (benchmarks/buffer_scale.py): its quantile helper, and a tiny run on real Ray
that must deliver every add, serve the trainer's samples and publish the 2-layer pack to every searcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, load_benchmark

bs = load_benchmark("buffer_scale")


def test_percentile_interpolates_like_numpy_linear():
    assert bs.percentile([3.0], 0.9) == 3.0
    assert bs.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert bs.percentile([5.0, 1.0, 4.0, 2.0, 3.0], 0.9) == pytest.approx(4.6)  # numpy.percentile(..., 90)
    assert bs.percentile([0.0, 10.0], 0.25) == 2.5


def test_make_samples_are_distinct_and_sized():
    import random

    samples = bs.make_samples(5, 7, 11, random.Random(0))
    assert all(len(s.prompt_ids) == 7 and len(s.response_ids) == len(s.logprobs) == len(s.ref_logprobs) == 11
               for s in samples)
    assert len({tuple(s.response_ids) for s in samples}) == 5


def test_tiny_run_adds_samples_and_publishes_to_every_searcher(tmp_path):
    """2 clients x 0.5 s on a 20-prompt buffer, then the pack to 2 searchers: the report holds the idle and
    loaded rows (adds counted, samples = adds x batch, sample latencies timed) and the publication to both
    (every searcher read the published version: the script asserts it)."""
    out = tmp_path / "bs.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "buffer_scale.py"), "--clients", "2",
                        "--client-procs", "1", "--seconds", "0.5", "--windows", "1", "--prompts", "20", "--capacity",
                        "5", "--batch-prompts", "2", "--samples-per-prompt", "4", "--train-prompts", "4",
                        "--group-size", "4", "--publish-n", "2", "--publish-repeats", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    idle, loaded = res["adds"]
    assert idle["clients"] == 0 and idle["adds_per_s"] == 0 and idle["sample_median_s"] > 0
    assert loaded["clients"] == 2 and loaded["adds_per_s"] > 0 and loaded["sample_median_s"] > 0
    assert loaded["samples_per_s"] == pytest.approx(loaded["adds_per_s"] * 8)
    assert res["meta"]["buffer_size"] == 100
    (row,) = res["publish"]["rows"]
    assert row["n"] == 2 and row["bytes"] > 30e6 and row["all_n_median_s"] >= row["get_median_s"]
    assert out.with_suffix(".md").read_text().startswith("# One buffer actor")
