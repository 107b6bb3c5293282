"""LoRA adapters (through PEFT): train low-rank adapters only, with the base weights frozen.

With LoRA the reference model costs no memory: π_ref is the policy with its adapter switched off
(``GRPOModule.reference_model``), since the adapter starts at zero and the base weights never change. Merged
weights for export come from ``policy.merge_and_unload()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from grpo_lightning.config import ConfigError


@dataclass
class LoraConfig:
    """LoRA settings (``model.lora``); PEFT's ``LoraConfig`` options of the same names."""

    r: int = 16
    """Rank of the adapters."""
    alpha: float = 32.0
    """Scale: the adapter's output is multiplied by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapters' input; set to 0 with the rest of the model's under ``model.disable_dropout`` (GRPO's
    default: the update must compute the π that sampled), so it acts only where dropout is kept (SFT's default)."""
    target_modules: str | list[str] = "all-linear"
    """Layers that get adapters: ``all-linear`` (every linear layer but the output layer) or a list of names."""
    modules_to_save: list[str] = field(default_factory=list)
    """Layers trained in full next to the adapters (e.g. ``[lm_head]``); they then need a copy each. On a model
    whose output layer shares the input embedding (tied), naming either trains the one shared copy."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"model.lora.r must be >= 1 (got {self.r})")
        if self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha must be > 0 (got {self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be in [0, 1) (got {self.dropout})")


def apply_lora(model: nn.Module, config: LoraConfig, exclude: str | None = None) -> nn.Module:
    """``model`` wrapped by PEFT with LoRA adapters; only the adapters (and ``modules_to_save``) require grad.
    ``exclude``: a regular expression of module names that get none (a frozen vision tower's)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as err:
        raise ConfigError("model.lora needs PEFT: pip install 'grpo_lightning[lora]'") from err
    tying = {}
    if config.modules_to_save and _ties_embeddings(model):
        # Without it PEFT trains a copy of lm_head apart from embed_tokens: the model is untied while its config
        # still says tied, so vLLM (which skips lm_head.weight for tied models) and a saved folder lose the copy.
        if "ensure_weight_tying" not in getattr(PeftLoraConfig, "__dataclass_fields__", {}):
            raise ConfigError(
                "model.lora.modules_to_save on a model with tied word embeddings needs a PEFT that keeps them tied "
                "(ensure_weight_tying): pip install -U peft"
            )
        tying["ensure_weight_tying"] = True
    peft_config = PeftLoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=config.target_modules,
        modules_to_save=list(config.modules_to_save) or None,
        task_type="CAUSAL_LM",
        **tying,
        **({"exclude_modules": exclude} if exclude else {}),
    )
    return get_peft_model(model, peft_config)


def _ties_embeddings(model: nn.Module) -> bool:
    """Whether the output layer's weight is the input embedding's (``tie_word_embeddings``)."""
    try:
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    return output is not None and embedding is not None and output.weight is embedding.weight


def is_peft_model(model: nn.Module | None) -> bool:
    """Whether ``model`` carries PEFT adapters (and so has ``disable_adapter()`` and ``merge_and_unload()``)."""
    return model is not None and callable(getattr(model, "disable_adapter", None))
