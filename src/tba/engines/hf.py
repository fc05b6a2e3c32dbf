"""Generation from a transformers causal LM (CPU or GPU), batched over prompts x samples."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Generation:
    """One generated response.

    Attributes:
        response_ids: sampled token ids without padding; includes the EOS token when ``finished``.
        logprobs: per-token log-probs under the generating policy at the sampling temperature [R].
        finished: ended with EOS (False: cut at max new tokens).
    """

    response_ids: list[int]
    logprobs: list[float]
    finished: bool


class HFEngine:
    """Samples responses from a transformers causal LM with its own decoding loop; records behaviour log-probs.

    Faster than ``model.generate`` for RL rollouts in three ways (issue 4), all exact (tested):

    - shared prefill: each prompt is run once and its KV cache copied to its K samples, instead of
      prefilling every copy (on a 2-core CPU the prefill of 32 x ~55 prompt tokens costs about as much as
      15 decoding steps);
    - finished rows leave the batch: a response that emitted EOS is dropped from the KV cache, so the
      decoding steps after it cost only the responses still running (``generate`` keeps decoding every
      row until the longest is done). Quickstart responses average ~15 of up to 32 tokens;
    - inverse-CDF sampling (:func:`sample_categorical`) instead of ``torch.multinomial``, which on CPU draws
      one exponential per vocabulary entry (24% of a decoding step at batch 32).

    2.4x / 2.9x the tokens/s of ``generate`` at batch 32 / 64 on the quickstart workload (2-core CPU,
    ``benchmarks/throughput.py``).

    Args:
        model: a causal LM (eval mode), any dtype/device.
        tokenizer: its tokenizer (pad token set; left padding is applied here).
    """

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = set(_as_list(model.generation_config.eos_token_id) or [tokenizer.eos_token_id])
        # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns, later fails)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 0.7,
        greedy: bool = False,
        min_new_tokens: int = 0,
    ) -> list[list[Generation]]:
        """Sample ``num_samples`` responses for each prompt in one batched call.

        Tokens are drawn from softmax(logits / temperature) by :func:`sample_categorical` (no top-k/top-p),
        so the recorded log-probs are those of the sampling distribution.

        Args:
            prompts: token ids per prompt (no padding), length B.
            num_samples: responses per prompt (K); all K continue one prefill of their prompt.
            max_new_tokens: length cap in tokens.
            temperature: softmax temperature; the returned log-probs use it too.
            greedy: argmax decoding (eval); log-probs are then of the temperature-scaled distribution.
            min_new_tokens: EOS is not sampled before this many tokens (benchmarks force lengths with it).

        Returns:
            ``out[i][j]``: response j of prompt i.
        """
        pad_id = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        device = self.model.device
        ids, attn = ids.to(device), attn.to(device)
        cache = DynamicCache(config=self.model.config)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                            logits_to_keep=1, **{self._cache_kw: cache}).logits[:, -1]  # [B, V]
        if num_samples > 1:
            cache.batch_repeat_interleave(num_samples)
            logits, attn = logits.repeat_interleave(num_samples, 0), attn.repeat_interleave(num_samples, 0)
        n = logits.shape[0]
        tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long)
        logps = torch.zeros((n, max_new_tokens))
        length = torch.full((n,), max_new_tokens, dtype=torch.long)
        finished = torch.zeros(n, dtype=torch.bool)
        eos = torch.tensor(sorted(self.eos_ids), device=device)
        rows = torch.arange(n)  # batch row -> output row, for the rows still decoding
        next_pos = attn.sum(-1)  # [n] position of the token about to be fed
        for t in range(max_new_tokens):
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [n_alive, V]
            if t < min_new_tokens:
                logp[:, eos] = -math.inf
            tok = logp.argmax(-1) if greedy else sample_categorical(logp)
            tokens[rows, t] = tok.cpu()
            logps[rows, t] = logp.gather(-1, tok[:, None]).squeeze(-1).cpu()
            done = torch.isin(tok, eos)
            if done.any():
                ended = rows[done.cpu()]
                length[ended], finished[ended] = t + 1, True
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                # drop finished rows from the KV cache (one copy of it) rather than decode them to the end
                cache.batch_select_indices(keep)
                tok, attn, next_pos, rows = tok[keep], attn[keep], next_pos[keep], rows[keep.cpu()]
            if t == max_new_tokens - 1:
                break
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            logits = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                                use_cache=True, **{self._cache_kw: cache}).logits[:, -1]
            next_pos = next_pos + 1
        results: list[list[Generation]] = [[] for _ in prompts]
        for row in range(n):
            m = int(length[row])
            results[row // num_samples].append(
                Generation(tokens[row, :m].tolist(), logps[row, :m].tolist(), finished=bool(finished[row])))
        return results


def sample_categorical(logp: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row from the categorical distribution with log-probs ``logp`` [n, V] -> [n] (long).

    Inverse-CDF sampling: a uniform u in (0, total] per row, then the first index whose cumulative
    probability reaches u (``torch.searchsorted``). A token of probability 0 is never chosen (its interval
    is empty). It needs n random numbers where ``torch.multinomial`` on CPU draws one exponential per
    vocabulary entry: at batch 32 and a 49k vocabulary that was 23 ms of a ~95 ms decoding step. The
    float32 cumulative sum moves the probability of each token by at most ~1e-7 x sqrt(V) in absolute terms.
    """
    cdf = logp.float().exp().cumsum(-1)  # [n, V]
    u = 1.0 - torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device)  # (0, 1]
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def _as_list(x):
    if x is None:
        return None
    return list(x) if isinstance(x, (list, tuple)) else [x]
