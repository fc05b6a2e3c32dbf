"""Weight publication: pack a policy's weights into one flat buffer and load them into another copy.

The trainer packs after every sync period (``trainer.sync_period`` steps); each searcher loads the newest
pack before its next batch. Packing casts to the searchers' dtype (bf16 halves the bytes) and stores tied
parameters once; the single numpy buffer is one object-store copy that Ray's readers map without copying.
"""

from __future__ import annotations

import math
import warnings

import torch

from tba.types import PackedWeights

_ALIGN = 64  # bytes; every tensor starts aligned so a byte slice can be viewed as any dtype


def unique_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model.state_dict()`` entries with tied tensors (same storage, shape and dtype) kept once, first name wins."""
    seen, out = set(), []
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out


def pack_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> PackedWeights:
    """Copy ``model``'s weights (any device) into one CPU byte buffer, floating tensors cast to ``dtype``.

    Args:
        model: the policy (e.g. float32 master weights of the trainer).
        dtype: the searchers' dtype; None keeps each tensor's own. Integer buffers keep theirs.

    Returns:
        :class:`PackedWeights`, ~2 bytes per parameter for bf16, tied parameters once.
    """
    return pack_tensors(unique_tensors(model), dtype)


def pack_tensors(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                 adapter: dict | None = None) -> PackedWeights:
    """Copy named tensors (any device) into one CPU byte buffer, floating ones cast to ``dtype``
    (:func:`pack_weights` for a whole model; a LoRA adapter's tensors with its ``adapter`` config)."""
    entries, nbytes = [], 0
    for name, t in tensors:
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        entries.append((name, str(out_dtype).removeprefix("torch."), tuple(t.shape), nbytes))
        nbytes += -(-t.numel() * out_dtype.itemsize // _ALIGN) * _ALIGN
    flat = torch.empty(nbytes, dtype=torch.uint8)
    with torch.no_grad():
        for (_, dt, shape, off), (_, t) in zip(entries, tensors):
            _view(flat, dt, shape, off).copy_(t)  # casts and moves to CPU in one pass
    return PackedWeights(entries=entries, data=flat.numpy(), adapter=adapter)


def load_packed_weights(model: torch.nn.Module, packed: PackedWeights) -> None:
    """Copy :func:`pack_weights` output into ``model`` in place (cast to the model's dtypes).

    Raises:
        ValueError: the pack's tensor names or shapes differ from ``model``'s (a different architecture), or
            it holds a LoRA adapter (:func:`tba.adapters.load_adapter` loads those); nothing is loaded then.
    """
    if packed.adapter is not None:
        raise ValueError("published weights are a LoRA adapter, but this model has none (model.lora.r must be "
                         "the same for searchers and trainer)")
    target = dict(unique_tensors(model))
    names = {name for name, *_ in packed.entries}
    if names != set(target) or any(tuple(target[n].shape) != tuple(s) for n, _, s, _ in packed.entries):
        missing, unexpected = sorted(set(target) - names), sorted(names - set(target))
        raise ValueError(f"published weights do not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]} (or shapes differ)")
    with torch.no_grad():
        for name, t in unpack_weights(packed).items():
            target[name].copy_(t)


def unpack_weights(packed: PackedWeights) -> dict[str, torch.Tensor]:
    """The tensors of a :func:`pack_weights` pack by name, as views into its buffer (no copy; read only).

    Raises:
        ValueError: an entry runs past the end of the buffer (a truncated or corrupt pack).
    """
    with warnings.catch_warnings():
        # the object store hands out read-only memory; callers only read it
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.from_numpy(packed.data)
    out = {}
    for name, dt, shape, off in packed.entries:
        end = off + math.prod(shape) * getattr(torch, dt).itemsize
        if end > flat.numel():
            raise ValueError(f"published weights: '{name}' ends at byte {end}, past the buffer ({flat.numel()} bytes)")
        out[name] = _view(flat, dt, shape, off)
    return out


def _view(flat: torch.Tensor, dtype: str, shape: tuple, offset: int) -> torch.Tensor:
    """The tensor stored at ``offset`` of the byte buffer ``flat`` (a view, no copy)."""
    dt = getattr(torch, dtype)
    return flat[offset : offset + math.prod(shape) * dt.itemsize].view(dt).view(shape)
