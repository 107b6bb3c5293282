"""Dropout is off in the policy and the reference by default: the update's π_θ is the distribution that sampled."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig
from grpo_lightning.models.build import disable_dropout


@pytest.fixture
def gpt2_dir(tmp_path, tokenizer):
    """A GPT-2 with its usual 0.1 dropout everywhere (embeddings, attention, residuals), as a local folder."""
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
    torch.manual_seed(0)
    path = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def train_mode_logits(model: torch.nn.Module, seed: int) -> torch.Tensor:
    model.train()
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits


@pytest.mark.parametrize("keep", [False, True])
def test_policy_and_reference_run_without_dropout_unless_kept(gpt2_dir, keep):
    module = GRPOModule(model_name_or_path=gpt2_dir, objective=ObjectiveConfig(beta=0.04), disable_dropout=not keep)
    module.configure_model()
    for model in (module.policy, module.ref):
        # Two train-mode forwards with different dropout seeds: equal to the bit only without dropout.
        same = torch.equal(train_mode_logits(model, 1), train_mode_logits(model, 2))
        assert same is not keep
        if not keep:
            model.eval()
            with torch.no_grad():
                eval_logits = model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits
            assert torch.equal(train_mode_logits(model, 1), eval_logits)  # the sampler's distribution
    assert module.policy.config.resid_pdrop == 0.1  # the config (and so an export) keeps the model's dropout


def test_attention_dropout_given_as_a_float_is_zeroed():
    """Llama-family attention reads its dropout from a float attribute, not from an nn.Dropout."""
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, attention_dropout=0.3)
    )
    assert disable_dropout(model) == 1
    assert model.model.layers[0].self_attn.attention_dropout == 0.0
    assert torch.equal(train_mode_logits(model, 1), train_mode_logits(model, 2))
