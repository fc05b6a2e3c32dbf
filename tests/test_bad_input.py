"""Bad input: each case fails with one clear line naming what is wrong, no traceback, non-zero exit.

Runs the real ``tba`` entry point in-process (every case fails before Ray starts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tba.cli import main

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
GOOD_ROW = {"question": "Tom has 2 apples and buys 3 more. How many?", "answer": "2+3=5\n#### 5"}


def _gsm8k_dir(tmp_path, rows: list[str]) -> str:
    """A GSM8K folder whose train.jsonl holds ``rows`` (raw lines) after one good row."""
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "train.jsonl").write_text("\n".join([json.dumps(GOOD_ROW), *rows]) + "\n")
    (d / "test.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    return str(d)


def _empty_train_file(tmp_path) -> str:
    """A GSM8K folder whose train.jsonl is empty (0 bytes)."""
    d = _gsm8k_dir(tmp_path, [])
    Path(d, "train.jsonl").write_text("")
    return d


def _inconsistent_checkpoint(tmp_path) -> list[str]:
    """A run directory whose checkpoint has every file, but the trainer at step 16 and the driver at 15."""
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    for name in ("buffer.json", "searchers.json", "optimizer.json", "policy.safetensors", "optimizer.safetensors"):
        (ckpt / name).write_text("{}")
    (ckpt / "trainer.json").write_text(json.dumps({"step": 16}))
    (ckpt / "driver.json").write_text(json.dumps({"step": 15}))
    return ["--resume", str(tmp_path)]


def _bad_gguf(tmp_path) -> str:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF but not really")
    return str(f)


def _empty_folder(tmp_path) -> str:
    (tmp_path / "m").mkdir()
    return str(tmp_path / "m")


def _bad_yaml(tmp_path) -> str:
    f = tmp_path / "c.yaml"
    f.write_text("trainer: {lr: [1, 2\n")
    return str(f)


GSM = ["--task.name", "gsm8k", "--task.eval_size", "1"]
CASES = [
    # (id, argv builder, expected exit code, text that must appear in the one-line error)
    ("missing config file", lambda t: [str(t / "nope.yaml")], 1, "config file not found"),
    ("yaml syntax", lambda t: [_bad_yaml(t)], 2, "not valid YAML"),
    ("unknown field", lambda t: ["--trainer.lrr", "1"], 2, "unknown field trainer.lrr; did you mean trainer.lr?"),
    ("unknown dotted field", lambda t: ["trainer.lrr=1"], 2, "unknown field trainer.lrr; did you mean trainer.lr?"),
    ("negative lr", lambda t: ["--trainer.lr", "-1"], 2, "trainer.lr: Input should be greater than 0"),
    ("bad loss name", lambda t: ["--loss.name", "ppo"], 2, "loss.name: Input should be 'tb'"),
    ("m out of range", lambda t: ["buffer.on_policy_prob=2"], 2, "buffer.on_policy_prob"),
    ("override without =", lambda t: [QUICKSTART, "trainer.lr"], 2, "must look like section.field=VALUE"),
    ("K > S", lambda t: ["--trainer.group_size", "9"], 2, "must be >= trainer.group_size"),
    ("LoRA rank 0", lambda t: ["--model.lora.r", "0"], 2, "model.lora.r: Input should be greater than or equal to 1"),
    ("LoRA target that matches nothing", lambda t: ["--model.lora.r", "8", "model.lora.target_modules=[q_proj, qkv]"],
     1, "model.lora.target_modules: qkv match no module of"),
    ("merged LoRA publication to hf searchers", lambda t: ["--model.lora.r", "8", "--model.lora.publish", "merged"],
     2, "model.lora.publish: 'merged' is for vLLM searchers"),
    ("missing model folder", lambda t: ["--model.policy", str(t / "no_model")], 1, "no such file or folder"),
    ("not a gguf", lambda t: ["--model.policy", _bad_gguf(t), "--model.cache_dir", str(t / "c")], 1,
     "is not a loadable GGUF model"),
    ("folder without config.json", lambda t: ["--model.policy", _empty_folder(t)], 1, "no config.json"),
    ("package not installed", lambda t: ["--model.policy", "pkg://no_such_pkg/x.gguf"], 1, "is not installed"),
    ("missing dataset", lambda t: [*GSM, "--task.source", str(t / "none")], 1, "openai/gsm8k"),
    ("bad JSON line", lambda t: [*GSM, "--task.source", _gsm8k_dir(t, ["{not json"])], 1, "train.jsonl:2"),
    ("missing field", lambda t: [*GSM, "--task.source", _gsm8k_dir(t, ['{"question": "q?"}'])], 1,
     "train.jsonl:2"),
    ("wrong type", lambda t: [*GSM, "--task.source", _gsm8k_dir(t, ['{"question": 3, "answer": "#### 3"}'])], 1,
     "train.jsonl:2"),
    ("empty question", lambda t: [*GSM, "--task.source", _gsm8k_dir(t, ['{"question": " ", "answer": "#### 3"}'])],
     1, "train.jsonl:2"),
    ("empty dataset file", lambda t: [*GSM, "--task.source", _empty_train_file(t)], 1,
     "train.jsonl: no rows (the file is empty)"),
    ("unknown reasoning-gym dataset", lambda t: ["--task.name", "reasoning_gym:no_such_dataset"], 1,
     "reasoning_gym:no_such_dataset"),
    ("bad reasoning-gym option", lambda t: ["task.options={min_terms: 0}"], 1, "options"),
    ("reasoning-gym mix without members", lambda t: ["--task.name", "reasoning_gym:composite"], 1,
     "task.options.datasets: reasoning_gym:composite needs a non-empty list of {name, weight, config} mappings"),
    ("unknown task", lambda t: ["--task.name", "chess"], 1, "task.name 'chess' is unknown"),
    ("template without {question}", lambda t: ["--task.prompt_template", "Solve it"], 1, "{question}"),
    ("prompt longer than context", lambda t: ["--task.prompt_template", "{question}" + " word" * 9000,
                                              "--task.train_size", "2", "--task.eval_size", "1"], 1,
     "exceeds the model's context"),
    ("resume a folder that is no run", lambda t: ["--resume", str(t / "nothing")], 1, "config file not found"),
    ("inconsistent checkpoint", _inconsistent_checkpoint, 1,
     "is inconsistent: the trainer saved step 16, the run state step 15"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_clear_line(case, tmp_path, capsys, model_path):
    _, build, code, text = case
    argv = build(tmp_path)
    if argv[:1] == ["--resume"] and Path(argv[1]) == tmp_path:
        (tmp_path / "config.yaml").write_text("trainer: {max_steps: 2}\n")
    rc = None
    try:
        rc = main(["train", *argv, "--output-dir", str(tmp_path / "run")])
    except SystemExit as e:  # argparse reports unknown flags itself, with exit code 2
        rc = e.code
    err = capsys.readouterr().err
    assert rc == code, err
    assert text in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_output_dir_that_cannot_be_created_is_one_line(tmp_path, capsys, model_path):
    """An output directory under a regular file: one line naming run.output_dir, not '[Errno 20] ...'."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = main(["train", "--task.train_size", "2", "--task.eval_size", "1", f"run.output_dir={blocker}/x"])
    assert rc == 1
    assert capsys.readouterr().err.strip() == f"error: run.output_dir '{blocker}/x' cannot be created: Not a directory"
