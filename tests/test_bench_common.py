"""benchmarks/_common.py: the compressed curve files the studies commit."""

from __future__ import annotations

import gzip
import json
import time

from conftest import load_benchmark

common = load_benchmark("_common")


def test_curves_round_trip_and_their_bytes_depend_on_the_records_alone(tmp_path):
    """What is written reads back as it was, and the same records written a second later to another file name
    are the same bytes (gzip's header would otherwise hold the time and the name, and every rewritten curve
    would be a change in git)."""
    records = [{"step": 1, "eval/kl": 2.156, "train/clipped": 0.0}, {"step": 2, "loss/tb": -0.5}]
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "sub" / "b.jsonl.gz"
    common.write_jsonl_gz(a, records)
    time.sleep(1.1)  # gzip's header time has a resolution of 1 s
    common.write_jsonl_gz(b, records)
    assert common.read_jsonl_gz(a) == records
    assert a.read_bytes() == b.read_bytes()
    with gzip.open(a, "rt") as f:  # plain gzip JSON lines: any later analysis reads it without tba
        assert [json.loads(line) for line in f] == records
