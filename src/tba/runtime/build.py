"""Builders: load the models a searcher or the trainer needs and hand each component its config section.

Runs inside each Ray actor (and in-process in tests), so nothing here knows about processes. Components
take their config section directly, so every default is declared once, in :mod:`tba.config`.
"""

from __future__ import annotations

import os

import torch

from tba.config import Config
from tba.engines.hf import HFEngine
from tba.models import enable_activation_checkpointing, load_causal_lm, load_tokenizer, pick_dtype
from tba.searcher import Searcher
from tba.tasks import build_task
from tba.trainer import Trainer


def quiet_libraries() -> None:
    """Silence transformers' per-call warnings in worker processes (they drown the progress bar)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def shard(n_problems: int, num_searchers: int, searcher_id: int) -> list[int]:
    """Disjoint prompt shard of one searcher: every num_searchers-th problem id."""
    return list(range(searcher_id, n_problems, num_searchers))


def build_searcher(cfg: Config, policy_path: str, ref_path: str, searcher_id: int) -> Searcher:
    """A searcher with its own policy copy and reference model, both in the generation dtype."""
    torch.set_num_threads(cfg.searcher.threads)
    torch.manual_seed(cfg.run.seed + 1000 * (searcher_id + 1))  # distinct sampling streams per searcher
    dtype = pick_dtype(cfg.model.dtype)
    tok = load_tokenizer(policy_path)
    policy = load_causal_lm(policy_path, dtype, cfg.model.num_hidden_layers)
    ref = load_causal_lm(ref_path, dtype, cfg.model.num_hidden_layers)
    task = build_task(cfg)
    problem_ids = shard(len(task.train), cfg.searcher.num_searchers, searcher_id)
    return Searcher(HFEngine(policy, tok), ref, task, tok, problem_ids, searcher_id, cfg.searcher,
                    score_micro_batch=cfg.trainer.micro_batch_size, seed=cfg.run.seed)


def build_trainer(cfg: Config, policy_path: str) -> tuple[Trainer, object]:
    """The trainer (float32 master weights, bf16 autocast where supported) and its tokenizer."""
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.run.seed)
    tok = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path, torch.float32, cfg.model.num_hidden_layers)
    compute = pick_dtype(cfg.model.dtype)
    if cfg.trainer.gradient_checkpointing:
        enable_activation_checkpointing(model)
    trainer = Trainer(model, tok.pad_token_id, cfg.trainer, cfg.loss, cfg.searcher.temperature,
                      autocast_dtype=compute if compute != torch.float32 else None)
    return trainer, tok


def generation_dtype(cfg: Config) -> torch.dtype:
    """dtype the searchers generate in (and the trainer publishes weights in)."""
    return pick_dtype(cfg.model.dtype)
