"""A task whose KL-regularised optimum is known exactly: every response can be enumerated.

The policy is a tiny causal LM built here from a transformers config (random init with a fixed seed, no
download) over a word-level vocabulary of a few symbols plus EOS. Each prompt has a few separated
**modes** (target strings); the reward is the best positional match to one of them, in [0, 1]. Responses
have at most ``searcher.max_new_tokens`` tokens, so the whole response space is small enough to score, and
every eval computes exact quantities instead of noisy estimates: KL(pi_theta || pi*), total variation,
the objective gap J* - J(pi_theta), the expected reward and mode coverage (docs/algorithm.md section 8).

pi* is the tilted reference of docs/algorithm.md section 1: pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import Field

from tba.config import Config, TaskConfig
from tba.tasks.base import Problem, Task, TaskOptions

EOS = "<eos>"


class KnownOptimumOptions(TaskOptions):
    """``task.options`` of ``known_optimum`` (each one checked before anything starts)."""

    symbols: list[str] = Field(["a", "b", "c", "d"], min_length=2,
                               description="Response alphabet (words); the vocabulary is these plus EOS.")
    num_prompts: int = Field(4, ge=1, description="Prompts (each its own string of symbols and its own modes).")
    prompt_length: int = Field(3, ge=1, description="Symbols per prompt.")
    modes_per_prompt: int = Field(3, ge=1, description="Target strings (reward modes) per prompt.")
    mode_length: int = Field(4, ge=1, description="Symbols per mode; must leave room for EOS in max_new_tokens.")
    min_mode_distance: int = Field(3, ge=1, description="Least Hamming distance between two modes of a prompt.")
    beta: float = Field(0.1, gt=0, description="KL coefficient of the optimum pi* (run default: trainer.beta_end).")
    temperature: float = Field(1.0, gt=0, description="Temperature pi_theta is read at (run default: "
                               "searcher.temperature, the one every log-prob of the loss uses).")
    max_new_tokens: int = Field(5, ge=1, description="Response cap L (run default: searcher.max_new_tokens).")
    max_responses: int = Field(20_000, ge=1, description="Refuse a response space larger than this per prompt.")
    hidden_size: int = Field(32, ge=4, description="Width of the tiny Llama policy.")
    num_layers: int = Field(2, ge=1, description="Transformer layers of the tiny policy.")
    num_heads: int = Field(4, ge=1, description="Attention heads (must divide hidden_size).")
    init_std: float = Field(0.1, gt=0, description="Std of the random init: well above transformers' 0.02 so that "
                            "pi_ref is far from uniform.")
    model_seed: int = Field(0, description="Seed of the random init (and of the prompts and modes).")
    cache_dir: Optional[str] = Field(None, description="Where the model folder is written (run default: "
                                     "model.cache_dir).")


class KnownOptimumTask(Task):
    """Prompts of symbols, several separated reward modes each, and a response space small enough to enumerate.

    Reward: ``r(x, y) = max_m match(y, mode_m) / max(|y|, |mode_m|)``, where ``match`` counts positions with
    the same symbol and |y| counts symbols (EOS excluded). So r = 1 exactly on a mode, and between two modes
    at Hamming distance d >= ``min_mode_distance`` it dips (separated modes).

    The response space Y(x) is every string of 0..L-1 symbols followed by EOS plus every string of L symbols
    (cut at the cap): ``sum_{n<L} V^n + V^L`` responses for V symbols. Their probabilities under any
    autoregressive policy sum to 1, which each eval checks (``total_mass``).

    Args:
        cfg: the task section; ``options`` as :class:`KnownOptimumOptions` (merged with :meth:`run_options`).

    Raises:
        ValueError: invalid options (naming ``task.options.X``), a response space above ``max_responses``
            (naming the size and the fields that set it), modes that do not fit in ``max_new_tokens``, or
            modes that cannot be placed at ``min_mode_distance``.
    """

    name = "known_optimum"
    Options = KnownOptimumOptions
    options: KnownOptimumOptions

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        o = self.options
        v, length = len(o.symbols), o.max_new_tokens
        size = response_count(v, length)
        if size > o.max_responses:
            raise ValueError(f"task known_optimum: {size:,} responses per prompt ({v} symbols, responses up to "
                             f"{length} tokens) exceed task.options.max_responses {o.max_responses:,}; lower "
                             "searcher.max_new_tokens or shorten task.options.symbols")
        if o.mode_length >= length:
            raise ValueError(f"task.options.mode_length {o.mode_length} must be below searcher.max_new_tokens "
                             f"{length} (a mode needs room for EOS)")
        if len(set(o.symbols)) != v or EOS in o.symbols or any(not s or s.split() != [s] for s in o.symbols):
            raise ValueError(f"task.options.symbols must be distinct single words other than {EOS}")
        rng = random.Random(o.model_seed)
        self.modes: list[list[str]] = []
        for i in range(o.num_prompts):
            question = " ".join(rng.choice(o.symbols) for _ in range(o.prompt_length))
            modes = _separated_modes(rng, o.symbols, o.mode_length, o.modes_per_prompt, o.min_mode_distance)
            self.train.append(Problem(i, question, " | ".join(" ".join(m) for m in modes), {"modes": modes}))
        self.eval = self.train
        self.responses = enumerate_responses(o.symbols, length)  # symbol strings; EOS-ended unless len == L
        self.rewards = torch.tensor([[mode_reward(y, p.entry["modes"]) for y in self.responses] for p in self.train])
        index = {y: j for j, y in enumerate(self.responses)}
        self.mode_index = [[index[tuple(m)] for m in p.entry["modes"]] for p in self.train]  # per prompt
        self._ref_logp: torch.Tensor | None = None  # [P, N], from the initial weights, on the first eval

    @classmethod
    def run_options(cls, cfg: Config) -> dict[str, Any]:
        """beta (``trainer.beta_end``), the temperature and response cap of the searchers, the model cache.

        Raises:
            ValueError: ``model.reference`` is set (pi_ref must be this task's initial model), or the policy
                is not this task's own model (``model.policy: task``).
        """
        if cfg.model.policy != "task" or cfg.model.reference is not None:
            raise ValueError("task known_optimum builds its own policy: set model.policy to 'task' and leave "
                             "model.reference unset (pi_ref is the initial policy)")
        return {"beta": cfg.trainer.beta_end, "temperature": cfg.searcher.temperature,
                "max_new_tokens": cfg.searcher.max_new_tokens, "cache_dir": cfg.model.cache_dir}

    # -- model -----------------------------------------------------------------------------------------
    def own_model(self) -> str:
        """The folder of this task's policy (a tiny Llama and a word-level tokenizer), written once per
        option set under the model cache; the folder appears atomically, so concurrent callers are safe."""
        from tba.models import cache_root

        o = self.options
        spec = {k: getattr(o, k) for k in ("symbols", "hidden_size", "num_layers", "num_heads", "init_std",
                                           "model_seed", "max_new_tokens", "prompt_length")}
        key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
        out = cache_root(o.cache_dir) / "known_optimum" / key
        if (out / "config.json").is_file():
            return str(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
        model, tok = build_tiny_lm(o)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race; its copy is identical (same seed)
            shutil.rmtree(tmp, ignore_errors=True)
        return str(out)

    # -- reward ----------------------------------------------------------------------------------------
    def reward(self, response: str, problem: Problem) -> float:
        """Best positional match of the response's symbols to one of the prompt's modes, in [0, 1]."""
        return mode_reward(response.split(), problem.entry["modes"])

    def is_correct(self, response: str, problem: Problem) -> bool:
        """A response is correct when it is exactly one of the modes."""
        return self.reward(response, problem) >= 1.0

    # -- exact evaluation ------------------------------------------------------------------------------
    def evaluate(self, engine, tokenizer, batch_size: int = 32, max_new_tokens: int = 64, policy=None) -> dict:
        """Exact quantities of ``policy`` (the trainer's model) over the whole response space.

        Returns:
            :func:`exact_metrics` plus ``kl_prompt_<i>`` (KL(pi_theta || pi*) of prompt i, nats).

        Raises:
            ValueError: no ``policy`` given (this task scores responses, it does not generate them).
        """
        if policy is None:
            raise ValueError("known_optimum evaluates by scoring every response: pass the policy model")
        if self._ref_logp is None:
            from tba.models import load_causal_lm

            ref = load_causal_lm(self.own_model(), torch.float32)
            self._ref_logp = self.response_logprobs(ref, tokenizer)
        logp = self.response_logprobs(policy, tokenizer)
        out = exact_metrics(logp, self._ref_logp, self.rewards, self.options.beta, self.mode_index)
        out.update({f"kl_prompt_{i}": v for i, v in enumerate(out.pop("kl_per_prompt"))})
        return out

    @torch.no_grad()
    def response_logprobs(self, model, tokenizer, micro_batch: int = 4096) -> torch.Tensor:
        """log pi(y|x) of every response of every prompt at ``options.temperature`` [P, N] (nats, float64),
        summed over the response's tokens (EOS included) with :func:`tba.scoring.token_logprobs`, the
        trainer's own scoring."""
        from tba.scoring import token_logprobs

        eos = tokenizer.eos_token_id
        ids = [tokenizer.convert_tokens_to_ids(list(y)) + ([] if len(y) == self.options.max_new_tokens else [eos])
               for y in self.responses]
        rows = []
        for p in self.train:
            prompt = self.encode(tokenizer, p)
            parts = []
            for s in range(0, len(ids), micro_batch):
                chunk = ids[s : s + micro_batch]
                lp, _ = token_logprobs(model, [prompt] * len(chunk), chunk, self.options.temperature,
                                       tokenizer.pad_token_id)
                parts.append(lp.double().sum(-1).cpu())
            rows.append(torch.cat(parts))
        return torch.stack(rows)


def response_count(num_symbols: int, max_len: int) -> int:
    """Size of the response space: strings of 0..L-1 symbols then EOS, plus strings of L symbols."""
    return sum(num_symbols**n for n in range(max_len)) + num_symbols**max_len


def enumerate_responses(symbols: list[str], max_len: int) -> list[tuple[str, ...]]:
    """Every response as its symbols, shortest first (a tuple of length L is cut at the cap, shorter
    ones end with EOS)."""
    return [y for n in range(max_len + 1) for y in itertools.product(symbols, repeat=n)]


def mode_reward(symbols: list[str] | tuple[str, ...], modes: list[list[str]]) -> float:
    """max over modes of (positions where the response and the mode agree) / max(|response|, |mode|)."""
    best = 0.0
    for m in modes:
        hits = sum(a == b for a, b in zip(symbols, m))
        best = max(best, hits / max(len(symbols), len(m)))
    return best


def exact_metrics(logp: torch.Tensor, ref_logp: torch.Tensor, reward: torch.Tensor, beta: float,
                  modes: list[list[int]]) -> dict:
    """Exact distances of a policy from the KL-regularised optimum, over an enumerated response space.

    With pi*(y|x) = pi_ref(y|x) exp(r / beta) / Z(x) (docs/algorithm.md section 1) and
    J(pi) = E_pi[r] - beta KL(pi || pi_ref), per prompt:

    - ``kl`` = KL(pi_theta || pi*) = sum_y pi_theta (log pi_theta - log pi*), nats;
    - ``tv`` = 1/2 sum_y |pi_theta - pi*|;
    - ``gap`` = J* - J(pi_theta), with J* = beta log Z(x) (the maximum of J); it equals beta * kl, an
      identity the tests check;
    - ``reward`` = E_{pi_theta}[r]; ``kl_ref`` = KL(pi_theta || pi_ref), nats;
    - ``mode_coverage``: the share of (prompt, mode) pairs whose mode y_m has pi_theta(y_m) >= pi*(y_m) / 2;
    - ``total_mass`` = sum_y pi_theta(y), 1 when the enumeration is complete (a check, averaged).

    Each is averaged over prompts; ``kl_per_prompt`` lists the per-prompt KL.

    Args:
        logp, ref_logp: log pi_theta(y|x) and log pi_ref(y|x) [P, N] (nats; P prompts, N responses).
        reward: r(x, y) [P, N].
        beta: KL coefficient (> 0).
        modes: per prompt, the response indices of its modes.
    """
    logp, ref_logp, reward = logp.double(), ref_logp.double(), reward.double()
    log_w = ref_logp + reward / beta
    log_z = torch.logsumexp(log_w, dim=-1, keepdim=True)  # [P, 1]
    log_star = log_w - log_z
    mass = torch.logsumexp(logp, dim=-1)  # [P]
    logp = logp - mass[:, None]  # renormalise away float rounding (mass is reported)
    p = logp.exp()
    kl = (p * (logp - log_star)).sum(-1)
    kl_ref = (p * (logp - ref_logp)).sum(-1)
    exp_r = (p * reward).sum(-1)
    j_star = beta * log_z.squeeze(-1)
    gap = j_star - (exp_r - beta * kl_ref)
    covered = [bool(logp[i, j] >= log_star[i, j] - math.log(2)) for i, ms in enumerate(modes) for j in ms]
    return {
        "kl": kl.mean().item(),
        "tv": (0.5 * (p - log_star.exp()).abs().sum(-1)).mean().item(),
        "gap": gap.mean().item(),
        "reward": exp_r.mean().item(),
        "kl_ref": kl_ref.mean().item(),
        "mode_coverage": sum(covered) / max(1, len(covered)),
        "total_mass": mass.exp().mean().item(),
        "kl_per_prompt": kl.tolist(),
    }


def build_tiny_lm(o: KnownOptimumOptions):
    """A randomly initialised tiny Llama (seeded) and its word-level tokenizer (EOS = pad = id 0).

    Raises:
        ValueError: ``num_heads`` does not divide ``hidden_size``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if o.hidden_size % o.num_heads:
        raise ValueError(f"task.options.num_heads {o.num_heads} must divide task.options.hidden_size "
                         f"{o.hidden_size}")
    vocab = {EOS: 0, **{s: i + 1 for i, s in enumerate(o.symbols)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS, unk_token=EOS)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=o.hidden_size, intermediate_size=2 * o.hidden_size,
                         num_hidden_layers=o.num_layers, num_attention_heads=o.num_heads,
                         num_key_value_heads=o.num_heads,
                         max_position_embeddings=o.prompt_length + o.max_new_tokens + 8,
                         initializer_range=o.init_std, eos_token_id=0, pad_token_id=0, bos_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(o.model_seed)
    return LlamaForCausalLM(config).float(), tok


def _separated_modes(rng: random.Random, symbols: list[str], length: int, count: int,
                     distance: int) -> list[list[str]]:
    """``count`` random strings of ``length`` symbols, pairwise at Hamming distance >= ``distance``.

    Raises:
        ValueError: no such set was found in 10,000 draws.
    """
    for _ in range(10_000):
        modes: list[list[str]] = []
        for _ in range(100):
            cand = [rng.choice(symbols) for _ in range(length)]
            if all(sum(a != b for a, b in zip(cand, m)) >= distance for m in modes):
                modes.append(cand)
                if len(modes) == count:
                    return modes
    raise ValueError(f"task.options: cannot place {count} modes of length {length} at Hamming distance "
                     f">= {distance} over {len(symbols)} symbols; lower task.options.min_mode_distance")
