"""Typed ``task.options``: each task's Options model refuses unknown and ill-typed options with one line before
anything starts, and ``tba train --help`` lists every task's options."""

from __future__ import annotations

from pathlib import Path

import pytest

from tba.cli import main
from tba.config import TaskConfig
from tba.tasks.base import Task
from tba.tasks.redteam import RedTeamOptions
from tba.tasks.summarize import SummarizeOptions

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REDTEAM_ALLOWED = ("cache_dir, classifier, embedding_model, eval_temperature, instruction_template, num_examples, "
                   "reward_floor, seeds, toxic_label, toxic_threshold, victim, victim_batch_size, victim_dtype, "
                   "victim_layers, victim_max_new_tokens, victim_system_prompt")

CASES = [
    ("gsm8k", "task.options.skip_bad_row=true",
     "task.options.skip_bad_row: Extra inputs are not permitted (allowed: skip_bad_rows)"),
    ("gsm8k", "task.options.skip_bad_rows=maybe",
     "task.options.skip_bad_rows: Input should be a valid boolean, unable to interpret input (got 'maybe')"),
    ("redteam", "task.options.hidden=1",
     f"task.options.hidden: Extra inputs are not permitted (allowed: {REDTEAM_ALLOWED})"),
    ("redteam", "task.options.seeds=nope",
     "task.options.seeds: Input should be 'builtin' or 'harmbench' (got 'nope')"),
    ("redteam", "task.options.victim_layers=many",
     "task.options.victim_layers: Input should be a valid integer, unable to parse string as an integer (got 'many')"),
    ("redteam", "task.options.instruction_template=Attack!",
     "task.options.instruction_template: must contain '{goal}' (got 'Attack!')"),
    ("summarize", "task.options.missing_eos_mode=drop",
     "task.options.missing_eos_mode: Input should be 'subtract' or 'replace' (got 'drop')"),
    ("summarize", "task.options.judje=x", "task.options.judje: Extra inputs are not permitted (allowed: "
     + ", ".join(sorted(SummarizeOptions.model_fields)) + ")"),
]


@pytest.mark.parametrize("task, option, line", CASES, ids=[c[1].split(".")[-1] for c in CASES])
def test_bad_option_is_one_line_before_ray_starts(task, option, line, tmp_path, capsys, monkeypatch):
    def no_runtime(*args, **kwargs):  # were an option let through, fail here instead of training
        raise AssertionError("the run got past the task's options")

    monkeypatch.setattr("tba.api._run", no_runtime)
    rc = main(["train", str(CONFIGS / f"{task}.yaml"), option, "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and err == f"error: {line}\n", err
    assert not (tmp_path / "run").exists()


def test_a_task_without_options_refuses_any():
    with pytest.raises(ValueError, match=r"^task\.options\.x: Extra inputs are not permitted \(allowed: none\)$"):
        Task(TaskConfig(options={"x": 1}))
    assert Task(TaskConfig()).options.model_dump() == {}


def test_help_lists_every_tasks_options(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # descriptions wrap across lines
    for section in ("gsm8k", "known_optimum", "reasoning_gym:<dataset>", "redteam", "summarize"):
        assert f"\ntask.options of {section}:\n" in out
    assert "\n  seeds: builtin|harmbench\n" in out and "\n  skip_bad_rows: bool   Skip malformed" in out
    desc = " ".join(RedTeamOptions.model_fields["seeds"].description.split())
    assert f"{desc} [default: 'builtin']" in flat
    assert "passed unchecked to reasoning-gym's create_dataset" in flat  # a free dict there
