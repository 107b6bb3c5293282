"""What of a run a vision-language model can use now, refused in one line otherwise (docs/vision.md)."""

from __future__ import annotations

from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.vision.models import processor_of


def check_vision_run(tokenizer: Any, engine: Any, environment: Any, rollout_lag: int = 0) -> None:
    """For a vision-language model (its ``tokenizer`` carries a processor; nothing for a text model's), refuse an
    engine that cannot give it its images (``takes_images``), multi-turn rollouts and a rollout lag (the
    background process builds a text model)."""
    if processor_of(tokenizer) is None:
        return
    if not getattr(engine, "takes_images", False):
        raise ConfigError(
            f"data.engine: {engine.name} does not feed images to a vision-language model yet; set data.engine: "
            "transformers"
        )
    if environment is not None:
        raise ConfigError("data.environment: multi-turn rollouts with a vision-language model are not supported yet")
    if rollout_lag:
        raise ConfigError("data.rollout_lag: a lag with a vision-language model is not supported yet; set it to 0")
