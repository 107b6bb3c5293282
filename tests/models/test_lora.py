"""LoRA: adapters train and nothing else; π_ref is the base model (adapter disabled), not a second copy."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import checksum_reward, save_tiny_llama
from memory_probe import update_peak_bytes
from transformers import AutoModelForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError, EvalConfig
from grpo_lightning.lora import LoraConfig
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.rewards import RewardSpec, register

pytest.importorskip("peft", reason="LoRA needs PEFT: pip install 'grpo_lightning[lora]'")


register("lora_checksum")(checksum_reward)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[GRPOModule, RolloutDataModule, dict, str]:
    """Two rounds of LoRA GRPO (β > 0, gradient checkpointing) on a tiny saved model."""
    path = save_tiny_llama(tmp_path_factory.mktemp("lora-base"), TINY)
    module = GRPOModule(
        model_name_or_path=path,
        objective=ObjectiveConfig(beta=0.1),
        lr=3e-2,
        lora=LoraConfig(r=4, alpha=8),
        gradient_checkpointing=True,
    )
    module.configure_model()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    data = RolloutDataModule(
        rewards=[RewardSpec("lora_checksum")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6),
        prompts_per_round=4,
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    trainer = quiet_trainer(
        tmp_path_factory.mktemp("lora-run"),
        max_epochs=2,
    )
    trainer.fit(module, datamodule=data)
    return module, data, before, path


def test_only_adapters_change_and_no_reference_copy(trained) -> None:
    module, _, before, _ = trained
    assert module.ref is None  # β > 0, yet no second model in memory
    after = module.policy.state_dict()
    changed = {k for k, v in after.items() if not torch.equal(before[k], v)}
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)  # B starts at 0: the adapter now changes the model
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_reference_logprobs_are_the_base_models(trained) -> None:
    module, data, _, base_path = trained
    batch = data.last_rollout
    _, ref = module.rollout_logprobs(batch, old=False, ref=True)
    assert module.policy.training  # restored after the adapter-disabled pass
    inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    base = AutoModelForCausalLM.from_pretrained(base_path).eval()
    with torch.no_grad():
        expected, _ = completion_logprobs(base, *inputs)
        module.policy.eval()
        policy, _ = completion_logprobs(module.policy, *inputs)
        module.policy.train()
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(ref[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert (policy[mask] - expected[mask]).abs().max() > 1e-4  # while the policy itself has moved


def test_merge_and_unload_gives_the_policy(trained) -> None:
    module, data, _, _ = trained
    ids = data.last_rollout.prompt_ids[:2]
    policy = module.policy.eval()
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        merged = policy.merge_and_unload()  # in place: last test of this module to use the policy
        got = merged(input_ids=ids).logits
    assert not any("lora_" in k for k in merged.state_dict())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_lora_update_peak_memory_below_full_finetune() -> None:
    size = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256)
    peaks = {}
    for name, lora in (("full", None), ("lora", LoraConfig(r=8))):

        def build(lora: LoraConfig | None = lora) -> GRPOModule:
            return GRPOModule(tiny_model=size, objective=ObjectiveConfig(beta=0.04), lora=lora)

        peaks[name] = update_peak_bytes(build, rows=8, prompt_len=8, completion_len=16)
    assert peaks["lora"] < peaks["full"], peaks


def test_lora_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="lora.r"):
        LoraConfig(r=0)


# ------------------------------------------------------------------ layers trained in full (modules_to_save)
def base_folder(path, *, tied: bool) -> str:
    """A tiny model saved as a folder, its output layer tied to the input embedding or a copy of its own."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(TINY, tokenizer)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_layer_trained_in_full_leaves_under_its_base_name_for_the_lagged_sampler_and_the_export(tmp_path, tied):
    """``modules_to_save: [lm_head]``: PEFT holds the layer twice under its own names (``original_module``,
    ``modules_to_save.default``). What leaves the trainer, for the background process at a lag (a strict load of
    a plain model) and for the exported folder, is the trained copy under the base model's name."""
    from test_async_rollouts import lagged

    from grpo_lightning.callbacks import SaveHFModel
    from grpo_lightning.engines.weights import policy_weights, policy_weights_meta

    path = base_folder(tmp_path / "base", tied=tied)
    module = GRPOModule(model_name_or_path=path, lr=3e-2, lora=LoraConfig(r=4, alpha=8, modules_to_save=["lm_head"]))
    data = lagged(rewards=[RewardSpec("lora_checksum")])
    export = tmp_path / "export"
    trainer = quiet_trainer(tmp_path / "run", max_epochs=2, callbacks=[SaveHFModel(str(export))])
    trainer.fit(module, datamodule=data)  # each round sends the weights to the background process (round 1: trained)

    base = AutoModelForCausalLM.from_pretrained(path)
    sent = dict(policy_weights(module.policy))
    assert list(sent) == list(base.state_dict())  # the base model's names, in its order: nothing PEFT's
    assert [name for name, _, _ in policy_weights_meta(module.policy)] == list(sent)
    assert (sent["lm_head.weight"] - base.lm_head.weight).abs().max() > 1e-3  # the trained copy, not the original
    if tied:  # one shared copy trained: the model stays tied, as its config says
        assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])

    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    ids = data.last_rollout.prompt_ids[:2]
    module.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, module.policy(input_ids=ids).logits)
        torch.testing.assert_close(exported.lm_head.weight, sent["lm_head.weight"])
