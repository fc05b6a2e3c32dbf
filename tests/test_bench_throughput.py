"""The throughput benchmark's trainer FLOP count (benchmarks/throughput.py, ``train_step_flops``) against a
small case counted by hand."""

from __future__ import annotations

import pytest
from conftest import load_benchmark

tp = load_benchmark("throughput")

# 2 prompts of lengths 3 and 5, K = 2 responses each, of lengths 2 and 4 (samples in a Batch's order)
PROMPTS, RESPONSES, K = [3, 5], [2, 4, 2, 4], 2


def flops(shared: bool, block_params: int, head_params: int, micro_batch_size: int | None = None) -> int:
    return tp.train_step_flops(PROMPTS, RESPONSES, K, shared, block_params, head_params, micro_batch_size)


def test_train_step_flops_hand_count():
    # Fed response tokens (all but the last, which is only a target): (2-1) + (4-1) per prompt, x 2 prompts = 8.
    # Shared (one pass per prompt): blocks 3 + 5 + 8 = 16 tokens; LM head: the last position of each prompt
    # pass (scores both its responses' first tokens) = 2, + the 8 fed response tokens = 10 positions.
    #   -> 6 x (16 P_b + 10 P_h)
    # Unshared (every row in full): blocks 2x3 + 2x5 + 8 = 24 tokens; LM head: each row's last prompt position
    # = 4, + 8 = 12 positions.
    #   -> 6 x (24 P_b + 12 P_h)
    # (The old count, 6 x (P_b x (prompts + all response tokens) + P_h x all response tokens), gave
    # 6 x (20 P_b + 12 P_h) shared and 6 x (28 P_b + 12 P_h) unshared.)
    for p_b, p_h in ((1, 0), (0, 1), (7, 100)):
        assert flops(True, p_b, p_h) == 6 * (16 * p_b + 10 * p_h)
        assert flops(False, p_b, p_h) == 6 * (24 * p_b + 12 * p_h)
    assert tp.train_step_positions(PROMPTS, RESPONSES, K, True) == (16, 10)
    assert tp.train_step_positions(PROMPTS, RESPONSES, K, False) == (24, 12)


def test_train_step_flops_micro_batches():
    # micro batches of 3 rows: [p0 r2, p0 r4, p1 r2] and [p1 r4]; shared, prompt 1 is run in both:
    # blocks 3 + 5 + 5 + 8 = 21, LM head 3 passes + 8 = 11. Unshared is as before (rows are independent).
    assert flops(True, 1, 0, 3) == 6 * 21 and flops(True, 0, 1, 3) == 6 * 11
    assert flops(False, 7, 100, 3) == flops(False, 7, 100)
    # one row per micro batch: every prompt pass serves one response, as in the unshared count
    assert flops(True, 7, 100, 1) == flops(False, 7, 100)


def test_train_step_flops_rejects_bad_shapes():
    with pytest.raises(ValueError):
        tp.train_step_flops([3, 5], [2, 4, 2], 2, True, 1, 1)
    with pytest.raises(ValueError):
        tp.train_step_flops([3], [0, 2], 2, True, 1, 1)


def test_recount_of_the_committed_mfu_run():
    # benchmarks/results/throughput-mfu.json, written with the old count: 6 x (P_b x 730 + P_h x 514) per step;
    # recounted (4 prompts of 54 + 32 responses of 514 tokens in all, one micro batch):
    # 6 x (P_b x (216 + 514 - 32) + P_h x (4 + 514 - 32)) = 6 x (698 P_b + 486 P_h)
    import json

    from conftest import ROOT

    res = json.loads((ROOT / "benchmarks/results/throughput-mfu.json").read_text())
    r = tp.recount_trainer_mfu(res)["shared"]
    p_b, p_h = res["trainer"]["block_params"], res["trainer"]["head_params"]
    assert r["recorded_flops_per_step"] == 6 * (730 * p_b + 514 * p_h)
    assert r["flops_per_step"] == 6 * (698 * p_b + 486 * p_h)
    assert round(r["mfu"], 3) == 0.303 and round(r["recorded_mfu"], 3) == 0.318
    assert len(r["all_mfu"]) == 3
