"""The one task-data loader (tba.tasks.data): local-path rule, BOM, empty files, bad-row policy, and build_task.

Real files throughout (written to tmp_path, or the GSM8K sample shipped in tests/data/gsm8k).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tba.config import Config, TaskConfig
from tba.tasks import build_task, task_class
from tba.tasks.data import DataError, is_local, load_rows, load_splits, row_strings, split_file
from tba.tasks.gsm8k import GSM8KTask

SAMPLE = Path(__file__).resolve().parent / "data" / "gsm8k"
ROW = {"question": "Tom has 2 apples and buys 3 more. How many?", "answer": "2+3=5\n#### 5"}


def _check(row):
    question, answer = row_strings(row, ("question", "answer"))
    return question, answer


def _task(**fields):
    return build_task(Config(task=TaskConfig(**fields)))


# -- the one local-path rule ------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["openai/gsm8k", "gsm8k", "trl-lib/tldr", "owner/name-2.0"])
def test_hub_ids_are_not_local(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of that name exists here
    assert not is_local(source)


@pytest.mark.parametrize("source", ["/data/gsm8k", "./gsm8k", "../gsm8k", "~/gsm8k", "train.jsonl", "rows.json",
                                    "data/gsm8k/train"])
def test_paths_are_local_even_when_missing(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_local(source)


def test_an_existing_folder_shaped_like_a_hub_id_is_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "openai" / "gsm8k").mkdir(parents=True)
    assert is_local("openai/gsm8k")


# -- reading ---------------------------------------------------------------------------------------
def test_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps(ROW) + "\n", encoding="utf-8-sig")
    assert path.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert load_rows(str(path), "train", _check) == [(ROW["question"], ROW["answer"])] * 2


def test_empty_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"")
    with pytest.raises(DataError) as err:
        load_rows(str(path), "train", _check)
    assert str(err.value) == f"{path}: no rows (the file is empty)"


def test_blank_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n  \n\t\n")
    with pytest.raises(DataError) as err:
        load_rows(str(path), "train", _check)
    assert str(err.value) == f"{path}: no rows (only blank lines)"


def test_bad_row_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([json.dumps(ROW), "", '{"question": "q"}', json.dumps(ROW)]) + "\n")
    with pytest.raises(DataError) as err:
        load_rows(str(path), "train", _check)
    assert str(err.value) == f"{path}:3: missing field 'answer'"


def test_skip_bad_rows_warns_once_and_an_all_bad_file_is_still_an_error(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(["{oops", json.dumps(ROW), "[1]"]) + "\n")
    with caplog.at_level(logging.WARNING, logger="tba.tasks.data"):
        assert load_rows(str(path), "train", _check, skip_bad_rows=True) == [(ROW["question"], ROW["answer"])]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"skipped 2 bad row(s) in {path}: {path}:1: invalid JSON")
    assert f"{path}:3: expected a JSON object" in warning
    path.write_text("{oops\n[1]\n")
    with pytest.raises(DataError, match=r"no usable rows \(all 2 are malformed; the first: .*:1: invalid JSON"):
        load_rows(str(path), "train", _check, skip_bad_rows=True)


def test_limit_keeps_the_first_good_rows(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not read\n")
    assert load_rows(str(path), "train", _check, limit=2) == [("q0", "#### 0"), ("q1", "#### 1")]


def test_one_file_holds_out_its_last_rows(tmp_path):
    path = tmp_path / "all.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(6)))
    train, evals = load_splits(str(path), _check, train_size=3, eval_size=2)
    assert [q for q, _ in train] == ["q0", "q1", "q2"] and [q for q, _ in evals] == ["q4", "q5"]
    with pytest.raises(DataError, match=r"all\.jsonl: 6 usable rows; one file needs more than task.eval_size=6"):
        load_splits(str(path), _check, train_size=3, eval_size=6)


def test_folder_split_files(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROW) + "\n")
    with pytest.raises(FileNotFoundError) as err:
        split_file(tmp_path, "validation", "test")
    assert str(err.value) == f"no validation.jsonl (or test.jsonl) in folder {tmp_path} (found: train.jsonl)"
    (tmp_path / "test.jsonl").write_text(json.dumps(ROW) + "\n")
    assert split_file(tmp_path, "validation", "test") == tmp_path / "test.jsonl"
    assert split_file(tmp_path, "train") == tmp_path / "train.jsonl"


# -- build_task ------------------------------------------------------------------------------------
def test_build_task_reads_the_shipped_gsm8k_sample():
    task = _task(name="gsm8k", source=str(SAMPLE), train_size=100, eval_size=3)
    assert isinstance(task, GSM8KTask) and task.config.source == str(SAMPLE)
    assert (len(task.train), len(task.eval)) == (8, 3)


def test_empty_train_file_fails_at_construction_naming_the_file(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b"")
    (tmp_path / "test.jsonl").write_text(json.dumps(ROW) + "\n")
    with pytest.raises(DataError) as err:
        _task(name="gsm8k", source=str(tmp_path))
    assert str(err.value) == f"{tmp_path / 'train.jsonl'}: no rows (the file is empty)"


def test_bom_file_through_build_task(tmp_path):
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(ROW) + "\n", encoding="utf-8-sig")
    task = _task(name="gsm8k", source=str(tmp_path), eval_size=1)
    assert task.train[0].question == ROW["question"] and task.train[0].answer == "5"


def test_unknown_task_name_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        task_class("chess")
    assert str(err.value) == ("task.name 'chess' is unknown: use one of 'gsm8k', 'known_optimum', "
                              "'reasoning_gym:<dataset>', 'redteam', 'summarize'")
    assert task_class("reasoning_gym:chain_sum").__name__ == "ReasoningGymTask"


MIX = {"datasets": [{"name": "chain_sum", "weight": 1, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
                    {"name": "lcm", "weight": 1, "config": {"min_numbers": 2, "max_numbers": 2, "max_value": 12}}]}


def test_composite_mixes_reasoning_gym_datasets_and_scores_each_by_its_own_rule():
    """reasoning_gym:composite: items come from both members, train and eval stay disjoint, and each item is
    scored by its member. The right answers are worked out here from the question text: the sum for
    chain_sum ('... problem: 4 - 1 ='), math.lcm for lcm ('... of these numbers: 4, 6')."""
    import math
    import re

    task = _task(name="reasoning_gym:composite", options=MIX, train_size=60, eval_size=40)
    members = {p.entry["metadata"]["source_dataset"] for p in task.eval}
    assert members == {"chain_sum", "lcm"}
    assert not {p.question for p in task.train} & {p.question for p in task.eval}
    for p in task.eval:
        if p.entry["metadata"]["source_dataset"] == "lcm":
            a, b = map(int, re.search(r"numbers: (\d+), (\d+)", p.question).groups())
            right = math.lcm(a, b)
        else:
            a, op, b = re.search(r"(-?\d+) ([+-]) (-?\d+) =", p.question).groups()
            right = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert task.reward(f"The answer is {right}.", p) == 1.0, p.question
        assert task.reward(str(right + 1), p) == 0.0, p.question


@pytest.mark.parametrize("options, line", [
    ({}, "task.options.datasets: reasoning_gym:composite needs a non-empty list of {name, weight, config} "
         "mappings (got None)"),
    ({"datasets": [{"name": "lcm", "weight": 1}]},
     "task.options.datasets: each item is a mapping with keys name, weight, config (DatasetSpec.__init__() "
     "missing 1 required positional argument: 'config')"),
])
def test_composite_with_bad_members_is_one_line(options, line):
    with pytest.raises(ValueError) as err:
        _task(name="reasoning_gym:composite", options=options, train_size=4, eval_size=2)
    assert str(err.value) == line
