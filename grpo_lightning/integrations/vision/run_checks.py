"""What of a run a vision-language model can use now, refused in one line otherwise (docs/vision.md)."""

from __future__ import annotations

from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.vision.inputs import token_type_rule


def check_vision_run(model_type: str | None, engine: Any, environment: Any) -> None:
    """For a vision-language model (of ``model_type``: the image modality's check, ``integrations/vision/modality.py``),
    refuse an engine that cannot give it its images (``takes_images``) or the token types its forward reads
    (``follows_token_types``), and an agent environment (its agents talk to the
    run's endpoint in text: they never see the images), and a multi-turn environment for a prefix language model
    (PaliGemma: ``integrations/vision/inputs.py: TOKEN_TYPE_RULES``). Multi-turn environments that answer in text
    (``integrations/environments/multiturn.py``: the first prompt holds the images) and a rollout lag (the background
    process builds the vision-language model and its processor) work."""
    if not engine.takes_images:
        raise ConfigError(
            f"data.engine: {engine.name} does not feed images to a vision-language model; set data.engine: "
            "transformers, vllm or vllm_server"
        )
    if token_type_rule(model_type) is not None and not engine.follows_token_types:
        raise ConfigError(
            f"data.engine: {engine.name} is not checked to sample {model_type} with the attention its forward reads "
            "from token_type_ids (bidirectional over images or its prompt); set data.engine: transformers"
        )
    if environment is not None and environment.multi_turn and token_type_rule(model_type) == "prefix":
        raise ConfigError(
            f"data.environment: {model_type} is a prefix language model (its whole prompt attends both ways), and a "
            "multi-turn rollout samples each later turn with the whole context as its prompt while the passes read "
            "the first prompt alone as the prefix; train it single-turn (no data.environment)"
        )
    if environment is not None and not environment.carries_images:  # declared by the rollout kind (rollout/kind.py)
        raise ConfigError(
            "data.environment: an AgentEnvironment's agents call the run's endpoint with text only and never see "
            "a vision-language model's images; use a multi-turn environment (ToolEnvironment, ...) instead"
        )
