"""tools/export_hf.py: checkpoint → Hugging Face folder with the same logits (and dtype); a LoRA policy exported
merged; a checkpoint of the command line exports without a warning of changed settings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import length_reward, load_tool
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpo_lightning import GRPOModule, ObjectiveConfig, RewardSpec, RolloutDataModule, SamplingConfig
from grpo_lightning.cli import GRPOCLI
from grpo_lightning.config import EvalConfig
from grpo_lightning.config_checks import check_checkpoint_hparams
from grpo_lightning.rewards import register

ROOT = Path(__file__).resolve().parents[2]


def logits(model: torch.nn.Module, tokenizer, texts: list[str]) -> torch.Tensor:
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**encoded).logits


register("test_export_length")(length_reward)


def tiny_module(**kwargs) -> GRPOModule:
    return GRPOModule(tiny_model=TINY, **kwargs)


def fit_one_round(module: GRPOModule, tmp_path: Path, **trainer_settings) -> Path:
    """One round of GRPO (so the weights differ from their initialisation), saved as a checkpoint."""
    data = RolloutDataModule(
        rewards=[RewardSpec("test_export_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=4, temperature=0.7),
        prompts_per_round=4,
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    trainer = quiet_trainer(tmp_path, max_epochs=1, **trainer_settings)
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


def test_bf16_true_checkpoint_exports_in_bf16(tmp_path):
    """``--dtype`` unset means as trained: the module is rebuilt in float32, the export is bf16 again."""
    module = tiny_module(lr=1e-2)
    ckpt = fit_one_round(module, tmp_path, precision="bf16-true")
    assert {p.dtype for p in module.policy.parameters()} == {torch.bfloat16}
    export = load_tool("export_hf")
    out = tmp_path / "as-trained"
    export.main([str(ckpt), str(out)])
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    torch.testing.assert_close(logits(model, module.tokenizer, TEXTS), logits(module.policy, module.tokenizer, TEXTS))
    out = export.export_checkpoint(ckpt, tmp_path / "float32", dtype="float32")  # an explicit dtype still applies
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float32}


def test_float32_checkpoint_exports_in_float32(tmp_path):
    ckpt = fit_one_round(tiny_module(lr=1e-2), tmp_path)
    out = load_tool("export_hf").export_checkpoint(ckpt, tmp_path / "exported")
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float32}


def test_checkpoint_of_the_command_line_exports_without_a_changed_settings_warning(tmp_path, monkeypatch, caplog):
    """Saved hyperparameters hold the parsed config (jsonargparse Namespaces), the rebuilt module its own objects
    (``ObjectiveConfig``, ...): the same settings in two forms, not a change."""
    monkeypatch.chdir(tmp_path)
    quickstart = ROOT / "configs" / "quickstart.yaml"
    model = ROOT / "grpo_lightning" / "assets" / "tiny-arith"
    args = ["fit", "--config", str(quickstart), "--model.model_name_or_path", str(model), "--trainer.max_epochs", "1"]
    args += ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", "run"]
    cli = GRPOCLI(args=[*args, "--data.prompts_per_round", "2", "--data.update.mini_batch_size", "16"])
    ckpt = cli.trainer.checkpoint_callback.last_model_path
    with caplog.at_level(logging.WARNING):
        load_tool("export_hf").main([str(ckpt), str(tmp_path / "exported")])
    assert not [r for r in caplog.records if "other values" in r.getMessage()], caplog.text
    assert (tmp_path / "exported" / "model.safetensors").is_file()


def test_saved_settings_compare_by_value_whatever_their_form():
    from jsonargparse import Namespace

    def saved(beta: float) -> Namespace:  # what a checkpoint of the command line holds
        spec = Namespace(beta=beta, loss_type="grpo", epsilon_low=0.2)
        return Namespace(class_path="grpo_lightning.ObjectiveConfig", init_args=spec, __subclasses_disabled__=True)

    current = {"objective": ObjectiveConfig(beta=0.04), "lr": 1e-4}
    assert check_checkpoint_hparams({"objective": saved(0.04), "lr": 1e-4}, current, "'x'") == []
    assert check_checkpoint_hparams({"objective": {"loss_type": "grpo"}}, current, "'x'") == []  # defaults
    assert check_checkpoint_hparams({"objective": saved(0.5)}, current, "'x'") == ["model.objective"]
    assert check_checkpoint_hparams({"lr": 1e-3}, current, "'x'") == ["model.lr"]
