"""A model given by a path setting (``model.model_name_or_path``, ``model.teacher.model_name_or_path``): is it there,
whole, and does its tokenizer have what generation needs.

Refused in one line that names the setting (``ConfigError``), before anything loads: a mistyped folder, a
half-copied one (no weights, missing shards, no tokenizer files), a name the Hub cannot give (offline, no such
repository), a tokenizer without an eos token the model config could supply. ``models/build.py`` calls these before
``from_pretrained``; ``load_model_config`` reads a model's config (its context length) the same way.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_lightning.config import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

log = logging.getLogger(__name__)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
POLICY = "model.model_name_or_path"  # the setting that names the policy; a teacher's is model.teacher.<...>


# ------------------------------------------------------------------------------------------------ tokenizer
def fix_special_tokens(
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    eos_token_id: int | list[int] | None = None,
    setting: str = POLICY,
) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` the eos and pad tokens that generation needs, where that is safe; refuse it otherwise.

    A missing eos is taken from the model's own config (``eos_token_id``), a missing pad becomes eos (padding is
    masked out everywhere); both with a warning. ``setting``: the config key that named ``name``, for the error.
    """
    if tokenizer.eos_token is None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        ids = [i for i in ids if isinstance(i, int) and 0 <= i < len(tokenizer)]
        if not ids:
            raise ConfigError(
                f"{setting}: the tokenizer of {name!r} has no eos token and the model config names "
                "none; set tokenizer.eos_token in its tokenizer_config.json"
            )
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(ids[0])
        log.warning("the tokenizer of %r has no eos token: using %r, the model config's", name, tokenizer.eos_token)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        log.warning("the tokenizer of %r has no pad token: padding with eos %r", name, tokenizer.eos_token)
    return tokenizer


def model_eos_token_id(name: str) -> int | list[int] | None:
    """The eos id(s) in ``name``'s model config, without loading the weights; None when it cannot be read."""
    config = _model_config(name)
    return getattr(config, "eos_token_id", None) if config is not None else None


def _model_config(name: str) -> Any:
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name)
    except Exception:  # unreadable here; loading the model reports the problem in its own words
        return None


# ---------------------------------------------------------------------------------------------- model source
# A Hugging Face Hub model name: ``name`` or ``namespace/name`` (``huggingface_hub``'s rule, simplified).
_REPO_ID = re.compile(r"(?!.*(?:--|\.\.))\w(?:[\w.\-]{0,94}\w)?(?:/\w(?:[\w.\-]{0,94}\w)?)?")


def check_model_source(name: str, setting: str = POLICY) -> None:
    """Refuse ``name`` (the value of ``setting``) when it can be neither a local model folder nor a Hub model name.

    ``transformers`` reads the value as a local folder only when that folder exists, and otherwise as a Hub name:
    a mistyped path would end in its traceback about repository ids.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{setting}: the folder {name!r} has no config.json: not a Hugging Face model folder")
        missing = missing_model_files(path)
        if missing:
            raise ConfigError(f"{setting}: the folder {name!r} {missing}")
        return
    if path.exists():
        raise ConfigError(f"{setting}: {name!r} is a file; give the model's folder or a Hub name")
    if not _REPO_ID.fullmatch(name):
        raise ConfigError(f"{setting}: no such local folder {name!r} (nor is it a Hub model name)")


_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken",
)  # fmt: skip


def missing_model_files(folder: Path) -> str | None:
    """What a local model folder lacks to load (weights, the shards its index lists, tokenizer files), as the end
    of a sentence about it; None when it looks complete. Why: ``transformers`` reports a half-copied folder with
    a traceback about Hub repositories, or loads random weights for what it cannot find."""
    indexes = [folder / f"{w}.index.json" for w in _WEIGHT_FILES if (folder / f"{w}.index.json").is_file()]
    if indexes:
        try:
            shards = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return f"has an unreadable weights index {indexes[0].name}: copy it again"
        absent = [shard for shard in shards if not (folder / shard).is_file()]
        if absent:
            return f"lacks {len(absent)} of the {len(shards)} weight shards {indexes[0].name} lists ({absent[0]}, ...)"
    elif not any((folder / w).is_file() for w in _WEIGHT_FILES):
        return "has no weights (model.safetensors, pytorch_model.bin or a sharded *.index.json): copy them too"
    if not any((folder / t).is_file() for t in _TOKENIZER_FILES):
        return "has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json): copy them from the model"
    return None


def model_source_error(name: str, err: OSError, setting: str = POLICY) -> ConfigError:
    """``transformers``' failure to load ``name`` (not found locally nor on the Hub, offline, ...) in one line."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    local = " (there is no local folder of that name either)" if "/" in name else ""
    return ConfigError(f"{setting}: cannot load {name!r}{local}: {first[:300]}")


def load_model_config(name: str, setting: str = POLICY) -> PretrainedConfig:
    """``name``'s model config (no weights), checked as ``check_model_source`` checks a model; a name neither here
    nor on the Hub is one line naming ``setting`` (``model_source_error``), not ``transformers``' traceback."""
    from transformers import AutoConfig

    check_model_source(name, setting)
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as err:
        raise model_source_error(name, err, setting) from err


def config_context_length(config: Any) -> int | None:
    """The longest sequence (prompt + completion) a model config allows; None when it does not say."""
    config = getattr(config, "text_config", None) or config  # multimodal configs nest the language model's
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
