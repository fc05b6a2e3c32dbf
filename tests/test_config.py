"""Config: YAML + dotted overrides, validation errors that name the field, --help listing every field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tba.cli import _train_parser, parse_train_args
from tba.config import Config, ConfigError, iter_fields, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def test_overrides_both_syntaxes_and_yaml_values():
    path, ov, _, _ = parse_train_args(["cfg.yaml", "--trainer.lr", "3e-5", "buffer.on_policy_prob=0.5",
                                 "--max-steps", "7", "task.options.min_terms=3"])
    assert path == "cfg.yaml"
    cfg = load_config(None, ov)
    assert cfg.trainer.lr == pytest.approx(3e-5)
    assert cfg.buffer.on_policy_prob == 0.5
    assert cfg.trainer.max_steps == 7
    assert cfg.task.options == {"min_terms": 3}


def test_yaml_file_then_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 2.0e-5\n  max_steps: 11\nloss:\n  name: rloo\n")
    cfg = load_config(f, {"trainer.max_steps": 3})
    assert (cfg.trainer.lr, cfg.trainer.max_steps, cfg.loss.name) == (2e-5, 3, "rloo")


@pytest.mark.parametrize("override, field, allowed", [
    ({"trainer.lr": -1}, "trainer.lr", "greater than 0"),
    ({"buffer.on_policy_prob": 1.5}, "buffer.on_policy_prob", "less than or equal to 1"),
    ({"loss.name": "ppo"}, "loss.name", "'tb', 'rloo'"),
    ({"run.mode": "fast"}, "run.mode", "'async' or 'sync'"),
    ({"trainer.group_size": 1}, "trainer.group_size", "greater than or equal to 2"),
    ({"searcher.temperature": 0}, "searcher.temperature", "greater than 0"),
    ({"trainer.max_steps": "ten"}, "trainer.max_steps", "valid integer"),
])
def test_invalid_value_names_field_and_allowed(override, field, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert field in str(e.value) and allowed in str(e.value)


def test_unknown_field_and_cross_field_rule(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown field trainer\.lrr; did you mean trainer\.lr\?$"):
        load_config(None, {"trainer.lrr": 1})
    with pytest.raises(ConfigError, match="samples_per_prompt .* must be >= trainer.group_size"):
        load_config(None, {"searcher.samples_per_prompt": 4, "trainer.group_size": 8})
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_help_lists_every_field_with_its_doc():
    text = _train_parser().format_help()
    for dotted, _ in iter_fields():
        assert f"--{dotted}" in text
    assert "on-policy" in text or "newest sync" in text  # a field's doc, not just its name


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_validate(name):
    assert isinstance(load_config(CONFIGS / name), Config)


#: a shipped config's claim about its base model, in its comments: range, result file, the file's candidate
BASE_CLAIM = re.compile(r'Base accuracy: ([0-9.]+)-([0-9.]+) greedy.*?'
                        r'\((benchmarks/results/[^,]+),\s+candidate "([^"]+)"', re.DOTALL)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_base_accuracy_claims_are_backed_by_a_committed_result(name):
    """A config whose comments state the base model's accuracy names a committed result file and its entry;
    the entry is this config's task and options, and its measured accuracy lies in the stated range. A
    comment that mentions base accuracy in any other form fails (an unbacked claim)."""
    text = (CONFIGS / name).read_text()
    comments = "\n".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    claims = BASE_CLAIM.findall(comments)
    loose = [line for line in text.splitlines() if line.startswith("#") and "greedy" in line and "%" in line]
    assert not loose, f"{name}: a base-accuracy claim not in the checked form: {loose}"
    cfg = load_config(CONFIGS / name)
    for low, high, path, candidate in claims:
        entries = [e for e in json.loads((ROOT / path).read_text()) if e["candidate"] == candidate]
        assert len(entries) == 1, (path, candidate)
        entry = entries[0]
        assert cfg.task.name.endswith(":" + entry["task"]) and entry["options"] == cfg.task.options, entry
        assert float(low) <= entry["accuracy"] <= float(high), (name, entry["accuracy"])
