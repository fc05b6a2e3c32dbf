"""benchmarks/offpolicy.py: the cell plan, each cell's config, and the statistics of the report on
hand-written records (no training; the lag itself is tested end to end in test_e2e.py)."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, load_benchmark

from tba.config import load_config

QUICKSTART = ROOT / "configs/quickstart.yaml"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("offpolicy")


def _rec(arm, lag, seed, acc, k=1, stale=1.0, **kw):
    obj = {"tb-noclip": "tb", "grpo-noclip": "grpo"}.get(arm, arm)
    return {"arm": arm, "objective": obj, "lag": lag, "k": k, "seed": seed, "setup": "abc", "accuracy": acc,
            "n_eval": 500, "staleness_mean": stale, "staleness_max": stale * 2, "train_wall_s": 300.0, **kw}


# drops L0 -> L16: tb 0.10, 0.04, 0.10 (mean 0.08); grpo 0.02, 0.10, 0.01 (mean 0.04333)
RECORDS = [
    _rec("tb", 0, 0, 0.50, base_accuracy=0.3, base_measured=True), _rec("tb", 0, 1, 0.46), _rec("tb", 0, 2, 0.48),
    _rec("tb", 16, 0, 0.40), _rec("tb", 16, 1, 0.42), _rec("tb", 16, 2, 0.38),
    _rec("grpo", 0, 0, 0.52), _rec("grpo", 0, 1, 0.50), _rec("grpo", 0, 2, 0.45),
    _rec("grpo", 16, 0, 0.50), _rec("grpo", 16, 1, 0.40), _rec("grpo", 16, 2, 0.44),
    _rec("rloo", 0, 0, 0.47),  # no L16 partner: no drop
    {"arm": "rloo", "objective": "rloo", "lag": 16, "k": 1, "seed": 0, "setup": "abc", "error": "RuntimeError: x"},
]


def test_plan_orders_the_answering_cells_first(bench):
    cells = bench.plan_cells([0, 1], ["tb", "grpo"], [0, 4, 16], ["tb-noclip"], sync_k=16)
    per_seed = 2 * 2 + 1 * 2 + 2 * 1 + 2  # main at the ends, mechanism at the ends, main at L4, main at k16
    assert len(cells) == 2 * per_seed
    first = [(c["arm"], c["lag"], c["k"]) for c in cells[:per_seed]]
    assert first == [("tb", 0, 1), ("grpo", 0, 1), ("tb", 16, 1), ("grpo", 16, 1),
                     ("tb-noclip", 0, 1), ("tb-noclip", 16, 1), ("tb", 4, 1), ("grpo", 4, 1),
                     ("tb", 0, 16), ("grpo", 0, 16)]
    assert {c["seed"] for c in cells[:per_seed]} == {0} and {c["seed"] for c in cells[per_seed:]} == {1}
    assert bench.plan_cells([0], ["tb"], [0, 16], [], sync_k=None) == [
        {"arm": "tb", "objective": "tb", "lag": 0, "k": 1, "seed": 0},
        {"arm": "tb", "objective": "tb", "lag": 16, "k": 1, "seed": 0}]


@pytest.mark.parametrize("arm", ["tb", "rloo", "grpo", "ppo_clip-is2", "tb-beta0.05", "tb-noclip", "grpo-noclip"])
def test_every_arm_is_a_valid_config_with_its_settings(bench, arm, tmp_path):
    c = {"arm": arm, "objective": bench.ARMS[arm][0], "lag": 16, "k": 1, "seed": 2}
    cfg = load_config(QUICKSTART, bench.cell_overrides(bench.BENCH_DEFAULTS, c, 60, 500, tmp_path, measure_base=False))
    assert (cfg.loss.name, cfg.trainer.generation_lag, cfg.trainer.sync_period, cfg.run.seed) == (
        bench.ARMS[arm][0], 16, 1, 2)
    assert cfg.task.eval_size == 500 and cfg.trainer.max_steps == 60 and cfg.run.eval_before is False
    expected = {"ppo_clip-is2": ("loss", "is_cap", 2.0), "tb-beta0.05": ("trainer", "beta_end", 0.05),
                "tb-noclip": ("trainer", "grad_clip", None), "grpo-noclip": ("loss", "clip_eps", 1e9)}
    if arm in expected:
        section, field, value = expected[arm]
        assert getattr(getattr(cfg, section), field) == value
    else:  # a main arm keeps the config's clipping and KL schedule
        base = load_config(QUICKSTART).trainer
        assert cfg.trainer.grad_clip == 1.0 and cfg.loss.is_cap is None
        assert (cfg.trainer.beta_start, cfg.trainer.beta_end) == (base.beta_start, base.beta_end)


def test_effects_hand_computed(bench):
    eff = {e["arm"]: e for e in bench.effects(RECORDS, (0, 1), (16, 1))}
    assert set(eff) == {"tb", "grpo"}  # rloo has no L16 partner
    assert eff["tb"]["drop"]["mean"] == pytest.approx(0.08)
    assert eff["grpo"]["drop"]["mean"] == pytest.approx(0.043333, abs=1e-6)
    d = eff["grpo"]["ref_minus_arm"]  # per seed 0.08, -0.06, 0.09: sd 0.083866, t(0.975, 2) = 4.302653
    assert d["mean"] == pytest.approx(0.036667, abs=1e-6) and d["n"] == 3
    assert (d["low"], d["high"]) == (pytest.approx(-0.17167, abs=1e-4), pytest.approx(0.24500, abs=1e-4))
    assert "ref_minus_arm" not in eff["tb"]


def test_aggregate_ci_and_latest_rerun_wins(bench):
    rows = {(r["arm"], r["lag"], r["k"]): r for r in bench.aggregate(RECORDS + [_rec("rloo", 0, 0, 0.55)])}
    tb0 = rows[("tb", 0, 1)]["acc"]  # 0.50, 0.46, 0.48: sd 0.02, half width 4.302653 * 0.02 / sqrt(3)
    assert tb0["mean"] == pytest.approx(0.48)
    assert (tb0["low"], tb0["high"]) == (pytest.approx(0.430317, abs=1e-5), pytest.approx(0.529683, abs=1e-5))
    assert rows[("rloo", 0, 1)]["acc"]["mean"] == 0.55 and rows[("rloo", 0, 1)]["acc"]["n"] == 1
    assert ("rloo", 16, 1) not in rows  # the failed cell


def test_run_metrics_from_metrics_jsonl(bench, tmp_path):
    lines = [{"step": 0, "eval/accuracy": 0.3},
             {"step": 1, "buffer/reuse_mean": 1.0, "buffer/reuse_max": 1, "buffer/staleness_min": 2,
              "train/clipped": 1.0, "train/abs_logratio_token_mean": 0.03},
             {"step": 2, "buffer/reuse_mean": 2.0, "buffer/reuse_max": 4, "buffer/staleness_min": 1,
              "train/clipped": 0.0, "train/abs_logratio_token_mean": 0.05}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert bench.run_metrics(tmp_path) == pytest.approx({"reuse_mean": 1.5, "reuse_max": 4, "staleness_min": 1,
                                                         "clipped_frac": 0.5, "abs_logratio_token": 0.04})


def test_report_table_effects_and_png(bench, tmp_path):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + '{"torn": ')
    table = bench.report(tmp_path, 0, 16)
    assert (tmp_path / "table.md").read_text() == table
    assert "| tb | L0 | 0.480 [0.430, 0.530] (n=3) |" in table
    assert "| grpo | 0.043 [-0.079, 0.166] (n=3) | 0.037 [-0.172, 0.245] (n=3) |" in table
    assert "Base model (before training): 0.300." in table
    assert "rloo-L16-s0 (RuntimeError: x)" in table
    assert "k = 16" not in table  # no sync-period cells, no such comparison
    assert (tmp_path / "accuracy_vs_staleness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_period_comparison(bench, tmp_path):
    # drops L0 (k = 1) -> k = 16: tb 0.50-0.30, 0.46-0.40 = 0.20, 0.06; grpo 0.52-0.50, 0.50-0.30 = 0.02, 0.20
    sync = [_rec("tb", 0, 0, 0.30, k=16), _rec("tb", 0, 1, 0.40, k=16),
            _rec("grpo", 0, 0, 0.50, k=16), _rec("grpo", 0, 1, 0.30, k=16)]
    eff = {e["arm"]: e for e in bench.effects(RECORDS + sync, (0, 1), (0, 16))}
    assert eff["tb"]["drop"]["mean"] == pytest.approx(0.13) and eff["tb"]["seeds"] == [0, 1]
    d = eff["grpo"]["ref_minus_arm"]  # per seed 0.18, -0.14: mean 0.02, sd 0.226274, t(0.975, 1) = 12.706205
    assert d["mean"] == pytest.approx(0.02) and d["n"] == 2
    assert (d["low"], d["high"]) == (pytest.approx(-2.01299, abs=1e-4), pytest.approx(2.05299, abs=1e-4))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS + sync))
    table = bench.report(tmp_path, 0, 16)
    assert "Drop from lag 0, k = 1 to k = 16" in table
    assert "| grpo | 0.110 [-1.034, 1.254] (n=2) | 0.020 [-2.013, 2.053] (n=2) |" in table
    assert "| tb | k16 | 0.350 [-0.285, 0.985] (n=2) |" in table
    assert (tmp_path / "accuracy_vs_staleness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_middle_lag_comparison(bench, tmp_path):
    # drops L0 -> L4: tb 0.50-0.44, 0.46-0.46 = 0.06, 0.00; grpo 0.52-0.42, 0.50-0.48 = 0.10, 0.02
    # tb minus grpo per seed -0.04, -0.02: mean -0.03, sd 0.0141421, half-width 12.706205 * 0.01 = 0.12706
    lag4 = [_rec("tb", 4, 0, 0.44), _rec("tb", 4, 1, 0.46), _rec("grpo", 4, 0, 0.42), _rec("grpo", 4, 1, 0.48)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS + lag4))
    table = bench.report(tmp_path, 0, 16)
    assert table.index("Drop from lag 0 to lag 16 (k = 1)") < table.index("Drop from lag 0 to lag 4 (k = 1)")
    assert "| grpo | 0.060 [-0.448, 0.568] (n=2) | -0.030 [-0.157, 0.097] (n=2) |" in table


def test_existing_results_need_resume(bench, tmp_path, capsys):
    (tmp_path / "results.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    assert bench.main(["--out", str(tmp_path), "--seeds", "0"]) == 2
    assert "--resume" in capsys.readouterr().err
