"""Generation with transformers ``generate`` (CPU or GPU), batched over prompts x samples."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor


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


class _TemperedLogprobs(LogitsProcessor):
    """Logits processor that applies the sampling temperature and records the behaviour log-probs.

    ``generate`` calls it once per new token, before sampling, so the token chosen at step t is only
    visible (as the last input id) at step t+1: the log-softmax of each step is kept until then. Only one
    step of [B, vocab] is held at a time, instead of the [B, R, vocab] that ``output_logits`` keeps.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev: torch.Tensor | None = None  # [B, V] log-probs of the step whose token is not yet known
        self.logps: list[torch.Tensor] = []  # R x [B]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature
        if self.prev is not None:
            self.logps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores, dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs [B, R] of the generated tokens ``new_tokens`` [B, R]."""
        if self.prev is not None and len(self.logps) < new_tokens.shape[1]:
            self.logps.append(self.prev.gather(-1, new_tokens[:, -1:].to(self.prev.device)).squeeze(-1))
        return torch.stack(self.logps, dim=1).cpu()


class HFEngine:
    """Samples responses with ``model.generate``; records behaviour log-probs from the step logits.

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
    ) -> list[list[Generation]]:
        """Sample ``num_samples`` responses for each prompt in one batched call.

        Args:
            prompts: token ids per prompt (no padding), length B.
            num_samples: responses per prompt; all K continue one prefill of their prompt (its KV cache is
                copied K times), so prompt tokens are computed once per prompt, not once per sample.
            max_new_tokens: length cap in tokens.
            temperature: softmax temperature; the returned log-probs use it too.
            greedy: argmax decoding (eval); log-probs are then of the temperature-scaled distribution.

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
        cache = None
        if num_samples > 1 and width > 1:
            # Shared prefill: run each prompt (all but its last token) once, then copy its KV cache to its K
            # samples. ``num_return_sequences`` would prefill every prompt K times, and on a 2-core CPU the
            # prefill of 32 x ~55 prompt tokens costs about as much as 15 decoding steps. Positions follow
            # the attention mask (left padding), as ``generate`` computes them.
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            pos = (attn[:, :-1].cumsum(-1) - 1).clamp(min=0)
            self.model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=pos,
                       use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
            cache.batch_repeat_interleave(num_samples)
            ids, attn = ids.repeat_interleave(num_samples, 0), attn.repeat_interleave(num_samples, 0)
        recorder = _TemperedLogprobs(temperature)
        # temperature=1.0 and no top-k/top-p: the recorder is the only processor, so the tokens are sampled
        # from exactly the distribution whose log-probs it records
        out = self.model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=1.0,
            top_p=None,
            top_k=None,
            num_return_sequences=1 if cache is not None else num_samples,
            pad_token_id=pad_id,
            logits_processor=[recorder],
            return_dict_in_generate=True,
            **({self._cache_kw: cache} if cache is not None else {}),
        )
        new = out.sequences[:, width:].cpu()  # [B*S, R]
        logp = recorder.finish(new)  # [B*S, R]
        results: list[list[Generation]] = [[] for _ in prompts]
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end = next((t + 1 for t, tok in enumerate(tokens) if tok in self.eos_ids), None)
            length = end if end is not None else len(tokens)
            results[row // num_samples].append(
                Generation(tokens[:length], logp[row, :length].tolist(), finished=end is not None)
            )
        return results


def _as_list(x):
    if x is None:
        return None
    return list(x) if isinstance(x, (list, tuple)) else [x]
