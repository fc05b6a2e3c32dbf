"""``tba train``'s polish, through ``tba.cli.main``: --help grouped by config section, "did you mean" for a
misspelt field, --print-config. None of these starts a run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tba.cli import main, parse_train_args
from tba.config import Config, ConfigError, iter_fields, load_config

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
SECTIONS = list(Config.model_fields)  # model, task, searcher, buffer, loss, trainer, run


@pytest.fixture()
def no_run(monkeypatch):
    """Any of these tests getting as far as a run fails at once instead of training."""
    def refuse(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr("tba.api.train", refuse)


def _help(capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_groups_the_fields_by_section(capsys, monkeypatch):
    out = _help(capsys, monkeypatch)
    assert out.startswith("usage: tba train [CONFIG] [--section.field V | section.field=V ...]")
    # each section is a heading with its description, and holds exactly its own fields, in the order declared
    headings = re.findall(r"^(\S[^:\n]*):\n", out.split("\ntask options: ", 1)[0], re.M)
    assert headings == ["positional arguments", "options", "shortcuts", *SECTIONS]
    for section in SECTIONS:
        body = out.split(f"\n{section}:\n", 1)[1].split("\n\n", 2)
        doc = " ".join(Config.model_fields[section].annotation.__doc__.split())
        assert " ".join(body[0].split()) == doc
        flags = re.findall(r"^  --(\S+)", body[1], re.M)
        assert flags == [d for d, _ in iter_fields() if d.split(".")[0] == section], section
    shortcuts = out.split("\nshortcuts:\n", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^  (--\S+)", shortcuts, re.M) == ["--max-steps", "--ray-address", "--output-dir", "--mode",
                                                          "--seed"]
    assert "--print-config" in out.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]


@pytest.mark.parametrize("argv, line", [
    (["--trainer.lrr", "1e-4"], "unknown field trainer.lrr; did you mean trainer.lr?"),
    (["--trainer.lrr=1e-4"], "unknown field trainer.lrr; did you mean trainer.lr?"),
    (["trainer.lrr=1e-4"], "unknown field trainer.lrr; did you mean trainer.lr?"),
    ([QUICKSTART, "--trainr.lr", "1e-4"], "unknown field trainr.lr; did you mean trainer.lr?"),
    (["--trainer.warm", "3"], "unknown field trainer.warm; did you mean trainer.warmup_steps?"),  # no abbreviations
    (["--trainer.temperature", "1"], "unknown field trainer.temperature; did you mean searcher.temperature?"),
    (["--lr", "1e-4"], "unknown option --lr; did you mean --trainer.lr?"),
    (["--max-step", "3"], "unknown option --max-step; did you mean --max-steps?"),
])
def test_unknown_field_suggests_the_closest(argv, line, capsys, no_run):
    rc = main(["train", *argv])
    err = capsys.readouterr().err
    assert (rc, err) == (2, f"error: {line}\n")


def test_unknown_field_without_a_close_one_lists_the_section(capsys, no_run):
    assert main(["train", "--trainer.xyzzy", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown field trainer.xyzzy: trainer has max_steps, ")


def test_misspelt_yaml_key_suggests_the_field(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer: {lrr: 1.0e-4}\n")
    with pytest.raises(ConfigError, match=r"trainer\.lrr: Extra inputs are not permitted \(got 0\.0001\); did you "
                                          r"mean trainer\.lr\?"):
        load_config(f)


def test_task_option_flags_are_assignments():
    args = parse_train_args(["--task.options.min_terms", "3", QUICKSTART, "--task.options.max_terms=4"])
    assert args.config == QUICKSTART
    assert args.overrides == {"task.options.min_terms": 3, "task.options.max_terms": 4}


def test_print_config_prints_the_resolved_config_and_starts_nothing(tmp_path, capsys, no_run):
    run = tmp_path / "run"
    argv = [QUICKSTART, "--trainer.lr", "3e-5", "task.options.max_terms=3", "--output-dir", str(run)]
    assert main(["train", *argv, "--print-config"]) == 0
    out = capsys.readouterr().out
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    expected = load_config(QUICKSTART, parse_train_args(argv).overrides)
    assert load_config(printed) == expected  # every field, overrides applied: it reads back to the same config
    assert yaml.safe_load(out)["trainer"]["lr"] == 3e-5 and set(yaml.safe_load(out)) == set(Config.model_fields)
    assert not run.exists()
    assert main(["train", QUICKSTART, "--trainer.lr", "-1", "--print-config"]) == 2  # validated like a run
    assert "trainer.lr: Input should be greater than 0" in capsys.readouterr().err


def test_summary_names_sync_check_warnings(capsys):
    """The end-of-run summary says when sync checks warned (published weights may not have reached an engine),
    and says nothing of it on a working sync."""
    from tba.cli import print_summary

    summary = {"trainer_steps": 4, "samples_generated": 32, "wall_s": 10.0, "train_wall_s": 8.0,
               "trainer_idle_frac": 0.1, "staleness_mean": 0.5, "staleness_max": 1, "searcher_max_version": 4,
               "searcher_restarts": 0, "reward_failures": 0, "run_dir": "runs/x", "sync_gap_warnings": 0}
    print_summary(summary)
    assert "sync check" not in capsys.readouterr().out
    print_summary({**summary, "sync_gap_warnings": 2})
    assert "\nwarning: 2 sync checks found a searcher engine's log-probs far from the trainer's" in \
        capsys.readouterr().out
