"""Prompts with images to token ids and per-row image inputs, through the model's processor.

``VisionPromptEncoder`` is the ``PromptEncoder`` of a vision-language model: a prompt's messages may hold
``{"type": "text", "text"}`` and ``{"type": "image"}`` parts; the processor's chat template renders them, and the
processor, run on one prompt and its images at a time, expands each image marker into the image's tokens and
makes the image's inputs (``integrations/vision/inputs.py``). The ids are then left-padded together, as the text path
pads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.vision.images import (
    IMAGE_COLUMNS,
    check_image_rows,
    image_parts,
    images_of_rows,
    pil_image,
)
from grpo_lightning.integrations.vision.inputs import VisionRow, row_inputs
from grpo_lightning.integrations.vision.vllm_inputs import sourced
from grpo_lightning.modality import Modality
from grpo_lightning.rollout.prompts import PromptEncoder, is_conversation, prompt_problem

_PART_TYPES = ("text", "image")


def _clean(value: Any) -> Any:
    # A dataset column of messages (or of content parts) is a list of structs: every item has every key any item
    # has, None where it had none; templates test ``part.text is defined``.
    if isinstance(value, Mapping):
        return {key: _clean(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_clean(item) for item in value]
    return value


def parts_problem(prompt: Any) -> str | None:
    """Why ``prompt`` is not a prompt of text and image parts (or a plain one), or None."""
    if not is_conversation(prompt):
        return prompt_problem(prompt)
    plain = []
    for i, message in enumerate(prompt):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind not in _PART_TYPES or (kind == "text" and not isinstance(part.get("text"), str)):
                    return (
                        f"message {i} of the prompt has a content part {part!r}: a part is {{type: text, text}} or "
                        "{type: image}"
                    )
            message = {**message, "content": ""}
        plain.append(message)
    return prompt_problem(plain)


class VisionPromptEncoder(PromptEncoder):
    """A ``PromptEncoder`` for a vision-language model: prompts with image parts, encoded with their images."""

    continues_token_exact = False  # each turn prefilled whole, with its images (the cache holds M-RoPE offsets)

    def __init__(
        self, tokenizer: Any, modality: Modality, use_chat_template: bool | str | None = "auto", **kwargs: Any
    ):
        """``modality``: the model's image modality (``integrations/vision/modality.py``: its processor); ``tokenizer``
        the processor's tokenizer. The chat settings are ``PromptEncoder``'s; the processor's chat template renders the
        prompts."""
        processor = modality.processor
        if use_chat_template in (None, "auto") and getattr(processor, "chat_template", None):
            use_chat_template = True
        if use_chat_template is True and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = processor.chat_template  # the check below reads the tokenizer's
        super().__init__(tokenizer, use_chat_template, modality=modality, **kwargs)
        if not self.use_chat_template:
            raise ConfigError(
                "data.use_chat_template: a vision-language model's prompts are rendered with its processor's chat "
                "template (it places the images); set it to auto or true"
            )
        self.processor = processor
        self._image_tokens: dict[tuple[int, int], int] = {}  # image size → tokens beyond its marker

    def prompt_problem(self, prompt: Any) -> str | None:
        return parts_problem(prompt)

    def messages(self, prompt: Any) -> list[dict[str, Any]]:
        return _clean(super().messages(prompt))

    def render(self, prompt: Any, tools: list[dict[str, Any]] | None = None) -> str:
        """The text the processor is given for one prompt: its chat template applied, an image marker per image;
        ``tools``: function schemas the template lists (an environment's, ``PromptEncoder.render``)."""
        messages = self.messages(prompt)
        prefilled = messages[-1]["role"] == "assistant"
        renderer = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        return renderer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=not prefilled,
            continue_final_message=prefilled,
            **self.chat_template_kwargs,
            **({"tools": tools} if tools else {}),
        )

    def check_rows(self, data: Any, where: str) -> None:
        """The prompts (``PromptEncoder.check_rows``) and their images (``integrations/vision/images.py:
        check_image_rows``); a prompt without an image is refused for a processor that takes none (PaliGemma's)."""
        super().check_rows(data, where)
        check_image_rows(data, where)
        text_only = next((row for row, prompt in enumerate(data["prompt"]) if not image_parts(prompt)), None)
        if text_only is not None and not self._takes_text_only():
            raise ConfigError(
                f"{where} row {text_only}: a prompt without an image, which {type(self.processor).__name__} does not "
                "take (every prompt of this model needs one); give the row an image or leave it out"
            )

    def _takes_text_only(self) -> bool:
        """Whether the processor encodes a prompt without an image."""
        try:
            self.processor(text=["?"], return_tensors="pt", add_special_tokens=False)
        except ValueError:
            return False
        return True

    def text_inputs(self, text: str, images: list[Any]) -> tuple[list[int], VisionRow]:
        """One rendered prompt ``text`` and its ``images`` through the processor: its token ids, each image marker
        expanded into the image's tokens, and its image inputs (on the CPU; empty without images)."""
        output = self.processor(
            text=[text],
            images=[images] if images else None,
            return_tensors="pt",
            add_special_tokens=not self.use_chat_template,
        )
        ids = output["input_ids"][0].tolist()
        # the images and the ids before expansion kept beside: what vLLM takes (integrations/vision/vllm_inputs.py)
        return ids, sourced(row_inputs(output), images, self.text_token_ids([text])[0], ids)

    def trajectory_ids(self, prompt: Any, tools: list[dict[str, Any]] | None, row: Mapping[str, Any]) -> list[int]:
        """A multi-turn trajectory's own prompt (an environment's, ``PromptEncoder.trajectory_ids``), each image
        marker expanded for its dataset ``row``'s images (their inputs are the row's prompt's: the same images)."""
        return self.trajectory_inputs(prompt, tools, row)[0]

    def trajectory_inputs(
        self, prompt: Any, tools: list[dict[str, Any]] | None, row: Mapping[str, Any]
    ) -> tuple[list[int], VisionRow]:
        """``trajectory_ids`` and the trajectory's image inputs: the row's prompt's tensors, with this prompt's own
        ids kept beside (unexpanded and expanded: a vLLM engine is given the trajectory's context as this prompt
        written unexpanded and what follows it, ``integrations/vision/vllm_inputs.py: engine_prompts``)."""
        images = images_of_rows({name: [value] for name, value in row.items()})[0]
        return self.text_inputs(self.render(prompt, tools), images)

    def rendered_lengths(self, rendered: list[str], data: Any) -> list[int]:
        """Each row's prompt length as the model reads it: its text's tokens, plus what the processor expands each
        image marker into beyond the marker (a Qwen2-VL image of 112 × 112 pixels is 16 tokens, not one).

        The expansion depends on the image's size alone, so the processor runs once per size seen (on a blank image
        of it), not once per row: the check before training stays a tokenization of the text. A processor that does
        not expand its ``image_token`` alone (one that marks images with other text) has each row encoded whole."""
        columns = list(data.column_names) if hasattr(data, "column_names") else list(data)
        rows = {name: list(data[name]) for name in ("prompt", *IMAGE_COLUMNS) if name in columns}
        lengths, images = super().rendered_lengths(rendered, data), images_of_rows(rows)
        try:
            return [n + sum(self.image_tokens(i.size) for i in row) for n, row in zip(lengths, images)]
        except (AttributeError, ValueError):  # no image_token, or one the processor does not expand by itself
            return [len(self.text_inputs(text, row)[0]) for text, row in zip(rendered, images)]

    def image_tokens(self, size: tuple[int, int]) -> int:
        """How many tokens one image of ``size`` (width, height) adds to its prompt beyond its marker."""
        if size not in self._image_tokens:
            marker = self.processor.image_token
            expanded = self.processor(
                text=[marker], images=[[pil_image().new("RGB", size)]], return_tensors="pt", add_special_tokens=False
            )["input_ids"][0]
            self._image_tokens[size] = len(expanded) - len(
                self.tokenizer(marker, add_special_tokens=False)["input_ids"]
            )
        return self._image_tokens[size]

    def encode_rows(
        self, rows: Mapping[str, list[Any]], device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor, list[VisionRow]]:
        """``(input_ids, attention_mask)`` ``[B, P]`` left-padded, image tokens expanded, and each row's image
        inputs (on the CPU; empty for a text-only row)."""
        ids, vision = [], []
        for text, images in zip(self.texts(list(rows["prompt"])), images_of_rows(rows)):
            row_ids, inputs = self.text_inputs(text, images)
            ids.append(torch.tensor(row_ids, dtype=torch.long))
            vision.append(inputs)
        width = max(len(row) for row in ids)
        prompt_ids = torch.full((len(ids), width), self.tokenizer.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            prompt_ids[i, width - len(row) :] = row
            prompt_mask[i, width - len(row) :] = 1
        return prompt_ids.to(device), prompt_mask.to(device), vision

    def encode(self, prompts: list[Any], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """Prompts without images (``encode_rows`` encodes a round's, with theirs)."""
        prompt_ids, prompt_mask, _ = self.encode_rows({"prompt": prompts}, device)
        return prompt_ids, prompt_mask
