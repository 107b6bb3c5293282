"""Tiny vision-language models built in code load as any Hub model would (issue 42): ``AutoModelForImageTextToText``
and the processor, the tokenizer being the processor's; ``model.model_name_or_path`` of such a folder loads it;
the vision tower frozen by default (``model.freeze_vision_tower``)."""

from __future__ import annotations

import re

import pytest
from transformers import AutoModelForImageTextToText, AutoProcessor
from vision_models import image_prompt, shared_vlms, squares

from grpo_lightning.integrations.vision.encoder import VisionPromptEncoder
from grpo_lightning.integrations.vision.models import is_vision_model, vision_tower_pattern, vision_towers
from grpo_lightning.integrations.vision.processors import load_processor
from grpo_lightning.lora import LoraConfig
from grpo_lightning.modality import TEXT, modality_for
from grpo_lightning.models.build import load_model, load_tokenizer
from grpo_lightning.models.policy_and_reference import build_policy
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rollout.prompts import prompt_encoder


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


FAMILIES = ["qwen2_vl", "llava", "idefics3"]
CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_folder_loads_with_the_auto_classes_and_its_text_heads_are_32_wide(tiny_vlms, family):
    path = str(tiny_vlms[family])
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model).__name__ == CLASSES[family]
    text = model.config.text_config
    assert text.hidden_size // text.num_attention_heads == 32  # vLLM's CPU kernels take 32, 64, ...
    processor = load_processor(path)
    assert type(processor).__name__ == {"qwen2_vl": "Qwen2VLProcessor"}.get(family, type(processor).__name__)
    if family != "qwen2_vl":  # Qwen2-VL's processor class wants a video processor: torchvision, not here
        assert type(AutoProcessor.from_pretrained(path)) is type(processor)
    text = processor.apply_chat_template(image_prompt("count", 1), tokenize=False, add_generation_prompt=True)
    output = processor(text=[text], images=[[squares(2)]], return_tensors="pt")
    assert (output["input_ids"] == model.config.image_token_id).sum() >= 4  # the marker expanded to the image


@pytest.mark.parametrize("family", FAMILIES)
def test_model_name_or_path_of_a_vision_folder_loads_the_model_and_the_processors_tokenizer(tiny_vlms, family):
    path = str(tiny_vlms[family])
    assert is_vision_model(path) and not is_vision_model(None)
    modality = modality_for(path)  # the image modality holds the processor (nothing rides on the tokenizer)
    tokenizer = load_tokenizer(path, modality=modality)
    processor = modality.processor
    assert processor is not None and processor.tokenizer is tokenizer and tokenizer.padding_side == "left"
    model = load_model(path, TinyModelConfig(), tokenizer, modality)
    assert type(model).__name__ == CLASSES[family]
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert isinstance(prompt_encoder(modality, tokenizer, "auto"), VisionPromptEncoder)
    assert modality_for(None) is TEXT and not hasattr(tokenizer, "_grpo_vision_processor")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vision_tower_is_frozen_by_default_and_trains_when_asked(tiny_vlms, family):
    path = str(tiny_vlms[family])
    tokenizer = load_tokenizer(path)
    frozen, _ = build_policy(path, TinyModelConfig(), tokenizer)
    towers = vision_towers(frozen)
    assert towers and not any(p.requires_grad for t in towers for p in t.parameters())
    assert frozen.lm_head.weight.requires_grad  # the language model trains
    trained, _ = build_policy(path, TinyModelConfig(), tokenizer, freeze_vision_tower=False)
    assert all(p.requires_grad for t in vision_towers(trained) for p in t.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapts_the_language_model_and_not_the_frozen_vision_tower(tiny_vlms, family):
    path = str(tiny_vlms[family])
    tokenizer = load_tokenizer(path)
    policy, _ = build_policy(path, TinyModelConfig(), tokenizer, lora=LoraConfig(r=4))
    adapted = [name for name, _ in policy.named_modules() if name.endswith("lora_A")]
    in_tower = [name for name in adapted if re.fullmatch(vision_tower_pattern(), name.removesuffix(".lora_A"))]
    assert adapted and not in_tower  # PEFT's all-linear alone would adapt the tower's layers too
    assert any("q_proj" in name for name in adapted)  # the language model's attention
    unfrozen, _ = build_policy(path, TinyModelConfig(), tokenizer, lora=LoraConfig(r=4), freeze_vision_tower=False)
    assert any(re.fullmatch(vision_tower_pattern(), n) for n, _ in unfrozen.named_modules() if "lora_A" in n)
