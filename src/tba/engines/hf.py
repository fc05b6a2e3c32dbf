"""Generation from a transformers causal LM (CPU or GPU), batched over prompts x samples."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tba.adapters import has_adapter, load_adapter
from tba.engines.base import Generation
from tba.scoring import cache_keyword, token_logprobs, unpadded
from tba.types import PackedWeights
from tba.weights import load_packed_weights

__all__ = ["Generation", "HFEngine", "sample_categorical"]


class HFEngine:
    """Samples responses from a transformers causal LM with its own decoding loop; records behaviour log-probs.

    Faster than ``model.generate`` for RL rollouts in four ways, all exact (tested); their measured
    speed-ups are in ``benchmarks/README.md`` (``benchmarks/throughput.py``):

    - shared prefill: each prompt is run once and its KV cache copied to its K samples, instead of
      prefilling every copy;
    - finished rows leave the batch: a response that emitted EOS is dropped from the KV cache, so the
      decoding steps after it cost only the responses still running (``generate`` keeps decoding every
      row until the longest is done);
    - continuous batching (``max_num_seqs``): when more samples wait than rows decode at once, the row of a
      response that ends is handed to the next waiting sample at the next step, its prompt's KV written
      into the row in place, so the batch stays full until the last samples drain;
    - inverse-CDF sampling (:func:`sample_categorical`) instead of ``torch.multinomial``, which on CPU draws
      one exponential per vocabulary entry.

    Args:
        model: a causal LM (eval mode), any dtype/device.
        tokenizer: its tokenizer (pad token set; left padding is applied here).
        max_num_seqs: default of :meth:`generate`'s ``max_num_seqs`` (responses decoded at once).

    Attributes:
        continuous_batching: whether a finished row may take a waiting sample of another width; False for
            models with sliding-window caches (detected here), which then decode one batch of prompts at a
            time. Setting it False forces that fallback.
    """

    def __init__(self, model, tokenizer, max_num_seqs: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.eos_ids = set(_as_list(model.generation_config.eos_token_id) or [tokenizer.eos_token_id])
        self._cache_kw = cache_keyword(model)
        # Rows of different widths can be joined only where every layer keeps its whole history; a sliding
        # window layer keeps a fixed-width tail, so such models decode one batch of prompts at a time.
        self.continuous_batching = all(type(layer) is DynamicLayer
                                       for layer in DynamicCache(config=model.config).layers)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], num_samples: int, max_new_tokens: int, temperature: float = 1.0,
                 *, greedy: bool = False, seed: int | None = None, min_new_tokens: int = 0,
                 max_num_seqs: int | None = None) -> list[list[Generation]]:
        """Sample ``num_samples`` responses for each prompt, at most ``max_num_seqs`` decoding at once.

        Tokens are drawn from softmax(logits / temperature) by :func:`sample_categorical` (no top-k/top-p):
        the recorded log-probs are those of the sampling distribution.

        Args:
            prompts: token ids per prompt (no padding), length B.
            num_samples: responses per prompt (K); all K continue one prefill of their prompt.
            max_new_tokens: length cap in tokens.
            temperature: softmax temperature; the returned log-probs use it too (1 = the model's own).
            greedy: argmax decoding (eval); log-probs are then of the temperature-scaled distribution.
            seed: seeds a generator for this call's draws (same seed, weights and batch: same responses);
                None = torch's global stream.
            min_new_tokens: EOS is not sampled before this many tokens (benchmarks force lengths with it).
            max_num_seqs: responses decoded at once (vLLM's name). The row of a response that ends goes to
                the next waiting sample at once (continuous batching), so the batch stays full while short
                responses end. None: the engine's ``max_num_seqs``, else all B x K at once.

        Returns:
            ``out[i][j]``: response j of prompt i.
        """
        k = num_samples
        n = len(prompts) * k
        if n == 0:
            return [[] for _ in prompts]
        max_num_seqs = min(max_num_seqs or self.max_num_seqs or n, n)
        if not self.continuous_batching and max_num_seqs < n:
            per = max(1, max_num_seqs // k)
            return [g for i in range(0, len(prompts), per)
                    for g in self.generate(prompts[i : i + per], k, max_new_tokens, temperature, greedy=greedy,
                                           seed=None if seed is None else seed + i, min_new_tokens=min_new_tokens,
                                           max_num_seqs=max_num_seqs)]
        gen = None if seed is None else torch.Generator(self.model.device).manual_seed(seed)
        out = _Outputs(n, max_new_tokens, self.tokenizer.pad_token_id)
        eos = torch.tensor(sorted(self.eos_ids), device=self.model.device)
        waiting = _Waiting(prompts, k, prefill_prompts=max(1, max_num_seqs // k))
        run = self._start(waiting, max_num_seqs)
        while run.n:
            logp = torch.log_softmax(run.logits.float() / temperature, dim=-1)  # [n_running, V]
            t = out.steps[run.rows]
            early = (t < min_new_tokens).to(logp.device)
            if early.any():
                logp[early.nonzero(), eos] = -math.inf
            tok = logp.argmax(-1) if greedy else sample_categorical(logp, gen)
            done = out.record(run.rows, t, tok, logp, eos)
            reuse, tok = self._retire(run, done, waiting.count(), tok)
            if run.n:
                # rows in ``reuse`` decode once more (cheaper than a copy of the cache to drop them first)
                run.step(self.model, self._cache_kw, tok)
            while len(reuse):
                if not waiting.left():
                    waiting.prefill(self._prefill(waiting.next_prompts()))
                idx, out_rows = waiting.take(len(reuse))
                run.replace(reuse[: len(idx)], waiting.prefilled, idx, out_rows)
                reuse = reuse[len(idx):]
        return out.results(len(prompts), k)

    @torch.no_grad()
    def score(self, prompts: list[list[int]], responses: list[list[int]],
              temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of ``responses`` under the engine's model (its adapter on), one forward pass
        (:func:`tba.scoring.token_logprobs`, the trainer's scoring, on the engine's copy in its dtype); see
        :class:`Engine`. Meant for a few responses at a time (the sync check's probes)."""
        if not prompts:
            return []
        return unpadded(*token_logprobs(self.model, prompts, responses, temperature, self.tokenizer.pad_token_id))

    def load_weights(self, packed: PackedWeights) -> None:
        """Copy published weights into the model in place (cast to its dtype): full weights, or a LoRA
        adapter into the model's adapter (:func:`tba.adapters.load_adapter`; the base stays); see :class:`Engine`.

        Raises:
            ValueError: the weights are of a different architecture or adapter, or an adapter for a model
                without one (nothing is loaded then).
        """
        if has_adapter(self.model):
            load_adapter(self.model, packed)
        else:
            load_packed_weights(self.model, packed)

    def close(self) -> None:
        """Nothing to stop: the engine holds no process or cache between calls."""

    @staticmethod
    def _retire(run: _Running, done: torch.Tensor, n_waiting: int,
                tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of responses that ended this step: the first ``n_waiting`` are returned for reuse by waiting
        samples; the rest leave the KV cache (one copy of it) rather than decode on to the longest. They come
        after every reused row, so reused rows keep their indices. Returns (reused rows, next tokens of the
        rows still running)."""
        if not done.any():
            return torch.zeros(0, dtype=torch.long), tok
        ended = done.nonzero().squeeze(-1)
        reuse = ended[:n_waiting]
        if len(reuse) < len(ended):
            keep = torch.ones_like(done)
            keep[ended[len(reuse):]] = False
            keep = keep.nonzero().squeeze(-1).to(tok.device)
            run.select(keep)
            tok = tok[keep]
        return reuse, tok

    def _start(self, waiting: _Waiting, m: int) -> _Running:
        """The first ``m`` rows: the first prompts prefilled, each prefill row copied to its samples."""
        waiting.prefill(self._prefill(waiting.next_prompts(-(-m // waiting.k))))
        p = waiting.prefilled
        idx, rows = waiting.take(m)
        idx = idx.to(p.attn.device)
        if waiting.left():  # some samples wait: keep the prefill, copy the rows out
            kv = [(layer.keys[idx], layer.values[idx]) for layer in p.cache.layers]
            return _Running(DynamicCache(kv), p.attn[idx], p.next_pos[idx], rows, p.logits[idx])
        p.select(idx)  # the whole prefill: its cache repeated in place
        p.rows, waiting.prefilled = rows, None
        return p

    def _prefill(self, prompts: list[tuple[int, list[int]]]) -> _Running:
        """One forward over the left-padded prompts (index, token ids): one row per prompt, with its KV
        cache and the logits of its first response token."""
        pad_id = self.tokenizer.pad_token_id
        width = max(len(p) for _, p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, (_, p) in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        device = self.model.device
        ids, attn = ids.to(device), attn.to(device)
        cache = DynamicCache(config=self.model.config)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                            logits_to_keep=1, **{self._cache_kw: cache}).logits[:, -1]  # [P, V]
        return _Running(cache, attn, attn.sum(-1), torch.tensor([i for i, _ in prompts]), logits)


@dataclass
class _Running:
    """Rows decoding together: KV cache, attention mask [n, W], next position [n], row id [n] (CPU; the
    output row, or for a prefill the prompt index) and the logits for their next token [n, V]."""

    cache: DynamicCache
    attn: torch.Tensor
    next_pos: torch.Tensor
    rows: torch.Tensor
    logits: torch.Tensor

    @property
    def n(self) -> int:
        return self.rows.numel()

    def select(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (indices on the model's device; a repeated index copies the row)."""
        self.cache.batch_select_indices(keep)
        self.attn, self.next_pos, self.logits = self.attn[keep], self.next_pos[keep], self.logits[keep]
        self.rows = self.rows[keep.cpu()]

    def step(self, model, cache_kw: str, tok: torch.Tensor) -> None:
        """Feed each row its sampled token [n]; the cache grows by one column."""
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.n, 1))], dim=1)
        self.logits = model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None],
                            use_cache=True, **{cache_kw: self.cache}).logits[:, -1]
        self.next_pos = self.next_pos + 1

    def replace(self, slots: torch.Tensor, src: _Running, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``slots`` (CPU) become copies of ``src`` rows ``idx`` with output rows ``rows``: their KV
        written in place, right-aligned (the columns left of it masked out). Leading columns that are
        padding in every row that stays are dropped first (a view; the next step's cache update copies
        anyway), so the width stays that of the longest live context."""
        live = self.attn.clone()
        live[slots.to(live.device)] = 0
        lead = int((live.sum(0) == 0).int().cumprod(0).sum())
        # a prompt longer than every live context: the others are left-padded (a copy)
        pad = max(0, src.attn.shape[1] - (self.attn.shape[1] - lead))
        self.attn = F.pad(self.attn[:, lead:], (pad, 0))
        width, w = self.attn.shape[1], src.attn.shape[1]
        dev_slots, dev_idx = slots.to(self.attn.device), idx.to(self.attn.device)
        for layer, s in zip(self.cache.layers, src.cache.layers, strict=True):
            for name in ("keys", "values"):
                x = getattr(layer, name)
                if lead or pad:
                    x = F.pad(x[:, :, lead:], (0, 0, pad, 0))
                x[dev_slots] = F.pad(getattr(s, name)[dev_idx], (0, 0, width - w, 0))
                setattr(layer, name, x)
        self.attn[dev_slots] = F.pad(src.attn[dev_idx], (width - w, 0))
        self.next_pos[dev_slots], self.logits[dev_slots] = src.next_pos[dev_idx], src.logits[dev_idx]
        self.rows[slots] = rows


class _Outputs:
    """The responses being written, one output row per sample: tokens and log-probs [n, max_new_tokens],
    length, finished flag and tokens sampled so far [n]."""

    def __init__(self, n: int, max_new_tokens: int, pad_id: int):
        self.max_new_tokens = max_new_tokens
        self.tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long)
        self.logps = torch.zeros((n, max_new_tokens))
        self.length = torch.full((n,), max_new_tokens, dtype=torch.long)
        self.finished = torch.zeros(n, dtype=torch.bool)
        self.steps = torch.zeros(n, dtype=torch.long)

    def record(self, rows: torch.Tensor, t: torch.Tensor, tok: torch.Tensor, logp: torch.Tensor,
               eos: torch.Tensor) -> torch.Tensor:
        """Write token ``tok`` [r] and its log-prob from ``logp`` [r, V] at position ``t`` of ``rows``;
        returns which of them ended (EOS or the length cap) [r] bool."""
        self.tokens[rows, t] = tok.cpu()
        self.logps[rows, t] = logp.gather(-1, tok[:, None]).squeeze(-1).cpu()
        self.steps[rows] = t + 1
        hit_eos = torch.isin(tok, eos).cpu()
        done = hit_eos | (t + 1 == self.max_new_tokens)
        self.length[rows[done]], self.finished[rows[done]] = t[done] + 1, hit_eos[done]
        return done

    def results(self, num_prompts: int, k: int) -> list[list[Generation]]:
        """``out[i][j]``: response j of prompt i (output row i * k + j)."""
        results: list[list[Generation]] = [[] for _ in range(num_prompts)]
        for row in range(len(self.length)):
            m = int(self.length[row])
            results[row // k].append(Generation(self.tokens[row, :m].tolist(), self.logps[row, :m].tolist(),
                                                finished=bool(self.finished[row])))
        return results


class _Waiting:
    """Samples not started yet, in order: prompts not prefilled, then the remaining samples of the prompts
    prefilled last (a prompt is prefilled once, however many steps its K samples take to join)."""

    def __init__(self, prompts: list[list[int]], k: int, prefill_prompts: int):
        self.prompts, self.k, self.prefill_prompts = prompts, k, prefill_prompts
        self.next_prompt = 0  # first prompt not prefilled
        self.prefilled: _Running | None = None  # one row per prompt; rows = prompt index
        self.started: list[int] = []  # samples started, per prefilled prompt

    def left(self) -> int:
        """Samples of the prefilled prompts not started."""
        return self.k * len(self.started) - sum(self.started)

    def count(self) -> int:
        """All samples not started."""
        return self.left() + self.k * (len(self.prompts) - self.next_prompt)

    def next_prompts(self, count: int | None = None) -> list[tuple[int, list[int]]]:
        """(index, token ids) of the next ``count`` prompts (default: ``prefill_prompts``; fewer at the end)."""
        end = min(self.next_prompt + (count or self.prefill_prompts), len(self.prompts))
        out = [(i, self.prompts[i]) for i in range(self.next_prompt, end)]
        self.next_prompt = end
        return out

    def prefill(self, prefilled: _Running) -> None:
        self.prefilled, self.started = prefilled, [0] * prefilled.n

    def take(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``m`` samples of the prefilled prompts: (prefill row [c], output row = prompt x K + sample [c])."""
        idx, rows = [], []
        for r, s in enumerate(self.started):
            c = min(self.k - s, m - len(idx))
            idx += [r] * c
            rows += [int(self.prefilled.rows[r]) * self.k + s + j for j in range(c)]
            self.started[r] += c
        return torch.tensor(idx, dtype=torch.long), torch.tensor(rows, dtype=torch.long)


def sample_categorical(logp: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row from the categorical distribution with log-probs ``logp`` [n, V] -> [n] (long).

    Inverse-CDF sampling: a uniform u in (0, total] per row, then the first index whose cumulative
    probability reaches u (``torch.searchsorted``). A token of probability 0 is never chosen (its interval
    is empty). It needs n random numbers where ``torch.multinomial`` on CPU draws one exponential per
    vocabulary entry (its share of a decoding step is in ``benchmarks/README.md``). The float32 cumulative
    sum moves the probability of each token by at most ~1e-7 x sqrt(V) in absolute terms.
    """
    cdf = logp.float().exp().cumsum(-1)  # [n, V]
    u = 1.0 - torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device)  # (0, 1]
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def _as_list(x):
    if x is None:
        return None
    return list(x) if isinstance(x, (list, tuple)) else [x]
