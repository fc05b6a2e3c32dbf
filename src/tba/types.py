"""Plain data that crosses process boundaries (searcher -> buffer -> trainer).

Imports nothing from the package, so every module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One scored response to one prompt, as a searcher produced it.

    Attributes:
        prompt_id: index of the prompt in the task's training set (stable across runs and resumes).
        prompt_ids: prompt token ids, chat template applied, no padding. Length P tokens.
        response_ids: generated token ids, no padding; ends with EOS when ``finished``. Length R tokens.
        reward: raw task reward r(x, y); beta is applied only when the loss is computed (docs/algorithm.md section 1).
        logprobs: behaviour policy per-token log-probs of ``response_ids`` at the sampling temperature,
            length R (GRPO / PPO ratios use them).
        ref_logprobs: frozen reference model per-token log-probs of ``response_ids``, same temperature,
            length R; None when the trainer scores the reference (``model.reference_on: trainer``).
        policy_version: trainer step whose published weights generated this response; staleness of the
            sample at trainer step t is ``t - policy_version``.
        searcher_id: which searcher produced it.
        finished: True when the response ended with EOS rather than hitting max new tokens.
    """

    prompt_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    logprobs: list[float]
    ref_logprobs: list[float] | None
    policy_version: int
    searcher_id: int = 0
    finished: bool = True

    @property
    def ref_logprob(self) -> float:
        """Sequence-level log pi_ref(y|x): the sum over response tokens (docs/algorithm.md section 1)."""
        return float(sum(self.ref_logprobs))


@dataclass
class Batch:
    """A training batch: B prompts x K responses, stored group-major.

    ``samples[i * group_size + j]`` is response j of prompt i, so tensors built from it reshape to
    ``[B, K]`` for the per-prompt log Z estimate (docs/algorithm.md section 1).
    """

    samples: list[Sample]
    group_size: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        """B, the number of prompt groups."""
        return len(self.samples) // self.group_size


@dataclass
class Probe:
    """A few fixed responses and the log-probs the trainer's policy gives them, sent with a publication so
    that each searcher can check the weights reached its engine (the sync check, docs/architecture.md).

    Attributes:
        prompt_ids: prompt token ids per probe response (no padding).
        response_ids: response token ids per probe response (no padding).
        logprobs: the trainer's per-token log-probs of each response (nats), under the published policy as the
            trainer scores it (float32 master weights under its autocast) at ``temperature``.
        temperature: the softmax temperature of ``logprobs``; the engine scores at the same one (1: vLLM's
            prompt log-probs are not temperature-scaled).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    temperature: float = 1.0


@dataclass
class PackedWeights:
    """Published policy weights in ONE flat byte buffer (trainer -> object store -> searchers).

    One contiguous array is one object-store copy, and Ray hands a numpy array to its readers without
    copying it again (a dict of torch tensors is pickled tensor by tensor and copied on every read).
    Tied parameters (e.g. SmolLM2's embedding and LM head) are stored once.

    Attributes:
        entries: ``(name, dtype, shape, byte_offset)`` per stored tensor, dtype as ``str(torch.dtype)``.
        data: uint8 numpy array [total bytes]; each tensor starts at a 64-byte-aligned offset.
        adapter: None for full weights; for a LoRA adapter (``model.lora``) its PEFT ``LoraConfig`` as a
            JSON-safe dict (what ``adapter_config.json`` holds), and the entries are the adapter's tensors
            under PEFT's saved names (``...q_proj.lora_A.weight``, as ``get_peft_model_state_dict`` gives them).
        probe: the trainer's :class:`Probe` for these weights (``Trainer.publish_weights``); None before the
            trainer has fixed its probe responses (the first training step), and in packs made elsewhere.
    """

    entries: list
    data: object
    adapter: dict | None = None
    probe: Probe | None = None
