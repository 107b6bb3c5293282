"""Dropout is off in the policy and the reference by default: the update's π_θ is the distribution that sampled."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import length_reward
from lightning import Callback
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import EvalConfig, UpdateConfig
from grpo_lightning.lora import LoraConfig
from grpo_lightning.models.build import disable_dropout
from grpo_lightning.rewards import RewardSpec, register

register("dropout_length")(length_reward)


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


class RatioRecorder(Callback):
    """Each optimizer step's ratio range and clip fraction, as ``training_step`` logs them."""

    def __init__(self) -> None:
        self.ratio_min, self.ratio_max, self.clip_frac = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.ratio_min.append(float(metrics["train/ratio_min"]))
        self.ratio_max.append(float(metrics["train/ratio_max"]))
        self.clip_frac.append(float(metrics["train/clip_frac"]))


@pytest.mark.parametrize("old_logprobs", ["sampler", "recompute"])
def test_lora_adapters_run_without_dropout_so_the_on_policy_ratio_is_one(tmp_path, old_logprobs):
    """``model.lora.dropout: 0.3`` with dropout disabled (GRPO's default): PEFT's adapter dropout is off too, so the
    update (train mode) computes the π that sampled (eval mode). B is made non-zero first: with B = 0 the adapter adds
    nothing and its dropout cannot show."""
    pytest.importorskip("peft", reason="LoRA needs PEFT: pip install 'grpo_lightning[lora]'")
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lora=LoraConfig(r=4, dropout=0.3))
    module.configure_model()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    data = RolloutDataModule(
        rewards=[RewardSpec("dropout_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6),
        update=UpdateConfig(old_logprobs=old_logprobs, mini_batch_size=8),
        prompts_per_round=4,
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    recorder = RatioRecorder()
    quiet_trainer(tmp_path, max_epochs=1, callbacks=[recorder]).fit(module, datamodule=data)
    exact = old_logprobs == "recompute"  # the sampler's decoding passes round differently from one full pass
    tolerance = 0.0 if exact else 1e-5
    assert recorder.ratio_min[0] == pytest.approx(1.0, abs=tolerance)
    assert recorder.ratio_max[0] == pytest.approx(1.0, abs=tolerance)
    assert recorder.clip_frac[0] == 0.0
