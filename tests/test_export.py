"""tools/export_hf.py: checkpoint → Hugging Face folder with the same logits; a LoRA policy exported merged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import TINY, quiet_trainer
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpo_lightning import GRPOModule, RewardSpec, RolloutDataModule, SamplingConfig
from grpo_lightning.rewards import register

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logits(model: torch.nn.Module, tokenizer, texts: list[str]) -> torch.Tensor:
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**encoded).logits


@register("test_export_length")
def length_reward(prompts, completions, **_):
    """Rewards with spread even for a random model, so that one round changes the weights."""
    return [float(len(c)) for c in completions]


def tiny_module(**kwargs) -> GRPOModule:
    sampling = SamplingConfig(group_size=4, max_new_tokens=4, temperature=0.7)
    return GRPOModule(tiny_model=TINY, rewards=[RewardSpec("test_export_length")], sampling=sampling, **kwargs)


def fit_one_round(module: GRPOModule, tmp_path: Path) -> Path:
    """One round of GRPO (so the weights differ from their initialisation), saved as a checkpoint."""
    data = RolloutDataModule(prompts_per_round=4, val_limit=4, task_kwargs={"test_size": 50})
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=1,
    )
    torch.manual_seed(0)
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters() if p.requires_grad]
    trainer.fit(module, datamodule=data)
    after = [p.detach() for p in module.policy.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))  # the round did update the weights
    ckpt = tmp_path / "round0.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt


TEXTS = ["12+34=", "7+8="]


def test_exported_checkpoint_has_the_module_logits(tmp_path):
    module = tiny_module(lr=1e-2)
    ckpt = fit_one_round(module, tmp_path)
    out = tmp_path / "exported"
    load_tool("export_hf").main([str(ckpt), str(out)])
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = logits(module.policy, module.tokenizer, TEXTS)
    torch.testing.assert_close(logits(model, tokenizer, TEXTS), expected, atol=1e-5, rtol=0)
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == module.tokenizer.eos_token_id
    assert generation.temperature == pytest.approx(0.7) and generation.max_new_tokens == 4


def test_lora_checkpoint_is_exported_merged(tmp_path):
    pytest.importorskip("peft")
    from grpo_lightning.lora import LoraConfig

    module = tiny_module(lr=1e-2, lora=LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    ckpt = fit_one_round(module, tmp_path)  # the adapters start at zero: one update makes them matter
    with_adapters = logits(module.policy, module.tokenizer, TEXTS)
    with module.policy.disable_adapter():
        assert (logits(module.policy, module.tokenizer, TEXTS) - with_adapters).abs().max() > 1e-4

    out = load_tool("export_hf").export_checkpoint(ckpt, tmp_path / "merged")
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert not any("lora" in name for name in weights.keys())
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(model, module.tokenizer, TEXTS), with_adapters, atol=1e-5, rtol=0)
