"""Data-parallel and sharded training: the torch.distributed pieces the trainer's ranks share.

Plain functions over the default process group (no Ray; :mod:`tba.runtime.trainer_group` starts the ranks):
the loopback rendezvous, the split of a batch into whole prompt groups per rank, gathering per-row tensors,
summing gradients, FSDP2 sharding and gathering a full state dict. Every collective runs under the group's
timeout (``trainer.collective_timeout_s``), so a rank that dies or hangs makes the others fail, not wait.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from tba.types import Batch

#: elements per flattened all-reduce of gradients (float32: 100 MB); bounds the extra memory of summing
BUCKET_ELEMENTS = 25_000_000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it), for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, device: str, timeout_s: float) -> str:
    """Join the trainer ranks' process group: rendezvous at ``tcp://127.0.0.1:port`` (one node, loopback only),
    NCCL on 'cuda' (this process's current GPU), gloo on 'cpu'.

    Args:
        rank, world: this rank and N.
        port: the rendezvous port (rank 0 listens; :func:`free_port`).
        device: 'cuda' or 'cpu'.
        timeout_s: every collective (and the rendezvous) fails after this many seconds instead of waiting
            forever for a rank that died or hangs.

    Returns:
        the backend name, 'nccl' or 'gloo'.

    Raises:
        torch.distributed.DistBackendError (or RuntimeError): the other ranks did not join within ``timeout_s``.
    """
    backend = "nccl" if device == "cuda" else "gloo"
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(torch.cuda.current_device())
        kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return backend


def active() -> bool:
    """Whether this process is a rank of a process group (the trainer then runs its collectives)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, N) of this process; (0, 1) outside a process group."""
    return (dist.get_rank(), dist.get_world_size()) if active() else (0, 1)


def close_group() -> None:
    """Leave the process group (no-op outside one)."""
    if active():
        dist.destroy_process_group()


def shard_groups(batch: Batch, rank: int, world: int) -> Batch:
    """Rank ``rank``'s part of a B x K batch: prompt groups ``rank * B/N`` to ``(rank + 1) * B/N - 1``, whole.

    Raises:
        ValueError: B is not a multiple of N (the config refuses this before a run starts).
    """
    groups, k = batch.num_prompts, batch.group_size
    if groups % world:
        raise ValueError(f"a batch of {groups} prompt groups does not split into {world} equal parts of whole groups")
    per = groups // world
    return Batch(batch.samples[rank * per * k:(rank + 1) * per * k], k, batch.metrics)


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` ([n, T], the same shape on every rank) in rank order: [N * n, T].

    This rank's rows are ``x`` itself, so gradients flow into them; the other ranks' rows are constants.
    """
    rank, world = rank_and_world()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.detach().contiguous())
    parts[rank] = x
    return torch.cat(parts)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """All-reduce (sum) the gradients of ``params`` over the ranks, in flattened buckets of at most
    :data:`BUCKET_ELEMENTS` (one collective per bucket, not per tensor). A parameter without a gradient
    counts as zeros, so every rank reduces the same tensors."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    start = 0
    while start < len(grads):
        end, size = start, 0
        while end < len(grads) and (end == start or size + grads[end].numel() <= BUCKET_ELEMENTS):
            size += grads[end].numel()
            end += 1
        flat = torch.cat([g.reshape(-1) for g in grads[start:end]])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads[start:end]:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        start = end


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank (replicas then start bit-identical)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


def agree_all(flags: list[bool]) -> list[bool]:
    """Element-wise AND of ``flags`` (the same length on every rank) over the ranks."""
    if not flags:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def fully_shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 (``torch.distributed.fsdp.fully_shard``) over the default group:
    each transformer block (the classes in transformers' ``_no_split_modules``) is one unit, the rest
    (embeddings, tied LM head, final norm) the root's. Gradients are reduce-scattered as sums (divide factor
    1): the trainer's backward already carries the whole batch's normalisation. Returns ``model``.

    Raises:
        ValueError: the model names no block class to shard by.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    base = model.get_base_model() if hasattr(type(model), "get_base_model") else model  # a peft model's
    blocks = set(getattr(base, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in blocks]
    if not units:
        raise ValueError(f"trainer.fsdp: {type(base).__name__} names no transformer block class "
                         "(_no_split_modules) to shard by")
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded by :func:`fully_shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict of an FSDP2 model, on CPU, on rank 0 (every rank must call it: it gathers);
    an empty dict on the other ranks. ``trainable_only``: leave out frozen parameters (a LoRA base)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=opts)


def total_norm(norm) -> float:
    """``clip_grad_norm_``'s result as a float (a DTensor under FSDP2 is reduced to its full value)."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
