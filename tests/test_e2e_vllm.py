"""End to end through the CLI and real Ray with vLLM as the searchers' engine (vLLM's CPU backend here, the
same API as on a GPU), on the 2-layer SmolLM2: weights reach the engine, samples record the version the
engine had, and no process is left after success, an error or Ctrl-C."""

from __future__ import annotations

import json
import signal

import pytest
from test_e2e import TINY

from tba.config import SearcherConfig
from tba.logger import read_metrics

pytest.importorskip("vllm")

VLLM = [*TINY, "--searcher.engine", "vllm", "--run.eval_before", "false"]


def test_vllm_searchers_get_weights_and_record_versions(tmp_path, cli):
    out = tmp_path / "run"
    r = cli.run([*VLLM, "--max-steps", "4", "--trainer.sync_period", "1", "--run.checkpoint_every", "3",
                 "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "engine vllm" in r.stdout and "evals with vllm" in r.stdout  # run.eval_engine auto, on a CPU
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_steps"] == 4 and summary["searcher_max_version"] >= 1
    assert summary["eval_after"]["n"] == 8  # the eval after training ran on the trainer's vLLM engine
    saved = json.loads((out / "checkpoint" / "buffer.json").read_text())["buffer"]["samples"]
    versions = {s["policy_version"] for _, s in saved}
    # samples generated after a weight swap carry its version, and none claims one not yet published (the
    # checkpoint at step 3 follows the publication of version 3)
    assert max(versions) >= 1 and versions <= set(range(0, 4))
    assert all(len(s["logprobs"]) == len(s["response_ids"]) == len(s["ref_logprobs"]) for _, s in saved)
    # the sync check on the vLLM engine (vLLM's prompt log-probs): bf16 precision after every load, no warning
    records = [rec for rec in read_metrics(out / "metrics.jsonl") if "loss/tb" in rec]
    gaps = [rec["sync/logprob_gap"] for rec in records if "sync/logprob_gap" in rec]
    assert gaps and max(gaps) < SearcherConfig().sync_gap_bound, gaps
    assert records[-1]["sync/gap_warnings"] == 0
    cli.assert_nothing_left()


@pytest.mark.parametrize("publish", ["adapter", "auto"])
def test_vllm_searchers_and_evals_serve_lora_adapters(tmp_path, cli, publish):
    """With ``model.lora.r`` and ``model.lora.publish adapter`` the searchers' and the eval's vLLM engines are
    LoRA engines (``lora_rank``, wired in ``tba.runtime.build._vllm_engine``) taking the trainer's adapter
    publications (an engine of full weights would refuse them); with 'auto' on the CPU the trainer publishes
    the adapter merged into full weights and the engines are full-weight ones (a LoRA engine would refuse
    those). Either way the searchers receive a trained version, the sync check passes, and the eval after
    training runs on the trainer's vLLM engine."""
    out = tmp_path / "lora"
    # sync mode: each step's batch is generated with the newest adapter, so the searcher must load one (an
    # async run this short can end before the searcher's first batch with new weights is delivered)
    r = cli.run([*VLLM, "--model.lora.r", "8", "--model.lora.publish", publish, "--max-steps", "4", "--mode", "sync",
                 "--run.checkpoint_every", "3",
                 "--output-dir", str(out)], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "engine vllm" in r.stdout and "evals with vllm" in r.stdout
    assert ("published merged into full weights" in r.stdout) is (publish == "auto")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_steps"] == 4 and summary["searcher_max_version"] >= 1
    assert summary["eval_after"]["n"] == 8
    # the sync check ran on every adapter load (vLLM's prompt log-probs under the LoRA request), no warning
    gaps = [rec["sync/logprob_gap"] for rec in read_metrics(out / "metrics.jsonl") if "sync/logprob_gap" in rec]
    assert gaps and max(gaps) < SearcherConfig().sync_gap_bound and summary["sync_gap_warnings"] == 0, gaps
    cli.assert_nothing_left()


def test_vllm_run_that_fails_leaves_nothing(tmp_path, cli):
    """A run that stops with an error (non-finite steps, see test_e2e_faults) while vLLM searchers generate."""
    out = tmp_path / "nan"
    r = cli.run([*VLLM, "--max-steps", "20", "--trainer.lr", "1e30", "--trainer.weight_decay", "0.1",
                 "--trainer.max_consecutive_skips", "1", "--trainer.sync_period", "100", "--output-dir", str(out)])
    assert r.returncode == 1, r.stderr[-2000:]
    assert "non-finite loss or gradient" in r.stderr
    cli.assert_nothing_left()


def test_vllm_run_ctrl_c_leaves_nothing(tmp_path, cli):
    out = tmp_path / "intr"
    p = cli.start([*VLLM, "--max-steps", "500", "--output-dir", str(out)])
    metrics = out / "metrics.jsonl"
    cli.wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), p)
    p.send_signal(signal.SIGINT)
    output, _ = p.communicate(timeout=120)
    assert p.returncode == 130, output[-2000:]
    assert [rec["step"] for rec in read_metrics(metrics) if "loss/tb" in rec]
    assert (out / "checkpoint" / "driver.json").is_file()
    cli.assert_nothing_left()
