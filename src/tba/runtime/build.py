"""Builders: turn the config into plain constructor arguments for searchers and the trainer.

Runs inside each Ray actor (and in-process in tests), so nothing here knows about processes.
"""

from __future__ import annotations

import os

import torch

from tba.config import Config
from tba.engines.hf import HFEngine
from tba.losses import LossHParams
from tba.models import enable_activation_checkpointing, load_causal_lm, load_tokenizer, pick_dtype
from tba.searcher import Searcher
from tba.tasks import Task, build_task
from tba.trainer import Trainer


def quiet_libraries() -> None:
    """Silence transformers' per-call warnings in worker processes (they drown the progress bar)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def task_from_config(cfg: Config) -> Task:
    """The task named by ``cfg.task`` (data loaded, prompts formatted lazily).

    Tasks that load models of their own get the run's model settings as default options (values set in
    ``task.options`` win): ``summarize`` the reference model for perplexity, the policy's tokenizer and the
    searchers' ``max_new_tokens`` (to detect cut-off responses); ``redteam`` the training temperature for its
    sampled eval attacks; both the GGUF cache.
    """
    t = cfg.task
    options = t.options
    if t.name in ("summarize", "redteam"):
        run = {"cache_dir": cfg.model.cache_dir}
        if t.name == "redteam":
            run["eval_temperature"] = cfg.searcher.temperature
        if t.name == "summarize":
            run.update(reference_model=cfg.model.reference or cfg.model.policy, tokenizer=cfg.model.policy,
                       reference_layers=cfg.model.num_hidden_layers, dtype=cfg.model.dtype,
                       max_new_tokens=cfg.searcher.max_new_tokens)
        options = {**run, **t.options}
    return build_task(t.name, source=t.source, options=options, train_size=t.train_size,
                      eval_size=t.eval_size, seed=t.seed, system_prompt=t.system_prompt,
                      prompt_template=t.prompt_template, answer_pattern=t.answer_pattern)


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
    task = task_from_config(cfg)
    s = cfg.searcher
    return Searcher(HFEngine(policy, tok), ref, task, tok, shard(len(task.train), s.num_searchers, searcher_id),
                    searcher_id, prompts_per_batch=s.prompts_per_batch, samples_per_prompt=s.samples_per_prompt,
                    max_new_tokens=s.max_new_tokens, max_num_seqs=s.max_num_seqs, temperature=s.temperature,
                    temperature_range=s.temperature_range,
                    reward_timeout_s=s.reward_timeout_s, failed_reward=s.failed_reward,
                    score_micro_batch=cfg.trainer.micro_batch_size, seed=cfg.run.seed)


def build_trainer(cfg: Config, policy_path: str) -> tuple[Trainer, object]:
    """The trainer (float32 master weights, bf16 autocast where supported) and its tokenizer."""
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.run.seed)
    tok = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path, torch.float32, cfg.model.num_hidden_layers)
    compute = pick_dtype(cfg.model.dtype)
    t, lc = cfg.trainer, cfg.loss
    if t.gradient_checkpointing:
        enable_activation_checkpointing(model)
    trainer = Trainer(model, tok.pad_token_id, loss_name=lc.name, loss_hp=LossHParams(clip_eps=lc.clip_eps, is_cap=lc.is_cap),
                      temperature=cfg.searcher.temperature, lr=t.lr, weight_decay=t.weight_decay,
                      grad_clip=t.grad_clip, lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                      decay_steps=t.decay_steps, total_steps=t.max_steps, beta_start=t.beta_start,
                      beta_end=t.beta_end, beta_anneal_steps=t.beta_anneal_steps,
                      micro_batch_size=t.micro_batch_size,
                      autocast_dtype=compute if compute != torch.float32 else None)
    return trainer, tok


def generation_dtype(cfg: Config) -> torch.dtype:
    """dtype the searchers generate in (and the trainer publishes weights in)."""
    return pick_dtype(cfg.model.dtype)
