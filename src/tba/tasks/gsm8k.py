"""GSM8K grade-school math (Cobbe et al. 2021), the TBA paper's math task."""

from __future__ import annotations

from tba.rewards.math import gsm8k_reward
from tba.tasks.base import Problem, Task
from tba.tasks.gsm8k_data import load_gsm8k


class GSM8KTask(Task):
    """GSM8K from the hub id ``openai/gsm8k`` or local JSONL (a folder with train/test.jsonl, or a file).

    Reward (algorithm.md section 5): 1 if the final number of the response equals the gold answer, else 0.

    Raises:
        FileNotFoundError / DataError: missing or malformed data (file and line named).
    """

    name = "gsm8k"

    def __init__(self, source: str | None, train_size: int, eval_size: int, **kwargs):
        super().__init__(**kwargs)
        source = source or "openai/gsm8k"
        self.train = [Problem(i, q, a) for i, (q, a) in enumerate(load_gsm8k(source, "train", limit=train_size))]
        self.eval = [Problem(i, q, a) for i, (q, a) in enumerate(load_gsm8k(source, "test", limit=eval_size))]

    def reward(self, response: str, problem: Problem) -> float:
        """1.0 if the response's final number equals the gold answer, else 0.0."""
        return gsm8k_reward(response, problem.answer)
