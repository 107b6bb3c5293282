"""Shared fixtures: tiny models and tokenizers built in code (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_llama(tokenizer):
    torch.manual_seed(0)
    return build_tiny_llama(TINY, tokenizer).eval()


@pytest.fixture
def tiny_model_dir(tmp_path, tokenizer, tiny_llama):
    """A tiny model and tokenizer saved as a Hugging Face folder, loaded back through model_name_or_path."""
    path = tmp_path / "tiny-model"
    tiny_llama.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
