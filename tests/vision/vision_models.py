"""Tiny vision-language models and image prompts for the tests of tests/vision (built in code, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from grpo_lightning.integrations.vision.encoder import VisionPromptEncoder
from grpo_lightning.integrations.vision.modality import ImageModality
from grpo_lightning.integrations.vision.processors import load_processor
from grpo_lightning.integrations.vision.tiny import VLM_FAMILIES, build_tiny_vlm

COLOURS = ("red", "green", "blue", "yellow")


def squares(count: int, colour: str = "red", size: tuple[int, int] = (84, 56)) -> Image.Image:
    """A white image with ``count`` coloured squares in a row (the counting task's images)."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for i in range(count):
        draw.rectangle([4 + 14 * i, 20, 14 + 14 * i, 30], fill=colour)
    return image


def image_prompt(text: str, images: int) -> list[dict]:
    """A one-message conversation: ``images`` image parts, then ``text``."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]}]


def build_all(folder: Path) -> dict[str, Path]:
    """Every tiny family, each in its own sub-folder of ``folder``."""
    return {family: build_tiny_vlm(family, folder / family) for family in VLM_FAMILIES}


_BUILT: dict[str, Path] = {}


def shared_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny family's folder, built once per process however many test files ask (their ``tiny_vlms``
    fixtures call this)."""
    if not _BUILT:
        _BUILT.update(build_all(tmp_path_factory.mktemp("vlms")))
    return dict(_BUILT)


def encoder_for(path: Path) -> VisionPromptEncoder:
    """The prompt encoder of the tiny model at ``path`` (its processor, left padding)."""
    processor = load_processor(str(path))
    processor.tokenizer.padding_side = "left"
    return ImageModality(str(path), processor).prompt_encoder(processor.tokenizer, "auto")
