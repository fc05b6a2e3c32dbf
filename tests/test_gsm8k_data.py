"""GSM8K loading (tba.tasks.gsm8k_data): the shared JSONL copy, bad rows, missing paths."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tba.tasks.gsm8k_data import DataError, load_gsm8k


def _shared_gsm8k_dir() -> Path:
    env = os.environ.get("TBA_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    return base / "gsm8k"


GSM8K_DIR = _shared_gsm8k_dir()
needs_shared = pytest.mark.skipif(
    not (GSM8K_DIR / "test.jsonl").is_file(),
    reason=f"shared GSM8K copy not found at {GSM8K_DIR / 'test.jsonl'} (set TBA_SHARED_DATA to the "
    "folder holding gsm8k/test.jsonl)",
)


@needs_shared
def test_shared_test_split_from_directory():
    pairs = load_gsm8k(str(GSM8K_DIR), split="test")
    assert len(pairs) == 1319
    question, answer = pairs[0]
    assert question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert answer == "18"
    assert all(isinstance(q, str) and q and isinstance(a, str) and a for q, a in pairs)
    assert all("," not in a for _, a in pairs)  # "#### 1,450,000" -> "1450000"


@needs_shared
def test_shared_file_path_and_limit():
    pairs = load_gsm8k(str(GSM8K_DIR / "test.jsonl"), limit=3)
    assert len(pairs) == 3
    assert pairs[0][1] == "18"


GOOD = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}

# (bad line as written to the file, fragment expected in the error message)
BAD_LINES = [
    ('{"question": "What is 2 + 2?", "answer": ', "invalid JSON"),
    (json.dumps(["What is 2 + 2?", "#### 4"]), "expected a JSON object"),
    (json.dumps({"question": "What is 2 + 2?"}), "missing field 'answer'"),
    (json.dumps({"answer": "#### 4"}), "missing field 'question'"),
    (json.dumps({"question": "What is 2 + 2?", "answer": 4}), "'answer' must be a string, got int"),
    (json.dumps({"question": None, "answer": "#### 4"}), "field 'question' must be a string"),
    (json.dumps({"question": "   ", "answer": "#### 4"}), "empty 'question'"),
    (json.dumps({"question": "What is 2 + 2?", "answer": "it is 4"}), "no '#### <final answer>'"),
    (json.dumps({"question": "What is 2 + 2?", "answer": "it is 4\n####  "}), "empty final answer"),
]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(("bad", "fragment"), BAD_LINES)
def test_bad_row_names_file_and_line(tmp_path, bad, fragment):
    # Line 3 is bad; a blank line 2 is ignored but still counted in line numbers.
    path = _write(tmp_path / "train.jsonl", [json.dumps(GOOD), "", bad, json.dumps(GOOD)])
    with pytest.raises(DataError) as info:
        load_gsm8k(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:3: "), message
    assert fragment in message
    assert isinstance(info.value, ValueError)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"question": "\xff"}\n')
    with pytest.raises(DataError, match=r":2: not valid UTF-8"):
        load_gsm8k(str(path))


def test_skip_bad_rows_counts(tmp_path, caplog):
    lines = [json.dumps(GOOD)] + [bad for bad, _ in BAD_LINES] + [json.dumps(GOOD)]
    path = _write(tmp_path / "train.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="tba.tasks.gsm8k_data"):
        pairs = load_gsm8k(str(path), skip_bad_rows=True)
    assert pairs == [("What is 2 + 2?", "4"), ("What is 2 + 2?", "4")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"skipped {len(BAD_LINES)} bad GSM8K row(s)" in warnings[0]
    assert f"{path}:2: invalid JSON" in warnings[0]  # the first bad rows are quoted with file:line
    assert "and 4 more" in warnings[0]


def test_directory_source_and_limit(tmp_path):
    rows = [{"question": f"q{i}?", "answer": f"work\n#### {i},000"} for i in range(1, 6)]
    _write(tmp_path / "test.jsonl", [json.dumps(r) for r in rows])
    assert load_gsm8k(str(tmp_path), split="test", limit=2) == [("q1?", "1000"), ("q2?", "2000")]
    assert load_gsm8k(str(tmp_path), split="test", limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        load_gsm8k(str(tmp_path), split="test", limit=-1)


def test_missing_file_raises_file_not_found(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError) as info:
        load_gsm8k(str(missing))
    assert str(missing) in str(info.value)
    assert "openai/gsm8k" in str(info.value)


def test_directory_without_split_file(tmp_path):
    _write(tmp_path / "train.jsonl", [json.dumps(GOOD)])
    with pytest.raises(FileNotFoundError) as info:
        load_gsm8k(str(tmp_path), split="test")
    message = str(info.value)
    assert "test.jsonl" in message and str(tmp_path) in message and "train.jsonl" in message
