"""GSM8K data: the sample shipped in tests/data/gsm8k, gold answers via the reward module, bad rows, paths."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tba.config import Config, TaskConfig
from tba.rewards.math import gold_final_answer, gsm8k_reward
from tba.tasks import build_task
from tba.tasks.data import DataError, load_rows
from tba.tasks.gsm8k import gsm8k_row

SAMPLE = Path(__file__).resolve().parent / "data" / "gsm8k"


def _gsm8k(source, **fields):
    return build_task(Config(task=TaskConfig(name="gsm8k", source=str(source), **fields)))


def _raw(split: str) -> list[dict]:
    return [json.loads(line) for line in (SAMPLE / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


# -- the shipped sample -------------------------------------------------------------------------------
def test_sample_folder_loads_both_splits():
    task = _gsm8k(SAMPLE, train_size=100, eval_size=100)
    assert (len(task.train), len(task.eval)) == (8, 5)
    assert task.eval[0].question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert [p.answer for p in task.eval] == ["18", "3", "70000", "540", "114200"]  # "#### 114,200" -> "114200"
    assert [p.answer for p in task.train] == ["72", "10", "5", "42", "624", "35", "48", "-47"]
    assert [p.id for p in task.train] == list(range(8))


def test_sizes_keep_the_first_rows():
    task = _gsm8k(SAMPLE, train_size=2, eval_size=1)
    assert [p.answer for p in task.train] == ["72", "10"] and [p.answer for p in task.eval] == ["18"]


def test_one_file_source_holds_out_its_last_rows():
    task = _gsm8k(SAMPLE / "train.jsonl", train_size=100, eval_size=3)
    assert [p.answer for p in task.train] == ["72", "10", "5", "42", "624"]
    assert [p.answer for p in task.eval] == ["35", "48", "-47"]


def test_gold_answers_are_the_reward_modules_parse():
    for split in ("train", "test"):
        for row in _raw(split):
            question, final = gsm8k_row(row)
            assert final == gold_final_answer(row["answer"]) and question == row["question"].strip()
            assert gsm8k_reward(f"So the answer is {final}.", final) == 1.0
    # a gold line with units: the reward module's rule finds the number (a hand-written "text after ####"
    # would keep "$1,200 dollars", which no response could match)
    assert gsm8k_row({"question": "q?", "answer": "work\n#### $1,200 dollars"}) == ("q?", "1200")


# -- bad rows ---------------------------------------------------------------------------------------
GOOD = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}

# (bad line as written to the file, fragment expected in the error message)
BAD_LINES = [
    ('{"question": "What is 2 + 2?", "answer": ', "invalid JSON"),
    (json.dumps(["What is 2 + 2?", "#### 4"]), "expected a JSON object with 'question' and 'answer', got list"),
    (json.dumps({"question": "What is 2 + 2?"}), "missing field 'answer'"),
    (json.dumps({"answer": "#### 4"}), "missing field 'question'"),
    (json.dumps({"question": "What is 2 + 2?", "answer": 4}), "field 'answer' must be a string, got int"),
    (json.dumps({"question": None, "answer": "#### 4"}), "field 'question' must be a string, got NoneType"),
    (json.dumps({"question": "   ", "answer": "#### 4"}), "empty 'question'"),
    (json.dumps({"question": "What is 2 + 2?", "answer": "it is 4"}),
     "field 'answer' has no '#### <final answer>' line"),
    (json.dumps({"question": "What is 2 + 2?", "answer": "it is 4\n####  "}), "empty final answer after '####'"),
]


def _folder(tmp_path: Path, train_lines: list[str]) -> Path:
    (tmp_path / "train.jsonl").write_text("\n".join(train_lines) + "\n", encoding="utf-8")
    (tmp_path / "test.jsonl").write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(("bad", "fragment"), BAD_LINES)
def test_bad_row_names_file_and_line(tmp_path, bad, fragment):
    # line 3 is bad; the blank line 2 is ignored but still counted
    folder = _folder(tmp_path, [json.dumps(GOOD), "", bad, json.dumps(GOOD)])
    with pytest.raises(DataError) as info:
        _gsm8k(folder, eval_size=1)
    message = str(info.value)
    assert message.startswith(f"{folder / 'train.jsonl'}:3: {fragment}"), message


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"question": "\xff"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl:2: not valid UTF-8"):
        load_rows(str(path), "train", gsm8k_row)


def test_skip_bad_rows_option(tmp_path, caplog):
    folder = _folder(tmp_path, [json.dumps(GOOD)] + [bad for bad, _ in BAD_LINES] + [json.dumps(GOOD)])
    with caplog.at_level(logging.WARNING, logger="tba.tasks.data"):
        task = _gsm8k(folder, eval_size=1, options={"skip_bad_rows": True})
    assert [(p.question, p.answer) for p in task.train] == [("What is 2 + 2?", "4")] * 2
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"skipped {len(BAD_LINES)} bad row(s) in {folder / 'train.jsonl'}: ")
    assert f"{folder / 'train.jsonl'}:2: invalid JSON" in warning and warning.endswith("(and 4 more)")
    with pytest.raises(ValueError, match=r"^task\.options\.skip_bad_row: Extra inputs are not permitted \(allowed: "
                                         r"skip_bad_rows\)$"):
        _gsm8k(folder, options={"skip_bad_row": True})


# -- paths ----------------------------------------------------------------------------------------
def test_missing_path_names_it_and_the_hub_id(tmp_path):
    missing = tmp_path / "nope" / "gsm8k"
    with pytest.raises(FileNotFoundError) as info:
        _gsm8k(missing)
    assert str(missing) in str(info.value) and "openai/gsm8k" in str(info.value)


def test_folder_without_split_file(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(FileNotFoundError) as info:
        _gsm8k(tmp_path)
    assert str(info.value) == f"no test.jsonl in folder {tmp_path} (found: train.jsonl)"
