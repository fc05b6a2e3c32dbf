"""A task is data plus a reward: prompts, their formatting, a scorer and a held-out eval set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from tba.config import Config, TaskConfig
from tba.tasks.evaluation import greedy_accuracy


class TaskOptions(BaseModel):
    """A task's ``task.options``: subclass it with one field per option, each with its default and a
    ``Field(description=...)`` (``tba train --help`` lists them). Unknown keys are refused. This base takes
    no options."""

    model_config = ConfigDict(extra="forbid")


def parse_options(model: type[BaseModel], given: dict[str, Any] | None) -> BaseModel:
    """``given`` (the merged ``task.options``) validated as ``model``.

    Raises:
        ValueError: one line for the first invalid option, ``task.options.X: <what is allowed>`` (an unknown
            key lists the known ones; a bad value quotes it).
    """
    try:
        return model.model_validate(given or {})
    except ValidationError as e:
        err = e.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg += f" (allowed: {', '.join(sorted(model.model_fields)) or 'none'})"
    elif "input" in err and not isinstance(err["input"], dict):
        msg += f" (got {err['input']!r})"
    raise ValueError(f"task.options.{'.'.join(map(str, err['loc']))}: {msg}")


@dataclass
class Problem:
    """One prompt with what its scorer needs.

    Attributes:
        id: index in the task's train (or eval) list; the searchers' shards and the buffer key on it.
        question: problem text shown to the model.
        answer: gold answer (for logging and scorers).
        entry: the task's own record (reasoning-gym's scorer takes it), if any.
    """

    id: int
    question: str
    answer: str
    entry: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class: subclasses fill ``train``/``eval`` and implement :meth:`reward`.

    Every task is built from its config section (:class:`tba.config.TaskConfig`, where the settings all
    tasks share are declared) by :func:`tba.tasks.build_task`. Its own settings, ``task.options``, are the
    fields of its :attr:`Options` model (a :class:`TaskOptions`), validated here into ``self.options``
    before a subclass loads anything; a task that needs run settings from other sections declares them in
    :meth:`run_options`.

    Args:
        cfg: the task section; here ``options``, ``system_prompt`` (used when the tokenizer has a chat
            template) and ``prompt_template`` (the user message, with a ``{question}`` placeholder).

    Raises:
        ValueError: ``prompt_template`` lacks ``{question}``, or an unknown or invalid option (one line,
            ``task.options.X: ...``, see :func:`parse_options`).
    """

    name = "task"
    Options: type[BaseModel] = TaskOptions

    def __init__(self, cfg: TaskConfig):
        if "{question}" not in cfg.prompt_template:
            raise ValueError("task.prompt_template must contain '{question}'")
        self.config = cfg
        self.options = parse_options(self.Options, cfg.options)
        self.system_prompt = cfg.system_prompt
        self.prompt_template = cfg.prompt_template
        self.train: list[Problem] = []
        self.eval: list[Problem] = []

    @classmethod
    def run_options(cls, cfg: Config) -> dict[str, Any]:
        """Default ``task.options`` this task takes from the rest of the run config (none here).

        :func:`tba.tasks.build_task` merges them under the user's ``task.options`` (the user's values win).
        """
        return {}

    def reward(self, response: str, problem: Problem) -> float:
        """Reward of a decoded response for ``problem``, in the task's own units (here [0, 1])."""
        raise NotImplementedError

    def reward_batch(self, responses: list[str], problems: list[Problem]) -> list[float]:
        """Rewards of many responses at once. Override when scoring batches well (a victim LM, a reward
        model); the searcher then calls it once per generation batch, falling back to :meth:`reward` per
        sample if the batch call fails."""
        return [self.reward(r, p) for r, p in zip(responses, problems)]

    def own_model(self) -> str:
        """The folder of the policy a task ships itself (``model.policy: task``; see ``known_optimum``).

        Raises:
            ValueError: this task ships no model.
        """
        raise ValueError(f"model.policy 'task': task '{self.name}' ships no model of its own; name a model")

    def evaluate(self, engine, tokenizer, batch_size: int = 32, max_new_tokens: int = 64, policy=None) -> dict:
        """Held-out metrics of the policy behind ``engine``; default: greedy accuracy on ``self.eval``.

        Args:
            engine: a :class:`tba.engines.base.Engine` holding the policy (``run.eval_engine``; it decodes as
                many responses at once as it was built for); tokenizer: its tokenizer.
            batch_size: responses per ``generate`` call, for tasks that chunk their eval set (unused here);
                max_new_tokens: response cap, tokens.
            policy: the same policy as a transformers causal LM (eval mode) on the run's device, for tasks
                whose metrics score responses instead of generating them (``known_optimum``) or that need the
                device (``summarize`` puts its reference model there); unused here.

        Returns a dict with at least one float metric (``accuracy`` here) and optional ``examples``.
        """
        return greedy_accuracy(engine, self, tokenizer, self.eval, max_new_tokens)

    def is_correct(self, response: str, problem: Problem) -> bool:
        """Eval criterion: full reward."""
        return self.reward(response, problem) >= 1.0

    def check_prompts(self, tokenizer, max_positions: int | None, max_new_tokens: int) -> None:
        """Encode every train and eval prompt once so bad ones fail before any worker starts.

        Raises:
            ValueError: an empty prompt, or one whose tokens plus ``max_new_tokens`` exceed the model's
                context (``max_positions``), naming the split and problem id.
        """
        for split, problems in (("train", self.train), ("eval", self.eval)):
            for p in problems:
                n = len(self.encode(tokenizer, p))
                if max_positions and n + max_new_tokens > max_positions:
                    raise ValueError(f"{self.name} {split} problem {p.id}: prompt of {n} tokens + "
                                     f"searcher.max_new_tokens {max_new_tokens} exceeds the model's context of "
                                     f"{max_positions} tokens")

    def encode(self, tokenizer, problem: Problem) -> list[int]:
        """Prompt token ids: the chat template when the tokenizer has one, else the raw user text.

        Raises:
            ValueError: the formatted prompt is empty.
        """
        user = self.prompt_template.format(question=problem.question)
        if not problem.question.strip():
            raise ValueError(f"{self.name}: problem {problem.id} has an empty prompt")
        if getattr(tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
                {"role": "user", "content": user}
            ]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return tokenizer(user)["input_ids"]
