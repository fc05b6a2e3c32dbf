"""The learning-curve PNG of every run: the held-out eval's points with their standard errors above the
training curves (issue 25, item 5)."""

from __future__ import annotations

import json

from PIL import Image

from tba.logger import eval_series, plot_learning_curve


def _metrics(tmp_path, records):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TRAIN = [{"step": s, "train/reward_mean": 0.1 * s, "loss/tb": 1.0 / s} for s in range(1, 11)]


def test_eval_series_joins_before_during_and_after():
    """The eval before training is step 0, the run.eval_every records keep their steps, the eval after
    training is the last step; each with its standard error."""
    records = [*TRAIN[:5], {"step": 5, "eval/accuracy": 0.4, "eval/stderr": 0.05, "eval/n": 96}, *TRAIN[5:]]
    key, pts = eval_series(records, {"accuracy": 0.3, "stderr": 0.047}, {"accuracy": 0.5, "stderr": 0.051}, 10)
    assert key == "accuracy" and pts == [(0, 0.3, 0.047), (5, 0.4, 0.05), (10, 0.5, 0.051)]
    # the known-optimum task: exact numbers, no standard error; another task's main number is found too
    key, pts = eval_series([{"step": 25, "eval/kl": 1.2, "eval/tv": 0.5}])
    assert key == "kl" and pts == [(25, 1.2, None)]
    assert eval_series(TRAIN) is None


def test_png_gets_an_eval_panel_above_the_training_curves(tmp_path):
    """With evals the PNG has one panel more (2.4 inches at 110 dpi: 264 pixels) than without."""
    path = _metrics(tmp_path, TRAIN)
    keys = ("train/reward_mean", "loss/tb")
    plain = Image.open(plot_learning_curve(path, tmp_path / "plain.png", keys)).size
    with_evals = Image.open(plot_learning_curve(path, tmp_path / "evals.png", keys, {"accuracy": 0.3, "stderr": 0.05},
                                                {"accuracy": 0.5, "stderr": 0.05})).size
    assert plain[0] == with_evals[0] and with_evals[1] - plain[1] == 264
