"""The run's policy without Ray: cadence (publish / eval / checkpoint / stop), run state, weight board, the
buffer's add reply and searcher metrics, with hand-worked schedules."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from tba.config import load_config
from tba.runtime.cadence import Cadence, TooManySkippedSteps
from tba.runtime.exchange import AddReply, SearcherMetrics, WeightBoard
from tba.runtime.state import RunState


def test_cadence_from_config_async_and_sync():
    cfg = load_config(None, {"trainer.sync_period": 3, "trainer.max_steps": 10, "run.eval_every": 4,
                             "run.checkpoint_every": 5})
    c = Cadence.from_config(cfg)
    assert [s for s in range(1, 11) if c.publish_due(s)] == [3, 6, 9]
    assert [s for s in range(1, 11) if c.eval_due(s)] == [4, 8]
    # never at the last step: the final eval and the end of the run cover it
    assert [s for s in range(1, 11) if c.checkpoint_due(s)] == [5]
    sync = Cadence.from_config(load_config(None, {"run.mode": "sync", "trainer.sync_period": 3}))
    assert sync.sync_period == 1 and all(sync.publish_due(s) for s in range(1, 5))


def test_cadence_zero_means_never():
    c = Cadence(max_steps=10, sync_period=1, eval_every=0, checkpoint_every=0, max_consecutive_skips=2)
    assert not any(c.eval_due(s) or c.checkpoint_due(s) for s in range(1, 11))


def test_skip_limit_counts_only_consecutive_steps():
    c = Cadence(max_steps=10, sync_period=1, eval_every=0, checkpoint_every=0, max_consecutive_skips=2)
    n = 0
    for skipped in (True, True, False, True, True):  # a finite step resets the count
        n = c.count_skip(n, skipped)
    assert n == 2
    with pytest.raises(TooManySkippedSteps, match="3 trainer steps in a row"):
        c.count_skip(n, True)


def test_run_state_idle_fraction_and_staleness():
    st = RunState()
    assert st.trainer_idle_frac is None
    st.record({"perf/train_step_s": 3.0, "buffer/staleness_mean": 1.5, "buffer/staleness_max": 4.0}, loop_s=4.0)
    st.record({"perf/train_step_s": 3.0, "buffer/staleness_mean": 2.5, "buffer/staleness_max": 3.0}, loop_s=4.0)
    assert st.trainer_idle_frac == pytest.approx(1 - 6 / 8)
    assert (st.staleness_sum, st.staleness_max) == (4.0, 4.0)
    saved = st.to_json()
    assert "last" not in saved and RunState(**saved).trainer_idle_frac == pytest.approx(0.25)


def test_weight_board_hands_out_only_newer_versions():
    board = WeightBoard()
    assert board.newer_than(0) is None
    board.publish(2, "w2")
    assert board.newer_than(0) == "w2" and board.newer_than(1) == "w2" and board.newer_than(2) is None


def test_weight_board_lag_serves_older_versions():
    """trainer.generation_lag L = 2: searchers get the weights published 2 publications before the newest;
    the initial policy (version 0) until 3 exist; a resume restarts the window at the resumed version."""
    board = WeightBoard(lag=2)
    served = []
    for v in (1, 2, 3, 4):
        board.publish(v, f"w{v}")
        served.append((board.version, board.newer_than(0)))
    assert served == [(0, None), (0, None), (1, "w1"), (2, "w2")]
    assert board.newer_than(2) is None  # a searcher holding version 2 gets nothing newer
    board.publish(10, "w10", reset=True)
    assert (board.version, board.newer_than(4)) == (10, "w10")


def test_add_reply_is_a_frozen_value_that_survives_pickling():
    """The buffer actor's reply crosses Ray (pickled); a searcher reads it and cannot change it."""
    reply = AddReply(stop=False, version=3, weights=["ref"])
    assert pickle.loads(pickle.dumps(reply)) == reply and AddReply(stop=True, version=0).weights is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        reply.stop = True  # type: ignore[misc]


def test_searcher_metrics_average_between_drains():
    m = SearcherMetrics()
    m.add(8, {"searcher/reward_mean": 0.5, "searcher/reward_failures": 1.0}, searcher_id=0, version=2)
    m.add(4, {"searcher/reward_mean": 1.0, "searcher/reward_failures": 0.0}, searcher_id=1, version=4)
    out = m.summary(drain=True)
    assert out["searcher/reward_mean"] == 0.75 and out["buffer/samples_added"] == 12.0
    assert (out["searcher/min_version"], out["searcher/max_version"]) == (2.0, 4.0)
    assert out["searcher/reward_failures_total"] == 1.0
    # a restarted searcher 0 says hello (no batch, version 0) before it fetches the newest weights: its last
    # batch's version stays 2, not 0
    m.add(0, {}, searcher_id=0, version=0)
    assert m.summary(drain=False)["searcher/min_version"] == 2.0
    assert "searcher/reward_mean" not in m.summary(drain=True)  # drained
    restored = SearcherMetrics()
    restored.load_state_dict(m.state_dict())
    assert restored.summary(drain=False)["buffer/samples_added"] == 12.0


def test_searcher_metrics_count_sync_gap_warnings_over_the_run():
    """``sync/gap_warnings``: each batch reports its new warnings; the buffer actor keeps the run's total (not a
    mean) through drains and checkpoints. ``sync/logprob_gap`` is a mean over the batches that have one."""
    m = SearcherMetrics()
    assert m.summary(drain=True)["sync/gap_warnings"] == 0.0
    m.add(4, {"sync/gap_warnings": 1.0, "sync/logprob_gap": 0.9}, searcher_id=0, version=2)
    m.add(4, {"sync/gap_warnings": 0.0, "sync/logprob_gap": 0.1}, searcher_id=1, version=2)
    m.add(4, {"sync/gap_warnings": 1.0}, searcher_id=0, version=2)
    out = m.summary(drain=True)
    assert out["sync/gap_warnings"] == 2.0 and out["sync/logprob_gap"] == pytest.approx(0.5)
    out = m.summary(drain=True)
    assert out["sync/gap_warnings"] == 2.0 and "sync/logprob_gap" not in out
    restored = SearcherMetrics()
    restored.load_state_dict(m.state_dict())
    assert restored.summary(drain=False)["sync/gap_warnings"] == 2.0
    older = SearcherMetrics()  # a checkpoint from before the sync check
    older.load_state_dict({"samples_added": 3, "reward_failures": 0})
    assert older.summary(drain=False)["sync/gap_warnings"] == 0.0
