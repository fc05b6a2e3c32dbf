"""benchmarks/recipe_sweep.py: each arm's config, a cell's eval scores from a hand-written metrics file, and
the report's statistics on hand-written records (no training)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import ROOT, load_benchmark

from tba.config import load_config

BASE_CONFIG = "benchmarks/results/recipe_sweep/base_config.yaml"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("recipe_sweep")


def test_frozen_base_config_keeps_the_committed_cells_setup(bench):
    """The sweep's default config is frozen: its fingerprint must still be the committed cells' setup, or a
    resumed sweep would rerun all of them."""
    records = bench.read_results(ROOT / "benchmarks/results/recipe_sweep/results.jsonl")
    cfg = load_config(ROOT / BASE_CONFIG)
    setup = bench.setup_id(str(ROOT / BASE_CONFIG), cfg.trainer.max_steps, cfg.task.eval_size,
                           dict(bench.BENCH_DEFAULTS))
    assert setup in {r["setup"] for r in records if r["steps"] == cfg.trainer.max_steps}


@pytest.mark.parametrize("arm", ["shipped", "const-0.05", "anneal-0.02", "lr4e-5"])
def test_every_arm_is_a_valid_config_with_its_settings(bench, arm, tmp_path):
    c = {"arm": arm, "k": 1, "seed": 3}
    cfg = load_config(ROOT / BASE_CONFIG,
                      bench.cell_overrides(bench.BENCH_DEFAULTS, c, 150, tmp_path, measure_base=False))
    t = cfg.trainer
    assert (t.sync_period, cfg.run.seed, t.max_steps, cfg.run.eval_every, cfg.run.eval_before) == (1, 3, 150, 10,
                                                                                                   False)
    expected = {"shipped": (0.012, 0.004, 60, 2e-5), "const-0.05": (0.05, 0.05, 60, 2e-5),
                "anneal-0.02": (0.02, 0.02 / 3, 150, 2e-5), "lr4e-5": (0.012, 0.004, 60, 4e-5)}[arm]
    assert (t.beta_start, t.beta_end, t.beta_anneal_steps, t.lr) == pytest.approx(expected)


def test_eval_points_and_last_mean_from_a_metrics_file(bench, tmp_path):
    """Evals at steps 10, 20, 30 in metrics.jsonl and the eval after training at 30 (it replaces the logged
    one): points 0.2, 0.3, 0.6; the last 3 average (0.2 + 0.3 + 0.6) / 3 = 0.3667, the last 2 0.45."""
    rows = [{"step": 5, "loss/tb": 1.0}, {"step": 10, "eval/accuracy": 0.2, "eval/stderr": 0.05},
            {"step": 20, "eval/accuracy": 0.3}, {"step": 30, "eval/accuracy": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    points = bench.eval_points(path, {"accuracy": 0.6, "stderr": 0.04}, 30)
    assert points == [(10, 0.2), (20, 0.3), (30, 0.6)]
    assert bench.last_mean(points) == pytest.approx(0.36667, abs=1e-5)
    assert bench.last_mean(points, 2) == pytest.approx(0.45)
    assert bench.last_mean([]) is None


def _rec(arm, seed, acc, last, k=1, **kw):
    return {"arm": arm, "k": k, "seed": seed, "setup": "abc", "accuracy": acc, "last_mean": last,
            "train_wall_s": 300.0 + seed, **kw}


# base 0.30; shipped finals 0.20, 0.50 (gains -0.10, +0.20); const-0.05 finals 0.45, 0.40 (gains 0.15, 0.10)
RECORDS = [
    _rec("shipped", 0, 0.20, 0.25, base_accuracy=0.30, base_measured=True), _rec("shipped", 1, 0.50, 0.45),
    _rec("const-0.05", 0, 0.45, 0.45), _rec("const-0.05", 1, 0.40, 0.55),
    _rec("const-0.05", 0, 0.45, 0.45, k=2),  # no shipped partner at k = 2: not paired
    {"arm": "lr4e-5", "k": 1, "seed": 0, "setup": "abc", "error": "RuntimeError: x"},
]


def test_aggregate_hand_computed(bench):
    rows = {(r["arm"], r["k"]): r for r in bench.aggregate(RECORDS)}
    assert list(rows) == [("shipped", 1), ("const-0.05", 1), ("const-0.05", 2)]
    shipped = rows[("shipped", 1)]
    assert shipped["final"]["mean"] == pytest.approx(0.35) and shipped["last"]["mean"] == pytest.approx(0.35)
    assert shipped["gain"]["mean"] == pytest.approx(0.05) and shipped["min_gain"] == pytest.approx(-0.10)
    assert shipped["above"] == 1 and shipped["sd"] == pytest.approx(0.3 / math.sqrt(2))
    # t(0.975, 1) = 12.706; sem of (-0.1, 0.2) = 0.15: 0.05 +- 1.906
    assert shipped["gain"]["low"] == pytest.approx(0.05 - 12.7062 * 0.15, abs=1e-3)
    const = rows[("const-0.05", 1)]
    assert const["above"] == 2 and const["min_gain"] == pytest.approx(0.10) and const["train_s"] == 300.5
    assert rows[("const-0.05", 2)]["seeds"] == [0] and math.isnan(rows[("const-0.05", 2)]["sd"])


def test_versus_pairs_by_seed_and_k(bench):
    """const-0.05 minus shipped at k = 1: last-3 scores 0.45 - 0.25 = 0.20 (seed 0) and 0.55 - 0.45 = 0.10
    (seed 1), mean 0.15; finals 0.45 - 0.20 = 0.25 and 0.40 - 0.50 = -0.10, mean 0.075. Against const-0.05,
    shipped's differences are the negatives, and const-0.05 at k = 2 has no partner at k = 2."""
    (v,) = bench.versus(RECORDS)
    assert (v["arm"], v["k"], v["seeds"]) == ("const-0.05", 1, [0, 1])
    assert (v["last"]["mean"], v["final"]["mean"]) == (pytest.approx(0.15), pytest.approx(0.075))
    (w,) = bench.versus(RECORDS, "const-0.05")
    assert (w["arm"], w["k"], w["last"]["mean"]) == ("shipped", 1, pytest.approx(-0.15))
    assert "No cells of const-0.5 (--versus)" in bench.format_report(RECORDS, ref_arm="const-0.5")


def test_report_names_the_failed_cell_and_the_base(bench, tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    table = bench.report(out)
    assert (out / "table.md").read_text() == table
    assert "| shipped | 1 | 0.350 [" in table and "| 1/2 |" in table and "| 2/2 |" in table
    assert "Base model (before training): 0.300." in table and "lr4e-5-k1-s0 (RuntimeError: x)" in table


def test_shipping_bar_hand_computed(bench):
    """Base 0.30, 5 seeds at k = 1. shipped: finals 0.40 0.45 0.50 0.35 0.40, gains 0.10 0.15 0.20 0.05 0.10,
    all above; mean 0.12, sd 0.0570, lower bound 0.12 - 2.7764 x 0.0570 / sqrt(5) = 0.0492 > 0; but its sd is
    above const-0.05's (finals 0.40 ... 0.48 in steps of 0.02: sd sqrt(0.004 / 4) = 0.0316), so it misses the
    bar. anneal-0.1: one seed at 0.29, below the base. lr4e-5: gains 0.01 x 4 and 0.30, all above, but mean
    0.068, sd 0.1297, lower bound 0.068 - 2.7764 x 0.058 = -0.093. lr1e-5 has 2 seeds: not judged. const-0.05
    at k = 2 (5 seeds, no reference at k = 2 other than itself) meets it."""
    finals = {"shipped": [0.40, 0.45, 0.50, 0.35, 0.40], "const-0.05": [0.40, 0.42, 0.44, 0.46, 0.48],
              "anneal-0.1": [0.29, 0.50, 0.50, 0.50, 0.50], "lr4e-5": [0.31, 0.31, 0.31, 0.31, 0.60],
              "lr1e-5": [0.5, 0.5]}
    recs = [_rec(arm, s, acc, acc) for arm, accs in finals.items() for s, acc in enumerate(accs)]
    recs += [_rec("const-0.05", s, 0.40 + 0.02 * s, 0.4, k=2) for s in range(5)]
    recs[0].update(base_accuracy=0.30, base_measured=True)
    bar = {(b["arm"], b["k"]): b for b in bench.shipping_bar(bench.aggregate(recs))}
    assert set(bar) == {("shipped", 1), ("const-0.05", 1), ("anneal-0.1", 1), ("lr4e-5", 1), ("const-0.05", 2)}
    assert (bar[("shipped", 1)]["all_above"], bar[("shipped", 1)]["low_above_0"]) == (True, True)
    assert (bar[("shipped", 1)]["spread_ok"], bar[("shipped", 1)]["meets"]) == (False, False)
    assert bar[("anneal-0.1", 1)]["all_above"] is False and bar[("anneal-0.1", 1)]["meets"] is False
    assert (bar[("lr4e-5", 1)]["all_above"], bar[("lr4e-5", 1)]["low_above_0"]) == (True, False)
    assert bar[("const-0.05", 1)]["meets"] and bar[("const-0.05", 2)]["meets"]
    rows = {(r["arm"], r["k"]): r for r in bench.aggregate(recs)}
    assert rows[("shipped", 1)]["gain"]["low"] == pytest.approx(0.0492, abs=1e-4)
    assert rows[("const-0.05", 1)]["sd"] == pytest.approx(0.03162, abs=1e-5)
    assert "| shipped | 1 | unrecorded | 5 | yes | yes | no | no |" in bench.format_report(recs)


def test_shipping_bar_spread_reference_from_another_sweep(bench, tmp_path):
    """lr3e-6 at k = 2, 5 seeds: finals 0.40 ... 0.48 in steps of 0.02 (sd 0.0316), all above base 0.30. With
    no const-0.05 of 5 seeds the spread check is undecided, so the verdict is n/a, not no. Against another
    sweep's const-0.05 at k = 2 (finals 0.40, 0.45, 0.50, 0.35, 0.40: sd 0.0570) it meets the bar; against
    one with finals 0.40, 0.41, 0.40, 0.41, 0.40 (sd 0.0055) it misses it. The sd ratio against the wide one:
    0.03162 / 0.05701 = 0.555, its F interval 0.555 / 3.0991 = 0.179 to 0.555 x 3.0991 = 1.719 (sqrt of
    F(0.975; 4, 4) = 9.6045)."""
    recs = [_rec("lr3e-6", s, 0.40 + 0.02 * s, 0.4, k=2) for s in range(5)]
    recs[0].update(base_accuracy=0.30, base_measured=True)
    (bar,) = bench.shipping_bar(bench.aggregate(recs))
    assert (bar["spread_ok"], bar["meets"]) == (None, None)
    wide = [_rec("const-0.05", s, a, a, k=2) for s, a in enumerate([0.40, 0.45, 0.50, 0.35, 0.40])]
    narrow = [_rec("const-0.05", s, a, a, k=2) for s, a in enumerate([0.40, 0.41, 0.40, 0.41, 0.40])]
    assert bench.shipping_bar(bench.aggregate(recs), bench.aggregate(wide))[0]["meets"] is True
    assert bench.shipping_bar(bench.aggregate(recs), bench.aggregate(narrow))[0]["meets"] is False
    out, ref = tmp_path / "sweep", tmp_path / "beta"
    for d, rs in ((out, recs), (ref, wide)):
        d.mkdir()
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    assert "| lr3e-6 | 2 | unrecorded | 5 | yes | yes | n/a | n/a | n/a |" in bench.report(out)
    assert "| lr3e-6 | 2 | unrecorded | 5 | yes | yes | yes | yes | 0.55 [0.18, 1.72] |" in bench.report(out, ref)
    # a reference of another generation dtype is no reference
    other = bench.aggregate([dict(r, gen_dtype="float32") for r in wide])
    assert bench.shipping_bar(bench.aggregate(recs), other)[0]["spread_ok"] is None


def test_late_gain_hand_computed(bench):
    """150 steps, evals at 25, 50, ..., 150 of 0.30 0.40 | 0.35 0.50 0.50 0.60: the first third (steps <= 50)
    averages 0.35, the last 3 (0.5 + 0.5 + 0.6) / 3 = 0.5333, so the cell gained +0.1833 after its first
    third. Two seeds (+0.1833, -0.05): mean +0.0667 in the report."""
    points = [(25, 0.30), (50, 0.40), (75, 0.35), (100, 0.50), (125, 0.50), (150, 0.60)]
    assert bench.late_gain(points, 150) == pytest.approx(0.18333, abs=1e-5)
    assert bench.late_gain(points[2:], 150) is None  # no eval in the first third
    flat = [(25, 0.40), (50, 0.40), (75, 0.40), (100, 0.35), (125, 0.35), (150, 0.35)]
    recs = [_rec("shipped", 0, 0.6, 0.5333, steps=150, evals=points, base_accuracy=0.1, base_measured=True),
            _rec("shipped", 1, 0.35, 0.35, steps=150, evals=flat)]
    (row,) = bench.aggregate(recs)
    assert row["late"]["mean"] == pytest.approx((0.18333 - 0.05) / 2, abs=1e-5) and row["late"]["n"] == 2
    assert "| 0.067 [" in bench.format_report(recs)


def test_gen_dtype_from_the_record_else_from_the_curves_sync_gap(bench, tmp_path):
    """The recorded dtype wins; else the median sync/logprob_gap of the curve: 0.03 (of 0, 0.03, 0.04: a
    bfloat16 engine against the float32 trainer) -> bfloat16, 0 (of 0, 0, 0.01) -> float32."""
    import gzip

    def curve(name, gaps):
        path = tmp_path / f"{name}.jsonl.gz"
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps({"step": i, "sync/logprob_gap": g}) + "\n" for i, g in enumerate(gaps))
            f.write(json.dumps({"step": 9, "eval/accuracy": 0.5}) + "\n")  # records without the gap are skipped
        return str(path)

    assert bench.gen_dtype({"gen_dtype": "float32", "curve": curve("a", [0.0, 0.03, 0.04])}) == "float32"
    assert bench.gen_dtype({"curve": curve("b", [0.0, 0.03, 0.04])}) == "bfloat16"
    assert bench.gen_dtype({"curve": curve("c", [0.0, 0.0, 0.01])}) == "float32"
    assert bench.gen_dtype({"curve": str(tmp_path / "missing.jsonl.gz")}) == bench.gen_dtype({}) == "unrecorded"


def test_gen_dtype_finds_a_committed_curve_from_another_directory(bench, tmp_path, monkeypatch):
    """Records hold curve paths relative to the repository root; the dtype must not turn "unrecorded" (and
    rows merge dtypes again) when the report runs elsewhere. This cell generated in bfloat16 (its sync gap)."""
    monkeypatch.chdir(tmp_path)
    curve = "benchmarks/results/headroom_sweep/chain_sum_2digit_beta/curves/const-0.05-k2-s0.jsonl.gz"
    assert bench.gen_dtype({"curve": curve}) == "bfloat16"


def test_cells_of_different_generation_dtypes_share_no_row_base_or_pair(bench):
    """Seed 0 in bfloat16 (its shipped cell measured the base, 0.30), seed 1 in float32 (no base measured):
    every (arm, k) splits by dtype; seed 0's gains are taken against 0.30 (shipped 0.20 - 0.30 = -0.10), seed
    1's have no base (n/a); const-0.05 pairs with shipped within each dtype only (one seed each: 0.20, 0.10).
    A float32 base of 0.35 then gives seed 1's shipped cell 0.50 - 0.35 = +0.15."""
    one = bench.format_report(RECORDS)
    assert "| 300 | unrecorded |" in one and "Generation dtypes differ" not in one
    mixed = [dict(r, gen_dtype="bfloat16" if r["seed"] == 0 else "float32") for r in RECORDS]
    rows = {(r["arm"], r["k"], r["dtype"]): r for r in bench.aggregate(mixed)}
    assert list(rows) == [("shipped", 1, "bfloat16"), ("shipped", 1, "float32"), ("const-0.05", 1, "bfloat16"),
                          ("const-0.05", 1, "float32"), ("const-0.05", 2, "bfloat16")]
    assert rows[("shipped", 1, "bfloat16")]["gain"]["mean"] == pytest.approx(-0.10)
    assert rows[("shipped", 1, "float32")]["gain"] is None and rows[("shipped", 1, "float32")]["above"] is None
    pairs = {(v["arm"], v["dtype"]): (v["seeds"], v["last"]["mean"]) for v in bench.versus(mixed)}
    assert pairs == {("const-0.05", "bfloat16"): ([0], pytest.approx(0.20)),
                     ("const-0.05", "float32"): ([1], pytest.approx(0.10))}
    table = bench.format_report(mixed)
    assert "Generation dtypes differ between cells" in table
    assert "Base model (before training): 0.300 in bfloat16." in table
    mixed[1].update(base_accuracy=0.35, base_measured=True)
    assert bench.aggregate(mixed)[1]["gain"]["mean"] == pytest.approx(0.15)
    assert "0.300 in bfloat16, 0.350 in float32." in bench.format_report(mixed)


def test_a_resumed_sweep_names_the_other_dtype_of_its_finished_cells(bench):
    recs = [dict(r, gen_dtype="bfloat16") for r in RECORDS]
    assert bench.other_dtype_note(recs, "abc", "bfloat16") is None
    assert "generated in bfloat16, this machine generates in float32" in bench.other_dtype_note(recs, "abc",
                                                                                                 "float32")
    assert bench.other_dtype_note(recs, "other-setup", "float32") is None
    assert bench.other_dtype_note(RECORDS, "abc", "float32") is None  # old cells of no known dtype: nothing to say


def test_merge_renames_the_arms_of_a_sweep_with_other_settings(bench, tmp_path):
    """A sweep that differs only in model.dtype merges as it is (its const-0.05 pairs with this sweep's
    const-0.02 on seed 0: 0.40 - 0.45 = -0.05); one with another lr gets its arms renamed, so its const-0.05
    is an arm of its own, paired against the first (0.30 - 0.45 = -0.15) and listed after it; its lr1e-5 arm,
    which sets the lr itself, keeps its name. Refused, naming the sweep: another step count, another task
    (another base), and a cell both sweeps ran."""
    def rec(arm, acc, over=(), seed=0, **kw):
        return _rec(arm, seed, acc, acc, k=2, steps=150, config="c.yaml", gen_dtype="float32",
                    overrides={"trainer.lr": "3e-6", "run.seed": seed, **bench.ARMS[arm], **dict(over)}, **kw)

    mine = [rec("lr1e-5", 0.38, seed=1), rec("const-0.02", 0.40, base_accuracy=0.1, base_measured=True)]
    f32 = [rec("const-0.05", 0.45, {"model.dtype": "float32"}), rec("lr1e-5", 0.36, {"model.dtype": "float32"})]
    lr = [rec("const-0.05", 0.30, {"trainer.lr": "1e-5"})]
    merged = bench.merge_records(mine, {"lr": lr, "f32": f32})
    assert [r["arm"] for r in merged[2:]] == ["const-0.05 [trainer.lr=1e-5]", "const-0.05", "lr1e-5"]
    assert [r["arm"] for r in bench.aggregate(merged)] == ["const-0.02", "const-0.05", "const-0.05 [trainer.lr=1e-5]",
                                                            "lr1e-5"]
    diffs = {v["arm"]: v["final"]["mean"] for v in bench.versus(merged, "const-0.05")}
    assert diffs == {"const-0.02": pytest.approx(-0.05), "const-0.05 [trainer.lr=1e-5]": pytest.approx(-0.15),
                     "lr1e-5": pytest.approx(0.36 - 0.45)}
    with pytest.raises(SystemExit, match="--merge other: .*150"):
        bench.merge_records(mine, {"other": [dict(f32[0], steps=300)]})
    with pytest.raises(SystemExit, match="--merge gcd: it sets task.name differently"):
        bench.merge_records(mine, {"gcd": [rec("const-0.05", 0.5, {"task.name": "reasoning_gym:gcd"})]})
    with pytest.raises(SystemExit, match="--merge again: cell const-0.05-k2-s0 in float32 is in both"):
        bench.merge_records(mine, {"f32": f32, "again": f32})
    for name, rs in (("a", mine[1:]), ("b", f32[:1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    table = bench.report(tmp_path / "a", merge=[tmp_path / "b"], ref_arm="const-0.05")
    assert "| const-0.02 | 2 | float32 | 0 | -0.050 (n=1) | -0.050 (n=1) |" in table
