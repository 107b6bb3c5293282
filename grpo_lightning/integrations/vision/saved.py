"""A round's images and image inputs as plain data, for a checkpoint that ``torch.load(weights_only=True)`` reads.

At a rollout lag the checkpoint holds the rounds sampled ahead (``rollout/schedule.py``), and with them each row's
image inputs (``RolloutBatch.vision``: ``SourcedRow``, a ``dict`` subclass carrying the row's PIL images and token
ids) and its images for the logs (``RolloutBatch.images``). Lightning loads checkpoints with ``weights_only=True``,
which unpickles builtins and tensors only: those are saved as dicts, lists, tensors and PNG bytes (lossless: the
same pixels come back, so an engine that runs the processor again, vLLM, encodes them as before the stop), and made
into the same objects when loaded.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from grpo_lightning.integrations.vision.images import pil_image
from grpo_lightning.integrations.vision.vllm_inputs import SourcedRow


def image_bytes(image: Any) -> bytes:
    """``image`` (PIL) as PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_from_bytes(data: bytes) -> Any:
    """The PIL image of ``image_bytes``' output, decoded (in its mode: RGB as read, ``images.py: load_image``)."""
    with pil_image().open(io.BytesIO(data)) as image:
        return image.copy()  # a plain image, its pixels read


def plain_images(images: Sequence[Sequence[Any]]) -> list[list[bytes]]:
    """Each row's images (``RolloutBatch.images``) as PNG bytes."""
    return [[image_bytes(image) for image in row] for row in images]


def images_from_plain(plain: Sequence[Sequence[bytes]]) -> list[list[Any]]:
    """``plain_images``' rows as PIL images again."""
    return [[image_from_bytes(data) for data in row] for row in plain]


def plain_vision(rows: Sequence[Mapping[str, Tensor]]) -> list[dict[str, Any]]:
    """Each row's image inputs (``RolloutBatch.vision``) as ``{"inputs", "images", "prompt_ids", "expanded_ids"}``:
    its tensors, and what a ``SourcedRow`` keeps beside them (PNG bytes, token ids; empty or None for a plain row)."""
    saved = []
    for row in rows:
        source = row if isinstance(row, SourcedRow) else SourcedRow(row)
        saved.append(
            {
                "inputs": dict(row),
                "images": [image_bytes(image) for image in source.images],
                "prompt_ids": source.prompt_ids,
                "expanded_ids": source.expanded_ids,
            }
        )
    return saved


def vision_from_plain(plain: Sequence[Mapping[str, Any]]) -> list[SourcedRow]:
    """``plain_vision``'s rows as ``SourcedRow`` again (a plain row's: without images or ids, as it was)."""
    return [
        SourcedRow(
            row["inputs"], [image_from_bytes(data) for data in row["images"]], row["prompt_ids"], row["expanded_ids"]
        )
        for row in plain
    ]
