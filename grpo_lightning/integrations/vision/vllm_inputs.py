"""What vLLM takes of a vision-language prompt: its images and its token ids with every image placeholder once.

vLLM runs the model's processor itself: a request is the prompt's token ids with each image written as its bare
placeholder (Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA's and Idefics3's ``<image>``) and
the images themselves (``multi_modal_data={"image": [PIL, ...]}``); vLLM expands each placeholder into the image's
tokens from the image's size. Ids the model's processor already expanded must not be sent (TRL's open SmolVLM
bug): vLLM would look for a placeholder per image in ids that hold dozens.

The prompt encoder (``integrations/vision/encoder.py``) therefore keeps, beside each row's processor outputs
(``RolloutBatch .vision``), the row's images and its ids before the expansion (``SourcedRow``). The rest of the run
reads the expanded ids (the trainer's forward, the context checks): vLLM's expansion of each prompt is compared with
them (``expansion_mismatch``), so the engine and the trainer never see different prompts.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from PIL import Image

# The logit bias vLLM gives an image placeholder while sampling (its largest, -100: its sampler takes no -inf): a
# completion holding one would make the trainer's forward look for an image it stands for. With logits of
# ordinary size its probability is then below 1e-40, so the sampling log-probs are the policy's renormalised over
# the other tokens, as the transformers engine's suppression gives.
PLACEHOLDER_BIAS = -100.0


class SourcedRow(dict):
    """One prompt's image inputs (a ``integrations/vision/inputs.py`` ``VisionRow``: the processor's tensors, joined per
    forward as any row's) that also keeps the prompt's ``images``, its token ids before the processor expanded the image
    placeholders (``prompt_ids``) and after (``expanded_ids``): what an engine that runs the processor itself
    (vLLM) is given.

    The extra fields are attributes, not keys, so every consumer of a ``VisionRow`` sees the same tensors.
    """

    def __init__(
        self,
        inputs: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]] = (),
        images: Sequence[Image.Image] = (),
        prompt_ids: Sequence[int] | None = None,
        expanded_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__(inputs)
        self.images = list(images)
        self.prompt_ids = None if prompt_ids is None else [int(token) for token in prompt_ids]
        self.expanded_ids = None if expanded_ids is None else [int(token) for token in expanded_ids]


def sourced(
    inputs: Mapping[str, Tensor], images: Sequence[Image.Image], prompt_ids: Sequence[int], expanded_ids: Sequence[int]
) -> SourcedRow:
    """``inputs`` (a row's processor outputs) with the row's ``images``, its unexpanded ``prompt_ids`` and the
    processor's ``expanded_ids`` kept beside."""
    return SourcedRow(inputs, images, prompt_ids, expanded_ids)


def image_token_id(config: Any) -> int | None:
    """The id a model's config reads as the image placeholder (``image_token_id``, LLaVA's older
    ``image_token_index``), or None."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def engine_prompts(
    prompts: Sequence[Sequence[int]], vision: Sequence[Mapping[str, Any]], image_token: int | None
) -> list[dict[str, Any]]:
    """vLLM's prompt of each row (``{"prompt_token_ids": ids, "multi_modal_data": {"image": [PIL, ...]}}``, no
    ``multi_modal_data`` for a text-only row): the row's current context ``prompts`` (the processor's expansion,
    as the trainer reads it) with its encoded prompt written unexpanded, and its images, from its ``SourcedRow``.
    A context that goes on after the encoded prompt (a later turn of a multi-turn rollout) keeps its further
    tokens: they are text.

    Raises ``ValueError`` for a row that does not carry them (image inputs made elsewhere than by the prompt
    encoder), whose context does not start with the prompt its images were encoded with, or whose ids hold another
    number of placeholders (``image_token``) than it has images: vLLM's processor would fail on it far from the
    cause, or expand the wrong number of images.
    """
    requests = []
    for row, (context, inputs) in enumerate(zip(prompts, vision)):
        ids, expanded = getattr(inputs, "prompt_ids", None), getattr(inputs, "expanded_ids", None)
        if ids is None or expanded is None:
            raise ValueError(
                f"prompt row {row} carries no images and unexpanded token ids for vLLM: give the engine the image "
                "inputs the prompt encoder made (VisionPromptEncoder.encode_rows)"
            )
        if list(context[: len(expanded)]) != expanded:
            raise ValueError(f"prompt row {row} does not start with the prompt its images were encoded with")
        ids = ids + list(context[len(expanded) :])
        images = list(inputs.images)
        if image_token is not None and ids.count(image_token) != len(images):
            raise ValueError(
                f"prompt row {row} has {ids.count(image_token)} image placeholder(s) in its unexpanded ids for "
                f"{len(images)} image(s)"
            )
        request: dict[str, Any] = {"prompt_token_ids": ids}
        if images:
            request["multi_modal_data"] = {"image": images}
        requests.append(request)
    return requests


def expansion_mismatch(expected: Sequence[Sequence[int]], expanded: Sequence[Sequence[int] | None]) -> str | None:
    """Why vLLM's expanded prompts (``expanded``, one per row; None: not reported) are not the ids the trainer
    reads (``expected``: the processor's expansion), or None when they are.

    Both run the same processor on the same images, so they agree unless vLLM loaded other processor settings
    (an image size, tiling): then the engine would sample for one prompt and the trainer score another.
    """
    for row, (ours, theirs) in enumerate(zip(expected, expanded)):
        if theirs is None or list(theirs) == list(ours):
            continue
        return (
            f"vLLM expanded prompt row {row}'s images into {len(theirs)} tokens where the model's processor gives "
            f"{len(ours)} (or other tokens): vLLM read other image-processor settings from the model folder than "
            "the trainer's processor has"
        )
    return None


def placeholder_bias(token_ids: Iterable[int]) -> dict[int, float]:
    """vLLM's ``logit_bias`` that keeps the image placeholders ``token_ids`` out of completions
    (``PLACEHOLDER_BIAS``)."""
    return {int(token): PLACEHOLDER_BIAS for token in token_ids}


def image_data_url(image: Image.Image) -> str:
    """``image`` as a ``data:image/png;base64,...`` URL (lossless: the server decodes the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def content_parts(images: Sequence[Image.Image]) -> list[dict[str, str]]:
    """The ``content_parts`` of a ``/inference/v1/generate`` request for ``images``, in order."""
    return [{"type": "image_url", "url": image_data_url(image)} for image in images]


# ------------------------------------------------------------------------------------------ vLLM servers
GENERATE_ROUTE = "/inference/v1/generate"
"""vLLM's token-in / token-out route (``vllm serve --enable-scale-out``): the one of vLLM 0.32's server that takes a
prompt's token ids together with its images (``content_parts``); ``/v1/completions`` takes ids or text without
images, ``/v1/chat/completions`` images with text only."""


def generate_body(model: str, prompt: Mapping[str, Any], sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The ``GENERATE_ROUTE`` request of one prompt (an ``engine_prompts`` entry): its unexpanded ids, its images
    as data URLs, vLLM's ``sampling`` settings, and the expanded prompt asked back (``expansion_mismatch``)."""
    body: dict[str, Any] = {
        "model": model,
        "token_ids": list(prompt["prompt_token_ids"]),
        "sampling_params": dict(sampling),
        "return_token_ids": True,
    }
    images = prompt.get("multi_modal_data", {}).get("image", [])
    if images:
        body["content_parts"] = content_parts(images)
    return body


def generated_rows(answer: Mapping[str, Any], logprobs: bool) -> list[tuple[list[int], list[float]]]:
    """Each choice of a ``GENERATE_ROUTE`` answer, in order: its token ids and (``logprobs``) their log-probs."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [
        (list(c["token_ids"]), [step["logprob"] for step in c["logprobs"]["content"]] if logprobs else [])
        for c in choices
    ]
