"""Tiny vision-language models built in code: Qwen2-VL (3-D M-RoPE), LLaVA (one row of features per image), Idefics3
(image splitting), Qwen2.5-VL (windowed vision attention), Gemma 3 (each image's tokens attend both ways: its
``token_type_ids``) and PaliGemma (a prefix language model: the prompt attends both ways), each saved as a folder
that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load.

Nothing is downloaded: the tokenizer is ``models/tiny.py``'s character tokenizer with the family's image tokens
added, the image processor the family's PIL one (no torchvision needed), and the chat template a small one that
renders ``{"type": "image"}`` parts as the family's image markup. The text heads are 32 wide (vLLM's CPU kernels
take 32, 64, ...), the vision towers one or two layers: a forward on a 56-pixel image takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from grpo_lightning.config import ConfigError
from grpo_lightning.models.tiny import build_char_tokenizer

VLM_FAMILIES = ("qwen2_vl", "llava", "idefics3", "qwen2_5_vl", "gemma3", "paligemma")

# How each family marks an image in the text the processor is given (it expands the marker to the image's tokens).
_IMAGE_MARKUP = {
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "llava": "<image>",
    "idefics3": "<image>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",  # Gemma3Processor expands it to the image's soft tokens, framed
    "paligemma": "<image>",
}
_SPECIAL_TOKENS = {
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "llava": ["<image>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<bos>"],
    "paligemma": ["<image>", "<bos>"],
}
# The tokens a family's processor finds by name on its tokenizer (transformers' ``extra_special_tokens``).
_NAMED_TOKENS = {
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "paligemma": {"image_token": "<image>"},
}
_HIDDEN, _HEADS, _LAYERS = 64, 2, 2  # text heads 64 / 2 = 32 wide


def chat_template(family: str) -> str:
    """A chat template (``role: content`` lines, then ``assistant: ``) that writes each ``{"type": "image"}`` part
    as ``family``'s image markup and each ``{"type": "text"}`` part as its text; a string content as it is."""
    markup = _IMAGE_MARKUP[family]
    return (
        "{% for message in messages %}{{ message['role'] }}: "
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + markup + "{% elif part['type'] == "
        "'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{% if not loop.last or add_generation_prompt %}{{ '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )


def build_vlm_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The character tokenizer with ``family``'s image tokens added as special tokens, and its chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIAL_TOKENS[family]})
    if family in _NAMED_TOKENS:  # the same vocabulary, with the names its processor reads
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend_tokenizer,
            pad_token=tokenizer.pad_token,
            eos_token=tokenizer.eos_token,
            unk_token=tokenizer.unk_token,
            bos_token="<bos>",
            extra_special_tokens=_NAMED_TOKENS[family],
            padding_side="left",
            model_max_length=tokenizer.model_max_length,
        )
    tokenizer.chat_template = chat_template(family)
    return tokenizer


def build_tiny_vlm(family: str, folder: str | Path, *, seed: int = 0) -> Path:
    """A randomly initialised tiny ``family`` model (one of ``VLM_FAMILIES``) and its processor, saved in
    ``folder``: ``model.model_name_or_path`` may name it. Returns the folder."""
    if family not in VLM_FAMILIES:
        raise ConfigError(f"tiny vision-language model: unknown family {family!r}; choose one of {VLM_FAMILIES}")
    folder = Path(folder)
    tokenizer = build_vlm_tokenizer(family)
    processor, model = _BUILDERS[family](tokenizer, seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _text_config(tokenizer: PreTrainedTokenizerFast, **extra: object) -> dict[str, object]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _HEADS,
        "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": True,
        **extra,
    }


def _seeded(seed: int, make: type[PreTrainedModel], config: object) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make(config)


def _qwen_vl(
    tokenizer: PreTrainedTokenizerFast, seed: int, family: str, vision_config: dict[str, object]
) -> tuple[object, PreTrainedModel]:
    """A tiny Qwen2-VL or Qwen2.5-VL (``family``) with ``vision_config`` for its tower: M-RoPE, the Qwen vision
    tokens, 56 to 112 pixels a side."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from grpo_lightning.integrations.vision.processors import image_only_processor

    names = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[family]
    ids = tokenizer.convert_tokens_to_ids
    # M-RoPE: the head's 16 rotary frequency pairs split over (time, height, width).
    rope = {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0}
    config = getattr(transformers, f"{names}Config")(
        text_config=_text_config(tokenizer, rope_parameters=rope),
        vision_config=vision_config,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    # 56 to 112 pixels a side: 4 to 16 image tokens (28-pixel cells after the 2 x 2 merge).
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2)
    processor = image_only_processor(f"{names}Processor", images, tokenizer, chat_template(family))
    return processor, _seeded(seed, getattr(transformers, f"{names}ForConditionalGeneration"), config)


def _qwen2_vl(tokenizer: PreTrainedTokenizerFast, seed: int) -> tuple[object, PreTrainedModel]:
    tower = {
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": _HIDDEN,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return _qwen_vl(tokenizer, seed, "qwen2_vl", tower)


def _llava(tokenizer: PreTrainedTokenizerFast, seed: int) -> tuple[object, PreTrainedModel]:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**_text_config(tokenizer)),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",  # the CLS feature dropped: 2 x 2 = 4 tokens per image
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    images = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=chat_template("llava"),
    )
    return processor, _seeded(seed, LlavaForConditionalGeneration, config)


def _idefics3(tokenizer: PreTrainedTokenizerFast, seed: int) -> tuple[object, PreTrainedModel]:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    config = Idefics3Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
        },
        text_config=LlamaConfig(**_text_config(tokenizer)).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,  # 4 x 4 patches of a 56-pixel tile -> 4 tokens
        tie_word_embeddings=True,
    )
    # Images up to 112 pixels a side, split into 56-pixel tiles (up to 2 x 2) plus the whole image, shrunk.
    images = Idefics3ImageProcessorPil(
        do_image_splitting=True, size={"longest_edge": 112}, max_image_size={"longest_edge": 56}
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=chat_template("idefics3")
    )
    return processor, _seeded(seed, Idefics3ForConditionalGeneration, config)


def _qwen2_5_vl(tokenizer: PreTrainedTokenizerFast, seed: int) -> tuple[object, PreTrainedModel]:
    tower = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": _HIDDEN,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,  # 2 x 2 merged cells a window: an image of 112 pixels has several
        "fullatt_block_indexes": [1],  # block 0 attends within windows, block 1 over the whole image
        "in_channels": 3,
    }
    return _qwen_vl(tokenizer, seed, "qwen2_5_vl", tower)


def _gemma_text(tokenizer: PreTrainedTokenizerFast) -> dict[str, object]:
    # Gemma's heads are sized apart from the hidden size; one sliding-window layer (a window shorter than a
    # prompt), one global.
    return {
        **_text_config(tokenizer),
        "head_dim": _HIDDEN // _HEADS,
        "query_pre_attn_scalar": _HIDDEN // _HEADS,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "bos_token_id": tokenizer.bos_token_id,
    }


def _siglip(image_size: int) -> dict[str, object]:
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": 14,
    }


def _gemma3(tokenizer: PreTrainedTokenizerFast, seed: int) -> tuple[object, PreTrainedModel]:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config = Gemma3Config(
        text_config=_gemma_text(tokenizer),
        vision_config=_siglip(56),
        mm_tokens_per_image=4,  # 4 x 4 patches pooled 2 x 2: 4 soft tokens an image
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
        tie_word_embeddings=True,
    )
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor = Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=chat_template("gemma3"), image_seq_length=4
    )
    model = _seeded(seed, Gemma3ForConditionalGeneration, config)
    # Gemma 3 initialises its image projection to zeros: every image would then be the same zero features.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.1)
    return processor, model


def _paligemma(tokenizer: PreTrainedTokenizerFast, seed: int) -> tuple[object, PreTrainedModel]:
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    images = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    images.image_seq_length = 4  # 2 x 2 patches of 14 pixels
    # The processor adds PaliGemma's location and segmentation tokens to the tokenizer: built first, the model's
    # vocabulary then counts them.
    processor = PaliGemmaProcessor(
        image_processor=images, tokenizer=tokenizer, chat_template=chat_template("paligemma")
    )
    text = {key: value for key, value in _gemma_text(tokenizer).items() if key != "layer_types"}
    config = PaliGemmaConfig(
        text_config={**GemmaConfig(**{**text, "sliding_window": None}).to_dict(), "model_type": "gemma"},
        vision_config={**_siglip(28), "projection_dim": _HIDDEN},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projection_dim=_HIDDEN,
        tie_word_embeddings=True,
    )
    return processor, _seeded(seed, PaliGemmaForConditionalGeneration, config)


_BUILDERS = {
    "qwen2_vl": _qwen2_vl,
    "llava": _llava,
    "idefics3": _idefics3,
    "qwen2_5_vl": _qwen2_5_vl,
    "gemma3": _gemma3,
    "paligemma": _paligemma,
}
