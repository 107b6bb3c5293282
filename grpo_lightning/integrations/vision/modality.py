"""The image modality: a vision-language model's ``Modality`` (``grpo_lightning/modality.py``), a plug-in.

Claimed for a model whose config names an ``AutoModelForImageTextToText`` architecture (``integrations/vision/models.py:
is_vision_model``). It holds the model's processor (loaded with its tokenizer, never carried on the tokenizer), and
says, through the contract, what the rest of the package does with images: the prompt encoder
(``integrations/vision/encoder.py``), each row's image inputs joined per forward and ``generate()``
(``integrations/vision/inputs.py``), the vision tower frozen and kept in FSDP's root unit
(``integrations/vision/models.py``), the processor saved beside the weights, the rounds' images in a checkpoint
(``integrations/vision/saved.py``), and what a run with images cannot do yet (``integrations/vision/run_checks.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.vision import inputs, models, saved
from grpo_lightning.integrations.vision.run_checks import check_vision_run
from grpo_lightning.modality import Modality, Rows


class ImageModality(Modality):
    """The ``Modality`` of one vision-language model (``name``: its folder or Hub name)."""

    name = "image"
    has_row_inputs = True

    def __init__(self, model_name: str | None, processor: Any = None) -> None:
        """``processor``: the model's, when loaded already (else loaded with the tokenizer, or at first use).
        ``model_name`` None: no model's own (``IMAGES``)."""
        self.model_name = model_name
        self.model_type = models.vision_model_type(model_name)
        self._processor = processor

    @classmethod
    def for_model(cls, name: str) -> ImageModality | None:
        return cls(name) if models.is_vision_model(name) else None

    @property
    def processor(self) -> Any:
        """The model's processor (``integrations/vision/processors.py: load_processor``)."""
        if self._processor is None:
            from grpo_lightning.integrations.vision.processors import load_processor

            self._processor = load_processor(self.model_name)
        return self._processor

    # ---------------------------------------------------------------------------------------------- loading
    def load_tokenizer(self, name: str) -> Any:
        """The processor's tokenizer (``integrations/vision/models.py: load_vision_processor``: the model's inputs
        checked); the processor is kept here."""
        self._processor = models.load_vision_processor(name)
        return self._processor.tokenizer

    def load_model(self, name: str, dtype: Any) -> nn.Module:
        return models.load_vision_model(name, dtype)

    def model_from_config(self, config: Any, dtype: Any) -> nn.Module:
        return models.model_from_config(config, dtype)

    def prompt_encoder(self, tokenizer: Any, use_chat_template: Any, **settings: Any) -> Any:
        from grpo_lightning.integrations.vision.encoder import VisionPromptEncoder

        return VisionPromptEncoder(tokenizer, self, use_chat_template, **settings)

    def saved_processor(self, tokenizer: Any) -> Any:
        """The processor whole (its image processor's settings, chat template and tokenizer: ``AutoProcessor``
        reloads it)."""
        return self.processor

    # ------------------------------------------------------------------------------------------ the model
    def freeze(self, model: nn.Module) -> int:
        return models.freeze_vision_tower(model)

    def lora_exclude(self, frozen: bool) -> str | None:
        return models.vision_tower_pattern() if frozen else None

    def root_modules(self, model: nn.Module) -> list[nn.Module]:
        return models.vision_towers(model)

    # ------------------------------------------------------------------------------------------------ rows
    def forward_inputs(
        self, model: nn.Module, rows: Rows, input_ids: Tensor, attention_mask: Tensor, *, prompt_width: int
    ) -> dict[str, Tensor]:
        return inputs.forward_inputs(model, rows, input_ids, attention_mask, prompt_width=prompt_width)

    def generation_inputs(self, model: nn.Module, rows: Rows, input_ids: Tensor) -> dict[str, Tensor]:
        return inputs.generation_inputs(model, rows, input_ids)

    def suppressed_tokens(self, model: nn.Module) -> list[int]:
        return inputs.placeholder_token_ids(model)

    def check_pass(self, model: nn.Module, completion_ids: Tensor, completion_mask: Tensor, pack_tokens: Any) -> None:
        if pack_tokens is not None:
            inputs.packing_off(pack_tokens)
        inputs.check_completions(model, completion_ids, completion_mask)

    def logged_images(self, rows: Rows) -> list[list[Any]]:
        """Each row's prompt images, as the encoder read them (``SourcedRow.images``: not decoded again)."""
        return [list(row.images) for row in rows]

    def plain_rows(self, rows: Rows, images: Sequence[Sequence[Any]]) -> dict[str, Any]:
        return {"vision": saved.plain_vision(rows), "images": saved.plain_images(images)}

    @classmethod
    def rows_from_plain(cls, plain: Mapping[str, Any]) -> dict[str, list[Any]]:
        return {
            "vision": saved.vision_from_plain(plain.get("vision", [])),
            "images": saved.images_from_plain(plain.get("images", [])),
        }

    # ---------------------------------------------------------------------------------------------- checks
    def check_run(self, engine: Any, environment: Any) -> None:
        check_vision_run(self.model_type, engine, environment)

    def check_teacher(self, teacher: Modality, name: str) -> None:
        """A text teacher is refused (read from its config: no model loads), and a vision-language teacher whose
        processor encodes an image prompt otherwise than the student's (``integrations/vision/model_inputs.py:
        same_encoding``: it is given the student's ids and image inputs)."""
        if not isinstance(teacher, ImageModality):
            raise ConfigError(
                f"model.teacher.model_name_or_path {name!r} is a text model and model.model_name_or_path a "
                "vision-language one: the teacher would score the image placeholders without the images; give a "
                "vision-language teacher with the student's processor"
            )
        from grpo_lightning.integrations.vision.model_inputs import same_encoding

        differs = same_encoding(self.processor, teacher.processor)
        if differs is not None:
            raise ConfigError(
                f"model.teacher.model_name_or_path {name!r}: its processor encodes an image prompt otherwise than the "
                f"student's ({differs}); the teacher is given the student's image inputs: give it the student's "
                "image-processor settings"
            )


IMAGES = ImageModality(None)
"""The image modality without a model of its own: its rows and passes (which read the model they are given), for
code that holds a vision-language model but not its name (tests, tools)."""
