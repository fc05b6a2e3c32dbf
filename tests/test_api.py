"""The Python API: ``from tba import Config, load_config, train``; ``import tba`` stays light; docs/python-api.md's
example runs as it stands (on the 2-layer model) and its summary has the documented keys."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import tba
from tba.config import Config, ConfigError, apply_overrides

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "python-api.md"
HEAVY = ("torch", "ray", "transformers", "pydantic", "yaml")
#: tests/test_e2e.py's TINY, as dotted overrides, plus a 2-step run in the test's folder
TINY = {"model.num_hidden_layers": 2, "task.train_size": 40, "task.eval_size": 8,
        "task.options": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "searcher.prompts_per_batch": 2,
        "searcher.samples_per_prompt": 4, "searcher.max_new_tokens": 12, "trainer.prompts_per_step": 2,
        "trainer.group_size": 4, "trainer.lr": 1e-4, "trainer.lr_schedule": "constant", "buffer.min_fill": 16,
        "run.eval_batch_size": 8, "trainer.max_steps": 2}


def _loaded_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running ``code``."""
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()


def test_import_tba_loads_nothing_heavy():
    assert _loaded_after("import tba") == []
    # the API's names: the config needs pydantic and PyYAML; torch, transformers and Ray wait for a run
    assert _loaded_after("from tba import Config, ConfigError, RunSummary, load_config, train") == ["pydantic", "yaml"]


def test_public_names_resolve_to_their_modules():
    import tba.api
    import tba.config

    assert set(tba.__all__) == {"Config", "ConfigError", "RunSummary", "load_config", "train", "__version__"}
    assert tba.train is tba.api.train and tba.RunSummary is tba.api.RunSummary
    assert tba.Config is tba.config.Config and tba.load_config is tba.config.load_config
    assert {"train", "Config"} <= set(dir(tba))
    with pytest.raises(AttributeError, match="has no attribute 'trian'"):
        tba.trian  # noqa: B018


def test_train_refuses_a_bad_config_before_anything_starts(tmp_path, monkeypatch):
    """Each fails in the config, before any model, task or Ray."""
    def refuse(*args, **kwargs):
        raise AssertionError("got past the config")

    monkeypatch.setattr("tba.api._prepare", refuse)
    with pytest.raises(ConfigError, match=r"^unknown field trainer\.lrr; did you mean trainer\.lr\?$"):
        tba.train(ROOT / "configs" / "quickstart.yaml", overrides={"trainer.lrr": 1e-4})
    cfg = Config()
    cfg.trainer.group_size = 16  # each section validates alone; the cross-field rule needs the whole config
    with pytest.raises(ConfigError, match="must be >= trainer.group_size"):
        tba.train(cfg)
    with pytest.raises(FileNotFoundError, match="config file not found"):
        tba.train(resume_dir=tmp_path / "no_run")


def test_apply_overrides_returns_a_validated_copy():
    cfg = Config()
    new = apply_overrides(cfg, {"trainer.lr": 3e-5, "task.options.max_terms": 3})
    assert (new.trainer.lr, new.task.options) == (3e-5, {"max_terms": 3})
    assert (cfg.trainer.lr, cfg.task.options) == (1e-5, {})
    with pytest.raises(ConfigError, match="trainer.lr: Input should be greater than 0"):
        apply_overrides(cfg, {"trainer.lr": -1})


def _example() -> str:
    """The doc's first ```python block."""
    return DOC.read_text().split("```python\n", 1)[1].split("```", 1)[0]


def test_doc_lists_every_summary_key():
    table = DOC.read_text().split("| key | what |", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"`(\w+)`", "".join(line.split("|")[1] for line in table.splitlines()[2:]))) == set(
        typing.get_type_hints(tba.RunSummary))


@pytest.mark.slow
def test_doc_example_runs_as_written(tmp_path, monkeypatch, capsys, model_path):
    """docs/python-api.md's example, exec'd as it stands from the repository root; ``tba.train`` gets the 2-layer
    model's sizes (TINY) on top of the example's own settings, and a run folder under ``tmp_path``."""
    real_train = tba.train

    def tiny_train(config=None, *, overrides=None, **kwargs):
        return real_train(config, overrides={**(overrides or {}), **TINY, "run.output_dir": str(tmp_path / "run")},
                          **kwargs)

    monkeypatch.setattr(tba, "train", tiny_train)
    monkeypatch.chdir(ROOT)  # the example names configs/quickstart.yaml
    namespace: dict = {}
    exec(compile(_example(), str(DOC), "exec"), namespace)
    summary = namespace["summary"]
    out = capsys.readouterr().out
    assert re.search(r"^accuracy \d\.\d{3} -> \d\.\d{3} after 2 steps$", out, re.M), out
    assert f"trained policy: {tmp_path / 'run' / 'final'}\n" in out
    assert summary["trainer_steps"] == 2 and summary["run_dir"] == str(tmp_path / "run")
    # the TypedDict documents what train returns: every key, and the summary.json it also writes
    assert set(summary) <= set(typing.get_type_hints(tba.RunSummary)), set(summary) - set(typing.get_type_hints(
        tba.RunSummary))
    assert {"eval_before", "eval_after", "final_model", "wall_s", "device"} <= set(summary)
    import json

    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == json.loads(json.dumps(summary))
