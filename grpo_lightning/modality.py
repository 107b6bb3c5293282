"""What a modality adds to a row, declared once: the contract every consumer of a row goes through.

A row of a rollout is its token ids; a modality may add per-row inputs beyond them (a vision-language model's image
inputs). ``Modality`` says, for one model, everything the rest of the package needs of them: how the model and its
tokenizer load, the prompt encoder that makes the rows (and their inputs), how the inputs are repeated for a group
and given to every forward (the policy's passes, π_ref's, the teacher's) and to ``generate()``, which tokens a
completion must never hold, what stays in FSDP's root unit, what is frozen, what is saved beside the weights, how
a round's rows are written into a checkpoint, and which runs it cannot train (refused in one line).

``TEXT`` is the text modality: nothing beyond the ids, and every method does what the text path does. Other
modalities are plug-ins: ``MODALITY_PLUGINS`` maps a name to a ``"module:Class"`` path (``plugins.load_plugin``),
and the class's ``for_model(name)`` answers whether a model (a folder or Hub name) is its own, from the model's
config. ``modality_for`` asks each in turn when the policy loads; the core imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from grpo_lightning.errors import ConfigError
from grpo_lightning.plugins import load_plugin

Rows = Sequence[Mapping[str, Tensor]]
"""Each row's inputs beyond its token ids (a dict of tensors per row, on the CPU; empty without any)."""


def mask_positions(attention_mask: Tensor) -> Tensor:
    """Position ids of left-padded sequences from their attention mask (padding gets 0, as in ``transformers``'
    generation): the text modality's position input, which the lean forward and decoder use too."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class Modality:
    """The text modality, and the contract of every other: override what the modality adds (class attributes are
    declarations; their defaults are the text path's).

    To add a modality: subclass it, set ``name`` (and ``has_row_inputs`` when rows carry inputs beyond their ids),
    implement ``for_model`` to claim the models that are yours, override the methods whose text behaviour does not
    fit, and register the class's path with ``register_modality``. When a policy loads, ``modality_for`` asks each
    plug-in of ``MODALITY_PLUGINS`` in turn; the first that claims the model is its modality, else ``TEXT``.
    """

    name: str = "text"
    """The modality's name in ``MODALITY_PLUGINS`` (a checkpoint's rounds saved ahead name it)."""
    has_row_inputs: bool = False
    """Rows carry inputs beyond their token ids (``Rows``): every pass then runs the model's own forward, padded
    (the lean forward and packing take ids alone), with ``forward_inputs``; an engine must declare
    ``takes_row_inputs`` (or what ``check_run`` asks of it) to sample such rows."""

    @classmethod
    def for_model(cls, name: str) -> Modality | None:
        """This modality for the model ``name`` (a folder or Hub name), or None when the model is not its own
        (read from the model's config, before any weights load). The text modality is everyone's fallback."""
        return None

    # ---------------------------------------------------------------------------------------------- loading
    def load_tokenizer(self, name: str) -> Any:
        """The tokenizer of the model ``name`` (``models/build.py: load_tokenizer`` fixes its padding and specials)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)

    def load_model(self, name: str, dtype: Any) -> nn.Module:
        """The model ``name`` in ``dtype``, with its weights."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)

    def model_from_config(self, config: Any, dtype: Any) -> nn.Module:
        """A randomly initialised model of ``config`` in ``dtype`` (the background process of
        ``data.schedule.rollout_lag`` builds the policy's architecture this way, then takes its weights)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, dtype=dtype)

    def prompt_encoder(self, tokenizer: Any, use_chat_template: Any, **settings: Any) -> Any | None:
        """This modality's prompt encoder for ``tokenizer`` (a ``rollout/prompts.py: PromptEncoder`` whose
        ``encode_rows`` returns each row's inputs, and whose ``modality`` is this one); None: the text encoder
        (``rollout/prompts.py: prompt_encoder`` makes it)."""
        return None

    def saved_processor(self, tokenizer: Any) -> Any:
        """What writes the model's tokenizer files beside its weights (``save_pretrained``): an exported model's,
        an engine's copy's. The tokenizer itself; a vision-language model's processor whole."""
        return tokenizer

    def save_processor(self, tokenizer: Any, folder: str | Path) -> None:
        """Write ``saved_processor(tokenizer)`` to ``folder``."""
        self.saved_processor(tokenizer).save_pretrained(str(folder))

    # ------------------------------------------------------------------------------------------ the model
    def freeze(self, model: nn.Module) -> int:
        """Freeze what of ``model`` does not train (``model.freeze_vision_tower``); returns how many parameters were
        frozen. Nothing for text."""
        return 0

    def lora_exclude(self, frozen: bool) -> str | None:
        """A regular expression of module names that get no LoRA adapters (``frozen``: ``freeze`` ran), or None."""
        return None

    def root_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose blocks stay in FSDP2's root unit, not sharded as decoder layers (``strategies.py``)."""
        return []

    # ------------------------------------------------------------------------------------------------ rows
    def repeat_rows(self, rows: Rows, times: int) -> list[Mapping[str, Tensor]]:
        """Each row's inputs ``times`` times in a row (the G completions of a prompt share its inputs)."""
        return [row for row in rows for _ in range(times)]

    def forward_inputs(
        self, model: nn.Module, rows: Rows, input_ids: Tensor, attention_mask: Tensor, *, prompt_width: int
    ) -> dict[str, Tensor]:
        """What a forward of ``model`` over ``input_ids`` (left-padded prompts of ``prompt_width`` columns, then
        their completions; ``rows``: their inputs) takes besides the ids and mask: the text path's positions,
        counted over the real tokens."""
        return {"position_ids": mask_positions(attention_mask)}

    def generation_inputs(self, model: nn.Module, rows: Rows, input_ids: Tensor) -> dict[str, Tensor]:
        """What ``model.generate`` takes besides the ids and mask of ``rows`` (left-padded prompts ``input_ids``,
        one per row: the engine repeats them for the group)."""
        return {}

    def suppressed_tokens(self, model: nn.Module) -> list[int]:
        """Token ids a completion must never hold (a sampler suppresses them): none for text."""
        return []

    def check_pass(self, model: nn.Module, completion_ids: Tensor, completion_mask: Tensor, pack_tokens: Any) -> None:
        """Checked before a pass over rows with inputs: completions this modality's forward cannot read."""

    def logged_images(self, rows: Rows) -> list[list[Any]]:
        """Each row's images for the logs' tables (``RolloutBatch.images``): none."""
        return [[] for _ in rows]

    def plain_rows(self, rows: Rows, images: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """A round's ``rows`` and ``images`` as plain data (dicts, lists, tensors, bytes) for a checkpoint that
        ``torch.load(weights_only=True)`` reads; ``rows_from_plain`` makes them again."""
        return {"vision": [dict(row) for row in rows], "images": [list(row) for row in images]}

    @classmethod
    def rows_from_plain(cls, plain: Mapping[str, Any]) -> dict[str, list[Any]]:
        """``plain_rows``' output as ``{"vision": rows, "images": images}`` again."""
        return {"vision": list(plain.get("vision", [])), "images": list(plain.get("images", []))}

    # ---------------------------------------------------------------------------------------------- checks
    def check_run(self, engine: Any, environment: Any) -> None:
        """Refuse (``ConfigError``) an engine or environment that cannot take this modality's rows: an engine that
        does not declare ``takes_row_inputs`` when the rows carry inputs."""
        if self.has_row_inputs and not engine.takes_row_inputs:
            raise ConfigError(
                f"data.engine: {engine.name} does not give the model its {self.name} inputs (each row's "
                f"{self.name} inputs reach generate() through the transformers engine); set data.engine: transformers"
            )

    def check_teacher(self, teacher: Modality, name: str) -> None:
        """Refuse a local teacher ``name`` (of modality ``teacher``) that cannot read this modality's rows as the
        student does: a teacher without this modality when the rows carry inputs."""
        if self.has_row_inputs and type(teacher) is not type(self):
            raise ConfigError(
                f"model.teacher.model_name_or_path {name!r} is a {teacher.name} model and the student a {self.name} "
                f"one: the teacher would score the student's tokens without their {self.name} inputs; give a "
                f"{self.name} teacher"
            )


TextModality = Modality
TEXT = Modality()
"""The text modality: the ids alone."""

MODALITY_PLUGINS: dict[str, str] = {"image": "grpo_lightning.integrations.vision.modality:ImageModality"}
"""Modality plug-ins by name: ``"module:Class"`` of a ``Modality`` subclass (``register_modality`` adds one)."""


def register_modality(name: str, path: str) -> None:
    """Make a ``Modality`` subclass a plug-in: asked, from then on, whether each model loaded is its own
    (``Modality.for_model``), after the plug-ins registered before it.

    Args:
        name: the modality's name (its class's ``name``); not ``"text"``.
        path: ``"module:Class"`` of the subclass, imported only when a model is loaded (``plugins.load_plugin``).

    Raises:
        ValueError: ``name`` is the text modality's.
    """
    if name == TEXT.name:
        raise ValueError(f"{name!r} is the text modality's name")
    MODALITY_PLUGINS[name] = path


def modality_class(name: str) -> type[Modality]:
    """The ``Modality`` class named ``name`` (``"text"``, or a plug-in of ``MODALITY_PLUGINS``)."""
    if name == TEXT.name:
        return Modality
    if name not in MODALITY_PLUGINS:
        known = ", ".join([TEXT.name, *MODALITY_PLUGINS])
        raise ConfigError(f"no modality named {name!r} (known: {known}); register its plug-in (register_modality)")
    return load_plugin(MODALITY_PLUGINS[name])


def modality_for(name: str | None) -> Modality:
    """The modality of the model ``name`` (None: the built-in tiny Llama, text): the first plug-in that claims it
    (``Modality.for_model``), else ``TEXT``."""
    if name is None:
        return TEXT
    for plugin in list(MODALITY_PLUGINS):
        claimed = modality_class(plugin).for_model(name)
        if claimed is not None:
            return claimed
    return TEXT
