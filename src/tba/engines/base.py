"""The one boundary between a searcher and a generation engine (``hf``: our decoding loop on transformers;
``vllm``: vLLM's offline ``LLM``). A searcher holds an :class:`Engine` and never knows which one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tba.types import PackedWeights


@dataclass
class Generation:
    """One generated response.

    Attributes:
        response_ids: sampled token ids without padding; includes the EOS token when ``finished``.
        logprobs: per-token log-probs under the generating policy at the sampling temperature [R] (nats).
        finished: ended with EOS (False: cut at max new tokens).
    """

    response_ids: list[int]
    logprobs: list[float]
    finished: bool


@runtime_checkable
class Engine(Protocol):
    """What a searcher needs from a generation engine (``docs/extending.md``, "Add an engine").

    Behaviour log-probs are those of the distribution the tokens were sampled from: softmax(logits /
    temperature), no top-k/top-p, so the trainer's importance ratios and the TB residual use the same
    distribution (docs/algorithm.md section 1).
    """

    def generate(self, prompts: list[list[int]], num_samples: int, max_new_tokens: int, temperature: float = 1.0,
                 *, greedy: bool = False, seed: int | None = None, min_new_tokens: int = 0) -> list[list[Generation]]:
        """Sample ``num_samples`` responses per prompt.

        Args:
            prompts: token ids per prompt (no padding), length B.
            num_samples: responses per prompt (S).
            max_new_tokens: response cap in tokens.
            temperature: sampling temperature (> 0); the returned log-probs use it.
            greedy: argmax decoding (evals).
            seed: makes the call's sampling reproducible on the same engine and weights; None = the engine's
                own stream.
            min_new_tokens: EOS cannot be drawn before this many tokens (benchmarks force response lengths
                with it). The draws then come from a distribution with EOS masked, not the policy's, so
                searchers and evals leave it at 0.

        Returns:
            ``out[i][j]``: response j of prompt i.
        """
        ...

    def load_weights(self, packed: PackedWeights) -> None:
        """Replace the policy weights in place with published ones (``tba.weights.pack_weights``); the next
        :meth:`generate` uses them and no state computed with the old weights (e.g. a prefix cache).

        Raises:
            ValueError: the weights are of a different architecture.
        """
        ...

    def close(self) -> None:
        """Free the engine's memory and stop anything it started (no process is left behind)."""
        ...
