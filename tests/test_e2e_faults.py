"""End to end through the CLI and real Ray: a failing or hanging part of a run (a searcher killed, hung or
raising, every reward failing, non-finite steps) is contained, counted and recovered from, or stops the run
with one line and a checkpoint. Faults are real signals, an absurd learning rate, or code injected into the
real runtime by ``conftest.patched_env``; no mocks. (Stopping the whole run in each phase:
tests/test_fault_injection.py.)"""

from __future__ import annotations

import json
import os
import signal

from conftest import patched_env
from test_e2e import TINY

from tba.config import SearcherConfig
from tba.logger import read_metrics


def test_killed_searcher_is_restarted_and_run_completes(tmp_path, cli):
    """SIGKILL a searcher process mid-run: it is restarted with the newest weights, training continues."""
    import psutil

    out = tmp_path / "restart"
    p = cli.start([*TINY, "--max-steps", "10", "--run.eval_before", "false", "--run.eval_after", "false",
                   "--trainer.save_final", "false", "--output-dir", str(out)])
    metrics = out / "metrics.jsonl"
    cli.wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, p)
    searchers = [pid for pid in cli.processes()
                 if "SearcherActor" in " ".join(psutil.Process(pid).cmdline())]
    assert len(searchers) == 1
    os.kill(searchers[0], signal.SIGKILL)
    output, _ = p.communicate(timeout=300)
    assert p.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_steps"] == 10 and summary["searcher_restarts"] == 1
    assert "searcher 0 died" in output
    assert read_metrics(metrics)[-1]["searcher/restarts"] == 1.0
    cli.assert_nothing_left()


#: run in every process of the run once ``tba.searcher`` is imported (``patched_env``): the first searcher
#: process to hold policy version >= 2 makes one batch with it and raises on the next (once per run: a flag
#: file), and every batch a searcher process generates is logged with its pid and its samples' versions
RAISE_ONCE = """
import json, os

RAISED, LOG = os.environ["TBA_TEST_RAISED"], os.environ["TBA_TEST_BATCHES"]
step_before_raise = module.Searcher.step


def flaky_step(self):
    if self.version >= 2 and not os.path.exists(RAISED):
        if getattr(self, "_fresh_batches", 0) >= 1:
            with open(RAISED, "w") as f:
                json.dump({"pid": os.getpid(), "version": self.version}, f)
            raise RuntimeError("injected searcher failure")
        self._fresh_batches = getattr(self, "_fresh_batches", 0) + 1
    samples, metrics = step_before_raise(self)
    with open(LOG, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "versions": sorted({s.policy_version for s in samples})}) + "\\n")
    return samples, metrics


module.Searcher.step = flaky_step
"""


def test_hung_then_raising_searcher_is_restarted_with_the_newest_weights(tmp_path, cli):
    """Async mode: the run's first searcher batch never returns, so during the buffer fill the supervisor
    sees no call to the buffer for ``searcher.stall_timeout_s`` and restarts it (without the watchdog the
    fill waits forever); later its replacement's loop raises (not a kill) and is restarted too. The run
    completes, and the second replacement's first batch is generated with the newest weights published
    before its restart.

    By hand, with k = 1 (weights published after every step): the driver looks for dead searchers at the
    start of each loop iteration, so the first step recorded with ``searcher/restarts`` = 2, s_r, is the
    one whose iteration restarted it, after version s_r - 1 was published. The new searcher's first buffer
    call fetches the newest version, >= s_r - 1, before it generates anything; without that hand-over it
    would generate with the initial weights, version 0 (and the raise comes at version >= 2 < s_r)."""
    raised, batches, hung = tmp_path / "raised.json", tmp_path / "batches.jsonl", tmp_path / "hung"
    env = patched_env(tmp_path, "tba.searcher", HANG_ONCE + RAISE_ONCE, TBA_TEST_RAISED=str(raised),
                      TBA_TEST_BATCHES=str(batches), TBA_TEST_HUNG=str(hung))
    out = tmp_path / "raise"
    r = cli.run([*TINY, "--max-steps", "24", "--trainer.sync_period", "1", "--searcher.stall_timeout_s", "5",
                 "--run.eval_before", "false", "--run.eval_after", "false", "--trainer.save_final", "false",
                 "--run.tensorboard", "false", "--output-dir", str(out)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert hung.is_file() and "searcher 0 died (no batch " in r.stdout + r.stderr
    assert "searcher 0 died (RuntimeError: injected searcher failure)" in r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_steps"] == 24 and summary["searcher_restarts"] == 2
    records = [rec for rec in read_metrics(out / "metrics.jsonl") if "loss/tb" in rec]
    assert [rec["step"] for rec in records] == list(range(1, 25))
    s_r = next(rec["step"] for rec in records if rec["searcher/restarts"] == 2.0)
    assert records[0]["searcher/restarts"] == 1.0 and records[-1]["searcher/restarts"] == 2.0
    died = json.loads(raised.read_text())
    assert died["version"] >= 2 and s_r - 1 >= died["version"]
    logged = [json.loads(line) for line in batches.read_text().splitlines()]
    before = [b["versions"] for b in logged if b["pid"] == died["pid"]]
    after = [b["versions"] for b in logged if b["pid"] != died["pid"]]
    assert 2 <= before[-1][0] <= died["version"]  # a batch of version >= 2 reached the buffer first
    assert after, "the restarted searcher made no batch before the run ended"
    assert min(after[0]) >= s_r - 1, (s_r, after[:3])
    assert summary["searcher_max_version"] >= s_r - 1
    # what the run records says the same: the one searcher's last-batch version never goes back (a restart
    # from the initial weights would show a 0 once the new searcher's first batch landed)
    served = [rec["searcher/min_version"] for rec in records]
    assert served == sorted(served) and served[-1] >= s_r - 1, served
    cli.assert_nothing_left()


#: run in every process of the run once ``tba.searcher`` is imported: the first searcher batch of the run
#: never returns (once per run: a flag file), as with a wedged engine
HANG_ONCE = """
import os, time

HUNG = os.environ["TBA_TEST_HUNG"]
step_before_hang = module.Searcher.step


def hanging_step(self):
    if not os.path.exists(HUNG):
        open(HUNG, "w").close()
        time.sleep(10**6)
    return step_before_hang(self)


module.Searcher.step = hanging_step
"""


def test_sync_mode_is_on_policy_and_restarts_a_hung_searcher(tmp_path, cli):
    """Sync mode: generation and training alternate, every sample comes from the current policy. The run's
    first searcher batch never returns: the searcher is killed after ``searcher.stall_timeout_s`` and
    restarted, counted once (the round's call times out and the new searcher is asked again), and the run
    completes on policy. Without the watchdog the round waits forever. (Async mode:
    :func:`test_hung_then_raising_searcher_is_restarted_with_the_newest_weights`.)"""
    hung = tmp_path / "hung"
    env = patched_env(tmp_path, "tba.searcher", HANG_ONCE, TBA_TEST_HUNG=str(hung))
    out = tmp_path / "sync"
    r = cli.run([*TINY, "--max-steps", "4", "--mode", "sync", "--trainer.sync_period", "1",
                 "--searcher.stall_timeout_s", "5", "--run.eval_before", "false", "--run.eval_after", "false",
                 "--trainer.save_final", "false", "--run.tensorboard", "false", "--output-dir", str(out)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert hung.is_file() and "searcher 0 died (no batch " in r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_steps"] == 4 and summary["searcher_restarts"] == 1
    records = read_metrics(out / "metrics.jsonl")
    assert len(records) == 4
    assert all(rec["buffer/staleness_max"] == 0 and rec["buffer/on_policy_frac"] == 1.0 for rec in records)
    # every sample is of the trained weights: behaviour and trainer log-probs differ by bf16 precision only
    assert all(0 < rec["train/fresh_behaviour_gap"] < SearcherConfig().sync_gap_bound for rec in records)
    # the searchers load version t - 1 before generating the batch of step t, and check it
    assert [rec["step"] for rec in records if "sync/logprob_gap" in rec] == [2, 3, 4]
    assert summary["searcher_max_version"] == 3 and summary["staleness_max"] == 0
    # the synchronous trainer waits for every batch's generation, so it is idle part of the loop
    assert 0 < summary["trainer_idle_frac"] < 1
    assert all(0 <= rec["perf/trainer_idle_frac"] < 1 for rec in records)
    cli.assert_nothing_left()


#: run in every process once the reasoning-gym task is imported: every reward raises
REWARD_DOWN = """
def down(self, response, problem):
    raise ConnectionError("reward server down")


module.ReasoningGymTask.reward = down
"""


def test_sync_run_whose_every_reward_fails_stops_with_one_line(tmp_path, cli):
    """Sync mode, every reward raising and ``searcher.failed_reward`` null: no sample can reach the buffer,
    so the run stops at the first generation round with one line naming the cause (it used to generate
    forever), and leaves nothing running."""
    out = tmp_path / "down"
    r = cli.run([*TINY, "--max-steps", "3", "--mode", "sync", "--run.eval_before", "false", "--output-dir",
                 str(out)], timeout=120, env=patched_env(tmp_path, "tba.tasks.reasoning_gym", REWARD_DOWN))
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    # one round: 2 prompts x 4 responses, every reward failed
    assert errors == ["error: sync mode: generation added no sample (8 rewards failed, last: ConnectionError: "
                      "reward server down) and the buffer is empty; searcher.failed_reward is null, so failed "
                      "samples are dropped: fix the reward, or set searcher.failed_reward"], r.stderr
    cli.assert_nothing_left()


def test_non_finite_steps_stop_with_checkpoint(tmp_path, cli):
    """An absurd learning rate makes the loss non-finite: steps are skipped, then the run stops with a
    clear message and a resumable checkpoint."""
    out = tmp_path / "nan"
    # weight decay moves the weights at this lr even when the gradient is exactly 0 (equal rewards and
    # log-probs equal to the reference's, as in float32 on a CPU without bf16)
    r = cli.run([*TINY, "--max-steps", "20", "--trainer.lr", "1e30", "--trainer.weight_decay", "0.1",
                 "--trainer.max_consecutive_skips", "2",
                 "--trainer.sync_period", "100",  # keep the broken weights away from the searchers
                 "--run.eval_before", "false", "--output-dir", str(out)])
    assert r.returncode == 1, r.stderr[-2000:]
    assert "trainer steps in a row had a non-finite loss or gradient" in r.stderr
    assert "Traceback" not in r.stderr.split("error:")[-1]
    records = read_metrics(out / "metrics.jsonl")
    assert [rec["train/skipped"] for rec in records][-3:] == [1.0, 1.0, 1.0]
    assert (out / "checkpoint" / "driver.json").is_file()
