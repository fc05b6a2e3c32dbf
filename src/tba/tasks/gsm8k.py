"""GSM8K grade-school math (Cobbe et al. 2021), the TBA paper's math task.

Data: ``task.source`` is the hub id ``openai/gsm8k`` (the default; config ``main``, splits train/test),
a folder holding ``train.jsonl`` and ``test.jsonl`` (the dataset exported to JSONL), or one JSONL file
(its last ``eval_size`` rows are the eval set). Every row needs a non-empty string ``question`` and a
string ``answer``: the worked solution whose last line is ``#### <final answer>``. Loading, bad rows and
empty files follow :mod:`tba.tasks.data`.

Options (``task.options``): the fields of :class:`GSM8KOptions`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tba.config import TaskConfig
from tba.rewards.math import gold_final_answer, gsm8k_reward
from tba.tasks.base import Problem, Task, TaskOptions
from tba.tasks.data import load_splits, row_strings

HUB_ID = "openai/gsm8k"


class GSM8KOptions(TaskOptions):
    """``task.options`` of ``gsm8k``."""

    skip_bad_rows: bool = Field(False, description="Skip malformed data rows with one warning instead of stopping "
                                "(see tba.tasks.data).")


def gsm8k_row(row: Any) -> tuple[str, str]:
    """``(question, gold final answer)`` of one GSM8K row.

    The question is stripped; the final answer is :func:`tba.rewards.math.gold_final_answer` of the
    solution (``"... #### 1,200"`` -> ``"1200"``).

    Raises:
        ValueError: not an object, a missing/non-string/blank field, or no ``#### <answer>`` line.
    """
    question, answer = row_strings(row, ("question", "answer"))
    if "####" not in answer:
        raise ValueError("field 'answer' has no '#### <final answer>' line")
    final = gold_final_answer(answer)
    if final is None:
        raise ValueError("empty final answer after '####' in field 'answer'")
    return question.strip(), final


class GSM8KTask(Task):
    """GSM8K from the hub (``openai/gsm8k``) or local JSONL; see the module docstring.

    Reward (``docs/algorithm.md`` section 5): 1 if the final number of the response equals the gold
    answer, else 0. Eval: greedy accuracy on the first ``eval_size`` test problems.

    Args:
        cfg: the task section (``source``, ``train_size``, ``eval_size``, ``options``, prompt formatting).

    Raises:
        DataError: a malformed row (file and line named) or a split without usable rows.
        FileNotFoundError: a missing local path or split file. ValueError: an unknown or invalid option.
    """

    name = "gsm8k"
    Options = GSM8KOptions
    options: GSM8KOptions

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        train, evals = load_splits(cfg.source or HUB_ID, gsm8k_row, train_size=cfg.train_size,
                                   eval_size=cfg.eval_size, eval_split="test", hub_config="main",
                                   skip_bad_rows=self.options.skip_bad_rows, hint=f" such as {HUB_ID}")
        self.train = [Problem(i, q, a) for i, (q, a) in enumerate(train)]
        self.eval = [Problem(i, q, a) for i, (q, a) in enumerate(evals)]

    def reward(self, response: str, problem: Problem) -> float:
        """1.0 if the response's final number equals the gold answer, else 0.0."""
        return gsm8k_reward(response, problem.answer)
