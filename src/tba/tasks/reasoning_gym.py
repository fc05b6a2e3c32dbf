"""Any reasoning-gym dataset as a task, scored by the dataset's own ``score_answer``."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from tba.config import TaskConfig
from tba.rewards.math import extract_final_answer
from tba.tasks.base import Problem, Task


class ReasoningGymOptions(BaseModel):
    """A free dict: the dataset's own settings, passed unchecked to reasoning-gym's create_dataset, which
    refuses bad ones (they differ per dataset; chain_sum: {min_terms: 2, max_terms: 2, max_digits: 1}).
    A mixture is reasoning_gym:composite with {datasets: [{name, weight, config}, ...]}."""

    model_config = ConfigDict(extra="allow")


class ReasoningGymTask(Task):
    """Procedurally generated verifiable problems (reasoning-gym, Apache-2.0).

    Train and eval sets are disjoint stretches of the dataset's item stream; a train question whose text
    also occurs in the eval set (small problem spaces repeat) is dropped, so the eval stays held out.

    Args:
        cfg: the task section: ``name`` is ``reasoning_gym:<dataset>`` (e.g. ``reasoning_gym:chain_sum``);
            ``options`` are the dataset's settings (e.g. ``min_terms``), a free dict passed to
            ``create_dataset`` (:class:`ReasoningGymOptions` checks nothing, as the settings differ per dataset);
            ``train_size``, ``eval_size`` and ``seed`` place the two sets in the item stream;
            ``answer_pattern`` is a regex whose last match's group 1 is the answer (else the last number).

    Raises:
        ValueError: unknown dataset or bad settings (reasoning-gym's message is kept), an invalid
            ``answer_pattern``, or every train
            problem also occurs in the eval set.
    """

    Options = ReasoningGymOptions

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        import reasoning_gym

        dataset, options = cfg.name.split(":", 1)[1], self.options.model_dump()
        if dataset == "composite":
            options = _composite_options(options)
        train_size, eval_size, seed, answer_pattern = cfg.train_size, cfg.eval_size, cfg.seed, cfg.answer_pattern
        self.name = cfg.name
        try:
            # reasoning-gym draws item i from Random(seed + i): eval takes items seed+1 .. seed+eval_size and
            # train the items after them, so the two never share a draw (overlapping seeds would)
            eval_ds = reasoning_gym.create_dataset(dataset, size=eval_size, seed=seed + 1, **options)
            train_ds = reasoning_gym.create_dataset(dataset, size=train_size, seed=seed + 1 + eval_size, **options)
        except (KeyError, TypeError, AssertionError, ValueError) as e:
            raise ValueError(f"task '{self.name}' with options {self.options.model_dump()}: {e}") from None
        self._scorer = train_ds
        try:
            self._pattern = re.compile(answer_pattern, re.S) if answer_pattern else None
        except re.error as e:
            raise ValueError(f"task.answer_pattern {answer_pattern!r} is not a valid regex: {e}") from None
        self.eval = [Problem(i, e["question"], str(e["answer"]), e) for i, e in enumerate(eval_ds)]
        held_out = {p.question for p in self.eval}
        kept = [e for e in train_ds if e["question"] not in held_out]
        self.train = [Problem(i, e["question"], str(e["answer"]), e) for i, e in enumerate(kept)]
        if not self.train:
            raise ValueError(f"task '{self.name}': every train problem also occurs in the eval set; "
                             "raise task.train_size or widen options")

    def extract(self, response: str) -> str:
        """The answer string handed to the scorer: ``answer_pattern``'s last match, else the last number,
        else the whole response stripped."""
        if self._pattern is not None:
            matches = self._pattern.findall(response)
            if matches:
                return str(matches[-1]).strip()
        found = extract_final_answer(response)
        return found if found is not None else response.strip()

    def reward(self, response: str, problem: Problem) -> float:
        """reasoning-gym's ``score_answer`` of the extracted answer, in [0, 1]."""
        return float(self._scorer.score_answer(self.extract(response), problem.entry))


def _composite_options(options: dict) -> dict:
    """reasoning-gym's composite dataset takes ``DatasetSpec`` objects; a config holds them as mappings
    ``{name, weight, config}``. Each item is drawn from one member dataset with probability proportional to
    its weight, and scored by that member's ``score_answer``.

    Raises:
        ValueError: ``datasets`` is missing or not a list of mappings with exactly those keys (one line).
    """
    from reasoning_gym.composite import DatasetSpec

    specs = options.get("datasets")
    if not isinstance(specs, list) or not specs:
        raise ValueError("task.options.datasets: reasoning_gym:composite needs a non-empty list of "
                         f"{{name, weight, config}} mappings (got {specs!r})")
    try:
        return {**options, "datasets": [DatasetSpec(**spec) for spec in specs]}
    except TypeError as e:  # a missing or unknown key, or an item that is not a mapping
        raise ValueError(f"task.options.datasets: each item is a mapping with keys name, weight, config ({e})") \
            from None
