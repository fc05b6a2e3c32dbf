"""benchmarks/staleness.py: the cell plan and the report on a hand-written results.jsonl (no training)."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("staleness")


def _rec(obj, k, m, seed, acc, stale, stale_max, wall, base=0.3, stderr=0.05, **kw):
    return {"objective": obj, "k": k, "m": m, "seed": seed, "steps": 40, "setup": "abc", "accuracy": acc,
            "stderr": stderr, "base_accuracy": base, "staleness_mean": stale, "staleness_max": stale_max,
            "train_wall_s": wall, **kw}


RECORDS = [
    _rec("tb", 4, 0.95, 0, 0.40, 3.0, 7, 100.0),
    _rec("tb", 4, 0.95, 1, 0.50, 5.0, 9, 120.0),
    _rec("tb", 4, 0.5, 0, 0.30, 10.0, 30, 90.0),
    _rec("rloo", 1, 0.95, 0, 0.20, 1.0, 3, 80.0, stderr=0.04),
    _rec("rloo", 1, 0.95, 1, 0.35, 2.0, 5, 70.0, stderr=0.06),
    {"objective": "grpo", "k": 16, "m": 0.95, "seed": 0, "steps": 40, "setup": "abc", "error": "RuntimeError: x"},
]


def test_plan_cells_tb_gets_every_m_others_the_config_m(bench):
    cells = bench.plan_cells(["tb", "rloo"], [1, 4], [0.5, 0.95], [0, 1], base_m=0.9)
    assert len(cells) == 2 * (2 * 2 + 2)  # seeds x (tb: k x m + rloo: k)
    assert {c["m"] for c in cells if c["objective"] == "rloo"} == {0.9}
    assert {(c["k"], c["m"]) for c in cells if c["objective"] == "tb"} == {(1, 0.5), (1, 0.95), (4, 0.5), (4, 0.95)}
    assert [c["seed"] for c in cells] == [0] * 6 + [1] * 6  # seed-major: complete seeds first


def test_aggregate_hand_computed(bench):
    rows = bench.aggregate(RECORDS)
    assert [(r["objective"], r["k"], r["m"]) for r in rows] == [("tb", 4, 0.95), ("tb", 4, 0.5), ("rloo", 1, 0.95)]
    tb, tb_half, rloo = rows
    assert tb["n_seeds"] == 2 and tb["seeds"] == [0, 1]
    assert tb["acc_mean"] == pytest.approx(0.45)
    assert (tb["acc_min"], tb["acc_max"]) == (0.40, 0.50)
    assert tb["acc_std"] == pytest.approx(0.0707107, abs=1e-6)  # sample std of {0.4, 0.5} = 0.1 / sqrt(2)
    assert tb["staleness_mean"] == pytest.approx(4.0) and tb["staleness_max"] == 9
    assert tb["wall_s"] == pytest.approx(110.0)
    assert tb_half["n_seeds"] == 1 and tb_half["acc_std"] == 0.0 and tb_half["acc_mean"] == pytest.approx(0.30)
    assert rloo["acc_mean"] == pytest.approx(0.275) and rloo["stderr_mean"] == pytest.approx(0.05)
    assert rloo["staleness_mean"] == pytest.approx(1.5) and rloo["wall_s"] == pytest.approx(75.0)


def test_rerun_cell_counts_once_latest_wins(bench):
    rows = bench.aggregate(RECORDS[:2] + [_rec("tb", 4, 0.95, 1, 0.60, 5.0, 9, 120.0)])
    assert rows[0]["n_seeds"] == 2 and rows[0]["acc_mean"] == pytest.approx(0.50)


def test_report_writes_table_and_png(bench, tmp_path):
    # a torn last line (a study killed mid-write) is skipped
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + '{"torn": ')
    table = bench.report(tmp_path)
    assert (tmp_path / "table.md").read_text() == table
    assert "| tb | 4 | 0.95 | 0.450 (0.400-0.500) | 0.071 | 0.050 | 2 | 4.00 | 9 | 110 |" in table
    assert "| rloo | 1 | 0.95 | 0.275 (0.200-0.350) | 0.106 | 0.050 | 2 | 1.50 | 5 | 75 |" in table
    assert "Base model accuracy (before training): 0.300" in table
    assert "grpo-k16-m0.95-s0 (RuntimeError: x)" in table  # failed cells are listed, not tabulated
    png = tmp_path / "accuracy_vs_staleness.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
