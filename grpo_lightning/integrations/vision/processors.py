"""A vision-language model's processor: loaded with ``AutoProcessor``, or, where the processor class also wants a
video processor that cannot load here, built for images alone.

transformers' video processors (Qwen2-VL's, Qwen2.5-VL's, ...) need torchvision; the CPU build of torch this
project tests on has none that loads. GRPO here trains on images, so such a processor is built with an empty video
slot: its image processor (the PIL one), tokenizer and chat template, exactly as ``AutoProcessor`` would load them.
With torchvision installed, ``AutoProcessor`` loads the processor whole and this fallback is never taken.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import transformers
from transformers.utils import is_torchvision_available

_VIDEO = "video_processor"


@functools.cache
def _image_only_class(processor_class: str) -> type:
    base = getattr(transformers, processor_class)

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        """``processor_class`` with no video processor (it would need torchvision)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == _VIDEO and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> Any:
            # Saved as the class it stands for, which loads it whole wherever torchvision is installed.
            self.image_processor.save_pretrained(save_directory)
            self.tokenizer.save_pretrained(save_directory)
            folder = Path(save_directory)
            (folder / "chat_template.jinja").write_text(self.chat_template or "")
            (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=2))
            return [str(folder / "processor_config.json")]

        def __reduce__(self) -> tuple[Any, ...]:
            # A class made here is not importable by its name: pickled (the background process of
            # ``data.schedule.rollout_lag`` receives it) as this factory's class, made anew, and the object's own state.
            return _new_image_only, (processor_class,), self.__dict__

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class
    return ImageOnly


def _new_image_only(processor_class: str) -> Any:
    """An empty ``ImageOnly`` of ``processor_class``, for unpickling (its state is set after)."""
    cls = _image_only_class(processor_class)
    return cls.__new__(cls)


def image_only_processor(processor_class: str, image_processor: Any, tokenizer: Any, chat_template: str | None) -> Any:
    """``transformers.<processor_class>`` built from its image processor and tokenizer, with no video processor."""
    return _image_only_class(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template
    )


def load_processor(name: str) -> Any:
    """``AutoProcessor.from_pretrained(name)``; where its class wants a video processor that cannot load (no
    torchvision), the same processor for images alone (``image_only_processor``)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(name)
    except (AttributeError, ImportError, ValueError):  # transformers' words for the video processor it lacks
        processor_class = _processor_class(name)
        wants_video = processor_class is not None and _VIDEO in getattr(transformers, processor_class).get_attributes()
        if not wants_video or is_torchvision_available():
            raise  # another failure: its own words
    template = Path(name) / "chat_template.jinja"
    return image_only_processor(
        processor_class,
        AutoImageProcessor.from_pretrained(name),
        AutoTokenizer.from_pretrained(name),
        template.read_text() if template.is_file() else None,
    )


def _processor_class(name: str) -> str | None:
    for file in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = Path(name) / file
        if path.is_file():
            value = json.loads(path.read_text()).get("processor_class")
            if isinstance(value, str) and hasattr(transformers, value):
                return value
    return None
