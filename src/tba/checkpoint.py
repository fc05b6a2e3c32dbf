"""Checkpoints: tensors in safetensors, everything else in JSON (no pickle).

Layout of ``RUN_DIR/checkpoint/``: ``policy.safetensors`` (float32 master weights), ``optimizer.safetensors``
+ ``optimizer.json``, ``trainer.json`` (step, scheduler, RNG), ``buffer.json``, ``searchers.json`` and
``driver.json``; a sharded trainer's (``trainer.fsdp``) weights and AdamW state are a
torch.distributed.checkpoint folder ``dcp/`` instead (:func:`save_trainer_sharded`). A checkpoint is written to
``checkpoint.tmp`` and renamed into place, so a crash while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

CHECKPOINT = "checkpoint"


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON (floats kept exactly)."""
    Path(path).write_text(json.dumps(data))


def read_json(path: Path):
    """Read a JSON file written by :func:`write_json`."""
    return json.loads(Path(path).read_text())


def save_trainer(directory: Path, model, optimizer, scheduler, extra: dict) -> None:
    """Policy weights, AdamW moments, scheduler and torch RNG of the trainer, plus ``extra`` (JSON-safe).

    Shared (tied) weights are stored once (``safetensors.torch.save_model``). A model with frozen
    parameters (a LoRA adapter's base) stores only those that train: the base is the run's model files.
    """
    directory = Path(directory)
    if _frozen(model):
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad},
                  str(directory / "policy.safetensors"))
    else:
        save_model(model, str(directory / "policy.safetensors"))
    opt = optimizer.state_dict()
    tensors = {f"{idx}.{name}": t.contiguous() for idx, st in opt["state"].items() for name, t in st.items()
               if isinstance(t, torch.Tensor)}
    tensors["__rng__"] = torch.get_rng_state()
    save_file(tensors, str(directory / "optimizer.safetensors"))
    write_json(directory / "optimizer.json", {"param_groups": opt["param_groups"]})
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    write_json(directory / "trainer.json", {"scheduler": sched, **extra})


def load_trainer(directory: Path, model, optimizer, scheduler) -> dict:
    """Restore :func:`save_trainer`; returns its ``extra`` dict.

    Raises:
        FileNotFoundError: the checkpoint is incomplete.
    """
    directory = Path(directory)
    if read_json(directory / "trainer.json").get("format") == SHARDED:
        raise CheckpointError(f"checkpoint {directory} was written with trainer.fsdp (sharded); resume it with "
                              "trainer.fsdp true")
    if _frozen(model):
        trained = load_file(str(directory / "policy.safetensors"))
        expected = {n for n, p in model.named_parameters() if p.requires_grad}
        if set(trained) != expected:
            raise CheckpointError(f"checkpoint {directory} holds other trained tensors than this model (e.g. "
                                  f"{sorted(set(trained) ^ expected)[:2]}): was model.lora changed since?")
        model.load_state_dict(trained, strict=False)
    else:
        load_model(model, str(directory / "policy.safetensors"))
    tensors = load_file(str(directory / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("__rng__"))
    state: dict = {}
    for key, t in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = t
    optimizer.load_state_dict({"state": state, **read_json(directory / "optimizer.json")})
    extra = read_json(directory / "trainer.json")
    scheduler.load_state_dict({**extra.pop("scheduler"), "lr_lambdas": [None] * len(optimizer.param_groups)})
    return extra


#: the ``format`` of ``trainer.json`` in a checkpoint of an FSDP2 trainer (``trainer.fsdp``): the sharded
#: weights and AdamW state in ``dcp/`` (torch.distributed.checkpoint), the RNG in ``rng.safetensors``
SHARDED = "dcp"


def save_trainer_sharded(directory: Path, model, optimizer, scheduler, extra: dict) -> None:
    """The sharded trainer's part of a checkpoint, written by every rank together (a collective): each rank's
    shards of the weights and AdamW moments into ``directory/dcp`` (torch.distributed.checkpoint), plus, from
    rank 0, the scheduler, ``extra`` and its torch RNG. A LoRA model stores its adapter only."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    directory = Path(directory)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=_frozen(model)))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory / SHARDED))
    if dist.get_rank() == 0:
        save_file({"__rng__": torch.get_rng_state()}, str(directory / "rng.safetensors"))
        sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        write_json(directory / "trainer.json", {"scheduler": sched, "format": SHARDED,
                                                "ranks": dist.get_world_size(), **extra})
    dist.barrier()


def load_trainer_sharded(directory: Path, model, optimizer, scheduler) -> dict:
    """Restore :func:`save_trainer_sharded` on every rank together (DCP reads the shards this rank needs, so the
    number of ranks may differ from the writer's); returns ``extra``.

    Raises:
        CheckpointError: the checkpoint was written by an unsharded trainer.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    directory = Path(directory)
    extra = read_json(directory / "trainer.json")
    if extra.pop("format", None) != SHARDED:
        raise CheckpointError(f"checkpoint {directory} was written without trainer.fsdp; resume it with "
                              "trainer.fsdp false")
    extra.pop("ranks", None)
    opts = StateDictOptions(ignore_frozen_params=_frozen(model))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory / SHARDED))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=_frozen(model), strict=not _frozen(model)))
    torch.set_rng_state(load_file(str(directory / "rng.safetensors"))["__rng__"])
    scheduler.load_state_dict({**extra.pop("scheduler"), "lr_lambdas": [None] * len(optimizer.param_groups)})
    return extra


def _frozen(model) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def begin(run_dir: Path) -> Path:
    """A fresh temporary folder to write the next checkpoint into."""
    tmp = Path(run_dir) / f"{CHECKPOINT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(run_dir: Path) -> Path:
    """Atomically replace ``RUN_DIR/checkpoint`` with the folder from :func:`begin`.

    At every moment one complete checkpoint exists: ``checkpoint``, or ``checkpoint.old`` between the two
    renames (a crash there leaves it for :func:`find`).
    """
    run_dir = Path(run_dir)
    tmp, final, old = run_dir / f"{CHECKPOINT}.tmp", run_dir / CHECKPOINT, run_dir / f"{CHECKPOINT}.old"
    if final.exists():  # else ``old`` may be the only complete checkpoint (a crash mid-swap): keep it until now
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message says what is wrong and what the user can do."""


def find(run_dir: Path) -> Path | None:
    """The checkpoint folder of a run directory (``checkpoint.old`` after a crash mid-swap), or None if the
    run never saved one (it was stopped before its first checkpoint)."""
    for name in (CHECKPOINT, f"{CHECKPOINT}.old"):
        path = Path(run_dir) / name
        if (path / "driver.json").is_file():
            return path
    return None


def resumable_step(path: Path) -> int:
    """The trainer step a checkpoint resumes at, once its parts are checked to agree.

    Raises:
        CheckpointError: a file is missing or unreadable, or the trainer's and the driver's step differ
            (a checkpoint written by tba 0.1 while a trainer step was in flight, or edited by hand).
    """
    names = ("trainer.json", "driver.json", "buffer.json", "searchers.json", "policy.safetensors",
             "optimizer.safetensors", "optimizer.json")
    try:
        if read_json(Path(path) / "trainer.json").get("format") == SHARDED:
            names = ("trainer.json", "driver.json", "buffer.json", "searchers.json", "rng.safetensors",
                     f"{SHARDED}/.metadata")
    except (OSError, ValueError):
        pass  # reported below
    missing = [n for n in names if not (Path(path) / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (missing {', '.join(missing)}); it cannot be "
                              "resumed: start a new run from its config.yaml")
    try:
        trainer, driver = read_json(Path(path) / "trainer.json")["step"], read_json(Path(path) / "driver.json")["step"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); start a new run from "
                              "its config.yaml") from None
    if trainer != driver:
        raise CheckpointError(
            f"checkpoint {path} is inconsistent: the trainer saved step {trainer}, the run state step {driver} "
            "(tba 0.1 could save this on Ctrl-C while a step was in flight); it cannot be resumed exactly: start "
            "a new run from its config.yaml")
    return trainer
