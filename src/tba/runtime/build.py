"""Builders: load the models a searcher or the trainer needs and hand each component its config section.

Runs inside each Ray actor (and in-process in tests), so nothing here knows about processes. Components
take their config section directly, so every default is declared once, in :mod:`tba.config`.
"""

from __future__ import annotations

import copy

import torch

from tba import parallel
from tba.adapters import add_adapter
from tba.config import Config
from tba.engines.base import Engine
from tba.engines.hf import HFEngine
from tba.models import enable_activation_checkpointing, load_causal_lm, load_tokenizer, pick_dtype, truncated_copy
from tba.placement import publishes_merged, reference_location, vllm_memory_share
from tba.searcher import Searcher
from tba.tasks import build_task
from tba.trainer import Trainer


def quiet_libraries(run_dir: str | None = None, role: str = "worker") -> None:
    """Route a worker process's log lines (:mod:`tba.logger`): tba's to the console, each distinct library
    warning once, and every library record to ``run_dir``'s third-party log; no library progress bars.

    Args:
        run_dir: the run directory; None (or one this node cannot reach): library records reach the console
            (once per distinct warning) only.
        role: the tag of this process's lines in the file, e.g. 'trainer' or 'searcher 0'.
    """
    from transformers.utils import logging as hf_logging  # imported first: routing releases its handler

    from tba.logger import route_worker

    route_worker(run_dir, role)
    hf_logging.disable_progress_bar()


def shard(n_problems: int, num_searchers: int, searcher_id: int) -> list[int]:
    """Disjoint prompt shard of one searcher: every num_searchers-th problem id."""
    return list(range(searcher_id, n_problems, num_searchers))


def build_engine(cfg: Config, policy_path: str, tokenizer, seed: int, task, problem_ids: list[int]) -> Engine:
    """The searcher's generation engine (``searcher.engine``) on ``model.device``, in the generation dtype.

    Args:
        task, problem_ids: the searcher's task and prompt shard; vLLM sizes its sequences by the longest
            prompt (encoded here only for vLLM; the searcher encodes its own copy).
    """
    dtype, device = pick_dtype(cfg.model.dtype), _device(cfg)
    if cfg.searcher.engine == "vllm":
        return _vllm_engine(cfg, policy_path, tokenizer, task, [task.train[i] for i in problem_ids], device=device,
                            max_num_seqs=cfg.searcher.max_num_seqs, threads=cfg.searcher.threads, seed=seed,
                            gpu_memory_utilization=vllm_memory_share(cfg))
    policy = load_causal_lm(policy_path, dtype, cfg.model.num_hidden_layers).to(device)
    if cfg.model.lora.r:  # an untrained adapter: the published ones are copied into it
        policy = add_adapter(policy, cfg.model.lora).eval()
    return HFEngine(policy, tokenizer, cfg.searcher.max_num_seqs)


def build_eval_engine(cfg: Config, policy_path: str, policy, tokenizer, task) -> Engine:
    """The engine of the held-out evals (``run.eval_engine``, resolved by :func:`tba.placement.resolve_placement`).

    Args:
        policy_path: the policy's folder (a vLLM engine is built from it once, then given weights).
        policy: the policy to evaluate as a transformers causal LM in the generation dtype (the hf engine
            wraps it as it is).
        task: sizes vLLM's sequences by the longest eval (or train) prompt plus ``searcher.max_new_tokens``.

    Returns:
        ``HFEngine`` over ``policy`` (``run.eval_batch_size`` responses decoding at once), or a ``VLLMEngine``
        holding the weights of ``policy_path``: the caller loads the policy's weights into it before each eval.
    """
    if cfg.run.eval_engine != "vllm":
        return HFEngine(policy, tokenizer, cfg.run.eval_batch_size)
    return _vllm_engine(cfg, policy_path, tokenizer, task, task.eval or task.train, device="cpu",
                        max_num_seqs=cfg.run.eval_batch_size, threads=cfg.trainer.threads, seed=cfg.run.seed)


def _vllm_engine(cfg: Config, policy_path: str, tokenizer, task, problems, **engine_kw) -> Engine:
    """A ``VLLMEngine`` on the policy (cut to ``model.num_hidden_layers``) in the generation dtype, its
    sequences sized by the longest prompt of ``problems`` plus ``searcher.max_new_tokens``, serving LoRA
    adapters of rank ``model.lora.r`` when the trainer publishes adapters (not merged: :func:`publishes_merged`);
    ``engine_kw``: the caller's device, ``max_num_seqs``, threads, seed (and GPU share)."""
    from tba.engines.vllm import VLLMEngine

    n = cfg.model.num_hidden_layers
    folder = truncated_copy(policy_path, n, cfg.model.cache_dir) if n else policy_path
    longest = max(len(task.encode(tokenizer, p)) for p in problems)
    return VLLMEngine(folder, dtype=pick_dtype(cfg.model.dtype), max_model_len=longest + cfg.searcher.max_new_tokens,
                      kv_cache_gib=cfg.searcher.kv_cache_gib,
                      lora_rank=None if publishes_merged(cfg) else cfg.model.lora.r, **engine_kw)


def build_searcher(cfg: Config, policy_path: str, ref_path: str, searcher_id: int) -> Searcher:
    """A searcher with its own policy copy in its engine and, unless the trainer scores pi_ref
    (``model.reference_on``), its own reference model, both in the generation dtype on ``model.device``.
    With a LoRA adapter on the hf engine the reference is the engine's own base with the adapter off (no
    second copy; :func:`reference_location`)."""
    torch.set_num_threads(cfg.searcher.threads)
    seed = cfg.run.seed + 1000 * (searcher_id + 1)  # distinct sampling streams per searcher
    torch.manual_seed(seed)
    tok = load_tokenizer(policy_path)
    task = build_task(cfg)
    problem_ids = shard(len(task.train), cfg.searcher.num_searchers, searcher_id)
    engine = build_engine(cfg, policy_path, tok, seed, task, problem_ids)
    ref = None
    if reference_location(cfg) == "searcher-base":
        ref = engine.model
    elif cfg.model.reference_on == "searcher":
        ref = load_causal_lm(ref_path, pick_dtype(cfg.model.dtype), cfg.model.num_hidden_layers).to(_device(cfg))
    return Searcher(engine, ref, task, tok, problem_ids, searcher_id, cfg.searcher,
                    score_micro_batch=cfg.trainer.micro_batch_size, seed=cfg.run.seed)


def build_trainer(cfg: Config, policy_path: str, ref_path: str | None = None,
                  num_prompts: int | None = None) -> tuple[Trainer, object]:
    """The trainer (float32 master weights, bf16 autocast where supported) on ``model.device``, and its
    tokenizer. It holds a reference model (generation dtype, as the searchers would) when
    ``model.reference_on`` is 'trainer'. ``num_prompts``: the task's training prompts (the learned log Z
    table's size, ``loss.log_z: learned``). With ``trainer.fsdp`` (inside the ranks' process group) the
    policy is sharded with FSDP2 (:func:`tba.parallel.fully_shard_model`) and rank 0 keeps an unsharded CPU
    copy.

    Raises:
        ValueError: ``model.reference_on`` is 'trainer' and no ``ref_path`` is given; a learned log Z
            without ``num_prompts``.
    """
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.run.seed)
    device = _device(cfg)
    tok = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path, torch.float32, cfg.model.num_hidden_layers).to(device)
    compute = pick_dtype(cfg.model.dtype)
    if cfg.trainer.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.model.lora.r:
        model = add_adapter(model, cfg.model.lora)
    unsharded = None
    if cfg.trainer.fsdp:  # rank 0 keeps an unsharded CPU copy for publication, evals and the final save
        unsharded = copy.deepcopy(model).cpu() if parallel.rank_and_world()[0] == 0 else None
        parallel.fully_shard_model(model)
    ref = None
    if reference_location(cfg) == "trainer-base":
        ref = model
    elif cfg.model.reference_on == "trainer":
        if ref_path is None:
            raise ValueError("model.reference_on is 'trainer': build_trainer needs the reference model's path")
        ref = load_causal_lm(ref_path, compute, cfg.model.num_hidden_layers).to(device)
    trainer = Trainer(model, tok.pad_token_id, cfg.trainer, cfg.loss, cfg.searcher.temperature,
                      autocast_dtype=compute if compute != torch.float32 else None, ref_model=ref,
                      publish_merged=publishes_merged(cfg), num_prompts=num_prompts, unsharded=unsharded)
    return trainer, tok


def _device(cfg: Config) -> str:
    """The torch device of this process's models: 'cuda' (the GPU Ray gave this actor) or 'cpu'; 'auto' (in
    process, without the driver's placement) is resolved here."""
    if cfg.model.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.model.device


def generation_dtype(cfg: Config) -> torch.dtype:
    """dtype the searchers generate in (and the trainer publishes weights in)."""
    return pick_dtype(cfg.model.dtype)
