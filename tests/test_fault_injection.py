"""Fault injection: one run stopped at every phase, each stop followed by a resume, then run to max_steps.

Drives the real CLI, Ray and the 2-layer SmolLM2. Each phase is reached by waiting for the run's
``status.json`` (``tba.logger.RunStatus``) to name it, never by a fixed sleep. The signals rotate so that
SIGINT (Ctrl-C), SIGTERM and SIGKILL each hit two phases; ``benchmarks/chaos.py`` stops a run at random
points with random signals, through the same functions. SIGTERM (what a scheduler or ``kill`` sends) must
survive the handler Ray installs when it starts. Along the way: every socket the run listens on is on
loopback, a SIGKILL's checkpoint carries the sync check's probe, and the eval before training, done once,
is carried over by every later resume.
"""

from __future__ import annotations

import json
import signal

from conftest import CHAOS as chaos

from tba.checkpoint import find, read_json

MAX_STEPS = 8

# (phase in status.json, the smallest step at which to stop there, signal, extra overrides of that start)
PLAN = [
    ("fill", 0, signal.SIGTERM, ["--run.eval_before", "false"]),  # waiting for buffer.min_fill
    ("eval_before", 0, signal.SIGKILL, ["--run.eval_before", "true"]),
    ("step", 1, signal.SIGINT, []),  # a trainer step in flight
    ("publish", 3, signal.SIGTERM, []),  # weights on their way to the searchers
    ("checkpoint", 4, signal.SIGKILL, []),  # the previous checkpoint must stay valid
    ("eval_after", MAX_STEPS, signal.SIGINT, []),  # final eval (then the model save)
]


def test_every_phase_stops_and_resumes_losing_nothing(tmp_path, model_path, cli):
    run = chaos.Run(tmp_path / "run", [*chaos.TINY_RUN, "--max-steps", str(MAX_STEPS)], cli.marker)
    n_problems = None
    for phase, min_step, sig, extra in PLAN:
        before = chaos.saved_samples(run.run_dir)
        previous_step = chaos.saved_step(run.run_dir)
        run.start(extra)
        reached = run.wait_for(lambda r, p=phase, m=min_step: r.phase().get("phase") == p
                               and r.phase().get("step", -1) >= m)
        assert reached, f"phase {phase} never reached: {run.finish()} {run.output[-2000:]}"
        at_step = run.phase()["step"]
        if phase == "step":
            _assert_listens_on_loopback_only(run)
        code = run.stop(sig)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 130), run.output[-2000:]
        if sig != signal.SIGKILL:
            assert "interrupted" in run.output, run.output[-2000:]
        if previous_step is not None:  # a resume: it restored exactly the checkpoint's buffer
            assert not chaos.resume_problems(run, before), (phase, chaos.resume_problems(run, before))
        n_problems = n_problems or chaos.num_train_problems(run.run_dir)
        assert not chaos.checkpoint_problems(run.run_dir, n_problems, batch_prompts=2), phase
        saved = chaos.saved_step(run.run_dir)
        if sig == signal.SIGKILL:  # an earlier checkpoint (valid: checked above) is what a crash leaves
            assert saved == previous_step if phase in ("fill", "eval_before") else saved <= at_step, (phase, saved)
        else:  # the stop saved the step it was at (a step in flight is recorded first)
            assert saved is not None and saved >= at_step, (phase, saved, at_step)
        if phase == "checkpoint":  # the sync check's probe responses and warning count survive a crash
            ckpt = find(run.run_dir)
            assert len(read_json(ckpt / "trainer.json")["probe"]) == 4
            assert read_json(ckpt / "buffer.json")["gap_warnings"] == 0
    before = chaos.saved_samples(run.run_dir)
    run.start()
    run.finish()
    assert not chaos.resume_problems(run, before), run.output[-2000:]
    assert not chaos.final_problems(run, MAX_STEPS), run.output[-2000:]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert "eval_before" in summary and "eval before training" not in run.output  # carried over, not rerun
    assert (run.run_dir / "final" / "config.json").is_file()
    assert run.phase()["phase"] == "done"


def _assert_listens_on_loopback_only(run) -> None:
    """Every socket the running CLI's processes (driver, Ray daemons, actors) listen on is on loopback."""
    import psutil

    listening = []
    for pid in run.processes():
        try:
            listening += [c.laddr for c in psutil.Process(pid).net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert listening and all(a.ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for a in listening), listening
