"""End to end through the CLI and real Ray on the 2-layer SmolLM2: async, the generation lag, a two-node
cluster, and a LoRA sync run (a failing or hanging part of a run: tests/test_e2e_faults.py)."""

from __future__ import annotations

import json
import math
import time

from conftest import ROOT

from tba.config import SearcherConfig
from tba.logger import read_metrics
from tba.searcher import MOVED_MIN

TINY = [
    "--model.num_hidden_layers", "2", "--task.train_size", "40", "--task.eval_size", "8",
    "--task.options", "{min_terms: 2, max_terms: 2, max_digits: 1}",
    "--searcher.prompts_per_batch", "2", "--searcher.samples_per_prompt", "4", "--searcher.max_new_tokens", "12",
    "--trainer.prompts_per_step", "2", "--trainer.group_size", "4", "--trainer.lr", "1e-4",
    "--trainer.lr_schedule", "constant", "--buffer.min_fill", "16", "--run.eval_batch_size", "8",
]


def test_async_run_end_to_end(tmp_path, model_path, cli):
    out = tmp_path / "run"
    # bf16 (what "auto" picks on AVX512/AMX CPUs and CUDA): the trainer's float32 master weights under bf16
    # autocast score the responses a little differently from the searchers' bf16 reference (1.3-1.6% of a
    # real TB gradient: benchmarks/README.md, "Step-0 precision gap"), so TB has a gradient from step 1 even
    # when every reward is the same (as the 2-layer model's 0s), and the policy then differs from the
    # reference; in float32 it would be exactly 0
    r = cli.run([*TINY, "--max-steps", "6", "--trainer.sync_period", "2", "--run.eval_every", "3",
                 "--model.dtype", "bfloat16", "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_steps"] == 6
    assert summary["searcher_max_version"] >= 2  # weights reached the searchers
    assert 0 <= summary["eval_before"]["accuracy"] <= 1 and 0 <= summary["eval_after"]["accuracy"] <= 1
    assert summary["eval_after"]["n"] == 8
    assert "eval accuracy: before" in r.stdout and "staleness" in r.stdout and "trainer idle" in r.stdout
    assert 0 <= summary["trainer_idle_frac"] < 1
    all_records = read_metrics(out / "metrics.jsonl")
    records = [rec for rec in all_records if "loss/tb" in rec]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4, 5, 6]
    evals = [rec for rec in all_records if "eval/accuracy" in rec]
    assert [rec["step"] for rec in evals] == [3] and evals[0]["eval/n"] == 8  # run.eval_every
    # the batch of step s is drawn at trainer step s - 1 from samples of policy versions 0 .. s - 1, so
    # staleness lies in [0, s - 1] (the 2k - 1 bound of the recent branch is tested in test_buffer.py)
    assert all(0 <= rec["buffer/staleness_mean"] <= rec["buffer/staleness_max"] <= rec["step"] - 1
               for rec in records)
    # the published weights reached the searchers' engine: the sync check's gap is bf16 precision, no warning
    gaps = [rec["sync/logprob_gap"] for rec in records if "sync/logprob_gap" in rec]
    assert gaps and max(gaps) < SearcherConfig().sync_gap_bound, gaps
    moved = [rec["sync/engine_moved"] for rec in records if "sync/engine_moved" in rec]  # from the 2nd check on
    assert moved and min(moved) > MOVED_MIN, moved
    assert records[-1]["sync/gap_warnings"] == 0
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert any((out / "tb").iterdir())
    assert "sync_period: 2" in (out / "config.yaml").read_text()
    # something was learned: every step had a gradient and was taken, and the final policy (it reloads with
    # plain transformers) moved from the initial weights by what AdamW allows. By hand: step t moves a weight
    # by lr_t |m_t| / (sqrt(v_t) + eps) (bias-corrected moments); Cauchy-Schwarz over the past gradients
    # bounds |m_t| / sqrt(v_t) by c_t = (1 - b1) / (1 - b1^t) sqrt((1 - b2^t) / (1 - b2) sum_{j<t} (b1^2 / b2)^j)
    # = 1, 1.0014, 1.0036, 1.0068, 1.0108, 1.0156 for t = 1..6 (b1 = 0.9, b2 = 0.999): at most 6.04 x lr in
    # all; step 1 alone moves every weight whose gradient is >> eps = 1e-8 by exactly lr (m_1 / sqrt(v_1) =
    # sign g), so the largest move is well above lr / 2 (a no-op update: 0)
    assert all(rec["train/grad_norm"] > 0 and rec["train/skipped"] == 0 for rec in records)
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    init = AutoModelForCausalLM.from_pretrained(model_path, num_hidden_layers=2)
    assert final.config.num_hidden_layers == 2
    w0, w1 = init.model.layers[0].mlp.up_proj.weight, final.model.layers[0].mlp.up_proj.weight
    moved = (w1.double() - w0.double()).abs().max().item()
    b1, b2 = 0.9, 0.999
    c = [(1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2) * sum((b1**2 / b2) ** j for j in range(t)))
         for t in range(1, 7)]
    lrs = [rec["train/lr"] for rec in records]
    assert lrs[0] / 2 < moved <= sum(ct * lr for ct, lr in zip(c, lrs)) * 1.001, (moved, lrs)
    cli.assert_nothing_left()


def test_generation_lag_sets_staleness_without_reuse(tmp_path, cli):
    """trainer.generation_lag L = 2 with k = 1 and m = 1: searchers generate with the weights of 2 versions
    ago, so from step 3 on every trained sample is at least 2 steps stale (without the lag the newest samples
    are 0-1 steps stale), and at most a few more (the generation of a batch spans steps)."""
    out = tmp_path / "lag"
    r = cli.run([*TINY, "--max-steps", "8", "--trainer.sync_period", "1", "--trainer.generation_lag", "2",
                 "--buffer.on_policy_prob", "1", "--run.eval_before", "false", "--run.eval_after", "false",
                 "--trainer.save_final", "false", "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    records = [rec for rec in read_metrics(out / "metrics.jsonl") if "loss/tb" in rec]
    assert len(records) == 8
    # the batch of step s is drawn at trainer step s - 1, when the newest served version is s - 1 - 2
    assert all(rec["buffer/staleness_min"] >= min(2, rec["step"] - 1) for rec in records)
    assert all(rec["buffer/staleness_max"] <= rec["step"] - 1 for rec in records)
    assert max(rec["searcher/max_version"] for rec in records) <= 8 - 2
    assert all(rec["buffer/reuse_max"] >= 1 for rec in records)


def test_bad_config_fails_before_loading(tmp_path, cli):
    t0 = time.monotonic()
    r = cli.run(["--trainer.lr", "-3", "--output-dir", str(tmp_path / "x")], timeout=60)
    assert r.returncode == 2
    assert "trainer.lr" in r.stderr and "greater than 0" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists() and time.monotonic() - t0 < 30


def test_two_node_cluster_spreads_searchers(tmp_path, cli):
    """--ray-address joins an existing cluster; searchers land on both nodes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    try:
        out = tmp_path / "cluster"
        r = cli.run([*TINY, "--max-steps", "2", "--searcher.num_searchers", "2", "--ray-address",
                     cluster.address, "--run.eval_before", "false", "--run.eval_after", "false",
                     "--trainer.save_final", "false", "--output-dir", str(out)])
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert len(summary["searcher_nodes"]) == 2
        assert summary["trainer_steps"] == 2
    finally:
        cluster.shutdown()


def test_lora_sync_run_saves_an_adapter_and_resumes_exactly(tmp_path, cli):
    """``--model.lora.r``: the reference is the hf searchers' base with the adapter off, the checkpoint
    holds the adapter only, final/ is a PEFT adapter folder (and merged weights with trainer.save_merged),
    and a sync run resumed from its step-2 checkpoint ends with the same adapter, bit for bit. On the
    known-optimum task's tiny Llama in float32: its rewards differ between responses, so TB has a gradient
    from step 1 (the 2-layer SmolLM2 scores 0 on every chain_sum problem, so it needed bf16 rounding for
    one, at 4x the time on CPUs without native bf16); LoRA on the real SmolLM2 is tests/test_lora.py's."""
    import shutil

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    args = [str(ROOT / "configs" / "known_optimum.yaml"), "--max-steps", "4", "--model.lora.r", "8",
            "--run.checkpoint_every", "2", "--trainer.save_merged", "true", "--run.eval_before", "false",
            "--run.eval_after", "false", "--run.tensorboard", "false", "--model.cache_dir", str(tmp_path / "cache"),
            "--output-dir", str(out)]
    r = cli.run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LoRA r=8, reference = the searcher's base with the adapter off" in r.stdout
    trained = load_file(out / "checkpoint" / "policy.safetensors")
    assert trained and all("lora_" in name for name in trained)
    first = load_file(out / "final" / "adapter_model.safetensors")
    shutil.rmtree(out / "final")

    r = cli.run(["--resume", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed at trainer step 2" in r.stdout
    again = load_file(out / "final" / "adapter_model.safetensors")
    assert set(again) == set(first) and all(torch.equal(again[n], first[n]) for n in first)
    assert any(t.abs().max() > 0 for n, t in again.items() if "lora_B" in n)  # the adapter was trained

    base_path = json.loads((out / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_path.startswith(str(tmp_path / "cache"))  # the task's own model, built under model.cache_dir
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), out / "final").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "final" / "merged").eval()
    ids = torch.tensor([[1, 2, 3, 4, 0]])
    with torch.no_grad():
        assert torch.allclose(policy(ids).logits, merged(ids).logits, atol=1e-5)
    cli.assert_nothing_left()
