"""Score responses: per-token log-probs of each response under a causal LM, one pass per distinct prompt.

Used by the trainer (log pi_theta), the searcher (log pi_ref) and tasks that score with a model; loading the
model is :mod:`tba.models`. Only torch here; transformers' ``DynamicCache`` is imported where it is used.
"""

from __future__ import annotations

import inspect

import torch


def pad_prompt_response(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out ``[left-padded prompt | right-padded response]`` so every response starts at one column.

    Returns:
        input_ids [N, P+R], attention_mask [N, P+R], response_mask [N, R] (1.0 on real response tokens),
        where P and R are the longest prompt and response.
    """
    p_len = max(len(p) for p in prompts)
    r_len = max(1, max(len(r) for r in responses))
    n = len(prompts)
    ids = torch.full((n, p_len + r_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + r_len), dtype=torch.long)
    resp_mask = torch.zeros((n, r_len))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p)
        ids[i, p_len : p_len + len(r)] = torch.tensor(r, dtype=torch.long)
        attn[i, p_len - len(p) : p_len + len(r)] = 1
        resp_mask[i, : len(r)] = 1.0
    return ids, attn, resp_mask


def token_logprobs(
    model, prompts: list[list[int]], responses: list[list[int]], temperature: float, pad_id: int,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log pi(y_t | x, y_<t) of each response, logits divided by ``temperature`` first.

    Dividing by the sampling temperature matches the reference code (docs/algorithm.md section 1), so the
    scored distribution is the one responses were sampled from. Only the response positions go through
    the LM head, which keeps the [N, R, vocab] logits small. Gradients flow if enabled by the caller.

    When prompts repeat (the K responses of a group share one), each distinct prompt is run once and its
    KV cache indexed out to its responses (:func:`_shared_prompt_logits`); gradients flow back through the
    cache into the one prompt pass. Same values as scoring every row in full (float32: within 1e-5), at
    a fraction of the cost when prompts are longer than responses (measured in ``benchmarks/README.md``).
    Activation checkpointing disables the KV cache in training, so a checkpointed model takes the plain path,
    as does ``share_prompts=False``.

    Forward calls of ``model``: 2 on the shared path with responses longer than one token, else 1
    (:func:`forward_calls`; sharded ranks must all make the same number).

    Returns:
        logp [N, R] (0 on padding), response_mask [N, R].
    """
    r_len = max(1, max(len(r) for r in responses))
    resp_mask = torch.zeros((len(responses), r_len))
    for i, r in enumerate(responses):
        resp_mask[i, : len(r)] = 1.0
    distinct = dict.fromkeys(map(tuple, prompts))
    if share_prompts and len(distinct) < len(prompts) and not _checkpointing(model):
        logits, targets = _shared_prompt_logits(model, prompts, responses, pad_id, list(distinct), r_len)
    else:
        ids, attn, _ = pad_prompt_response(prompts, responses, pad_id)
        ids, attn = ids.to(model.device), attn.to(model.device)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
        # logits at column c predict token c+1: the R response tokens are predicted by the R columns before
        out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=r_len + 1)
        logits, targets = out.logits[:, :-1, :], ids[:, -r_len:]  # [N, R, V], [N, R]
    logits = logits.float() / temperature
    # gather - logsumexp instead of log_softmax: no second [N, R, V] tensor is kept for backward
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # [N, R]
    mask = resp_mask.to(logp.device)
    return logp * mask, mask


def forward_calls(model, prompts: list[list[int]], responses: list[list[int]]) -> int:
    """How many forward calls :func:`token_logprobs` makes for these rows with ``share_prompts`` on: 2 when it
    shares prompts (some repeat, no activation checkpointing) and a response is longer than one token, else 1."""
    shared = len(set(map(tuple, prompts))) < len(prompts) and not _checkpointing(model)
    return 2 if shared and max(len(r) for r in responses) > 1 else 1


def _shared_prompt_logits(model, prompts, responses, pad_id: int, distinct: list[tuple], r_len: int):
    """Logits [N, R, V] predicting each response token, and the targets [N, R], from one pass per distinct
    prompt (U of them) plus one pass over the responses that attends to the prompts' KV cache.

    Layout: prompts left-padded [U, P]; responses right-padded [N, R]. The logit of the last prompt column
    predicts response token 0; response column j predicts token j + 1, so the last token is not fed.
    """
    from transformers import DynamicCache

    device = model.device
    p_len = max(len(p) for p in distinct)
    p_ids = torch.full((len(distinct), p_len), pad_id, dtype=torch.long)
    p_attn = torch.zeros_like(p_ids)
    for i, p in enumerate(distinct):
        p_ids[i, p_len - len(p) :] = torch.tensor(p)
        p_attn[i, p_len - len(p) :] = 1
    r_ids = torch.full((len(responses), r_len), pad_id, dtype=torch.long)
    for i, r in enumerate(responses):
        r_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    index = {p: i for i, p in enumerate(distinct)}
    rows = torch.tensor([index[tuple(p)] for p in prompts], device=device)  # [N] -> distinct prompt
    p_ids, p_attn, r_ids = p_ids.to(device), p_attn.to(device), r_ids.to(device)
    cache_kw = cache_keyword(model)
    cache = DynamicCache(config=model.config)
    first = model(input_ids=p_ids, attention_mask=p_attn, position_ids=(p_attn.cumsum(-1) - 1).clamp(min=0),
                  use_cache=True, logits_to_keep=1, **{cache_kw: cache}).logits[rows]  # [N, 1, V]
    if r_len == 1:
        return first, r_ids
    cache.batch_select_indices(rows)  # indexing, not a copy in place: gradients reach the prompt pass
    # padding after a response's end is attended to only by later padding, whose logits are masked out
    attn = torch.cat([p_attn[rows], torch.ones_like(r_ids)], dim=1)  # [N, P + R]
    pos = p_attn.sum(-1)[rows, None] + torch.arange(r_len - 1, device=device)  # [N, R - 1]
    rest = model(input_ids=r_ids[:, :-1], attention_mask=attn[:, :-1], position_ids=pos, use_cache=True,
                 **{cache_kw: cache}).logits  # [N, R - 1, V]
    return torch.cat([first, rest], dim=1), r_ids


def unpadded(logp: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """:func:`token_logprobs` output [N, T] as one list of per-token log-probs per response (padding cut)."""
    return [row[: int(m.sum())].tolist() for row, m in zip(logp.float().cpu(), mask)]


def cache_keyword(model) -> str:
    """The forward's KV-cache argument: ``cache`` (transformers 5's name; the old one warns, later fails) or
    ``past_key_values``; a peft model's forward takes ``**kwargs`` and passes them on, so its base is asked."""
    return "cache" if "cache" in inspect.signature(_base(model).forward).parameters else "past_key_values"


def _base(model):
    """The transformers model under a peft adapter (whose ``forward`` takes ``**kwargs`` and passes them
    on), else ``model``; duck-typed, as this module does not import peft."""
    return model.get_base_model() if hasattr(type(model), "get_base_model") else model


def _checkpointing(model) -> bool:
    """Whether activation checkpointing is on (transformers 5 name, old name on 4.x)."""
    model = _base(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
