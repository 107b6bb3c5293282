"""tools/export_hf.py: checkpoint → Hugging Face folder with the same logits; a LoRA policy exported merged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import TINY
from lightning import Trainer
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpo_lightning import GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.cli import TRAINER_DEFAULTS

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


def tiny_module(**kwargs) -> GRPOModule:
    return GRPOModule(
        tiny_model=TINY, sampling=SamplingConfig(group_size=4, max_new_tokens=4, temperature=0.7), **kwargs
    )


def test_exported_checkpoint_has_the_module_logits(tmp_path):
    module = tiny_module(lr=1e-2)
    data = RolloutDataModule(prompts_per_round=4, val_limit=4, task_kwargs={"test_size": 50})
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    torch.manual_seed(0)
    trainer.fit(module, datamodule=data)  # one update: the weights differ from the seeded initialisation
    ckpt = tmp_path / "round0.ckpt"
    trainer.save_checkpoint(ckpt)

    out = tmp_path / "exported"
    load_tool("export_hf").main([str(ckpt), str(out)])
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    texts = ["12+34=", "7+8="]
    expected = logits(module.policy, module.tokenizer, texts)
    torch.testing.assert_close(logits(model, tokenizer, texts), expected, atol=1e-5, rtol=0)
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == module.tokenizer.eos_token_id
    assert generation.temperature == pytest.approx(0.7) and generation.max_new_tokens == 4


def test_lora_policy_is_exported_merged(tmp_path):
    peft = pytest.importorskip("peft")
    module = tiny_module()
    module.configure_model()
    torch.manual_seed(0)
    # init_lora_weights=False: random adapters, so the merge visibly changes the base weights.
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    module.policy = peft.get_peft_model(module.policy, config)
    texts = ["12+34=", "7+8="]
    with_adapters = logits(module.policy, module.tokenizer, texts)
    with module.policy.disable_adapter():
        assert (logits(module.policy, module.tokenizer, texts) - with_adapters).abs().max() > 1e-3

    out = load_tool("export_hf").export_module(module, tmp_path / "merged")
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert not any("lora" in name for name in weights.keys())
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(model, module.tokenizer, texts), with_adapters, atol=1e-5, rtol=0)
