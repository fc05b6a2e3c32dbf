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

    def score(self, prompts: list[list[int]], responses: list[list[int]],
              temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of given responses under the engine's current weights (its adapter too, if it
        holds one): log softmax(logits / temperature) of each response token given the prompt and the tokens
        before it, no top-k/top-p. The searcher's sync check compares them with the trainer's
        (:class:`tba.types.Probe`), so they must come from the weights :meth:`generate` samples with.

        Args:
            prompts: token ids per prompt (no padding), length N.
            responses: token ids per response (no padding, at least one token), length N; response i
                continues prompt i.
            temperature: softmax temperature (> 0). An engine may support 1 only and raise ValueError for
                others (vLLM's prompt log-probs skip the temperature); the sync check scores at 1.

        Returns:
            ``out[i][t]``: log p(responses[i][t] | prompts[i], responses[i][:t]) in nats, one per response
            token; an engine whose context cannot hold a prompt + response returns the tokens that fit (a
            prefix of them: exact, as a token's log-prob depends only on the tokens before it).
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
