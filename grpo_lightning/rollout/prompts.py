"""Prompts: where they come from (``load_prompts``) and how they become token ids (``PromptEncoder``).

Every path that feeds a prompt to the model (the training round, held-out evaluation, SFT's examples, the
up-front length check) encodes it with ``PromptEncoder``, so a prompt is tokenized the same way everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset
from torch import Tensor

from grpo_lightning.config import ConfigError
from grpo_lightning.tasks import is_task, load_task

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_prompts(
    source: str,
    split: str,
    *,
    subset: str | None = None,
    task_kwargs: dict | None = None,
    setting: str = "data.dataset",
) -> Dataset:
    """A built-in task's split, a local jsonl/json/parquet/csv file, or a split of a Hub dataset.

    ``setting`` names the config key that gave ``source``, for error messages.
    """
    if is_task(source):
        splits = load_task(source, **(task_kwargs or {}))
        if split not in splits:
            raise ConfigError(f"task {source!r} has no split {split!r}; it has {', '.join(splits)}")
        return splits[split]
    suffix = Path(source).suffix.lower()
    if suffix in _FILE_FORMATS:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{setting}: no such file {source!r}")
        if path.stat().st_size == 0 or (suffix != ".parquet" and not path.read_text(errors="replace").strip()):
            raise ConfigError(f"{setting}: the file {source!r} is empty; it needs at least one row")
        # A local file is one split: the file itself (``split`` names the split of a Hub dataset only).
        try:
            return load_dataset(_FILE_FORMATS[suffix], data_files=source, split="train")
        except Exception as err:  # a malformed file: name it, with the reader's own words
            raise ConfigError(f"{setting}: cannot read {source!r} as {_FILE_FORMATS[suffix]}: {err}") from err
    return load_dataset(source, subset, split=split)


class PromptEncoder:
    """Prompt texts to left-padded token ids (optionally through the tokenizer's chat template) and back."""

    def __init__(self, tokenizer: Any, use_chat_template: bool = False) -> None:
        """
        Args:
            tokenizer: the policy's tokenizer (left padding).
            use_chat_template: wrap each prompt in the tokenizer's chat template as a user message.
        """
        self.tokenizer, self.use_chat_template = tokenizer, use_chat_template

    def texts(self, prompts: list[str]) -> list[str]:
        """The text the model is given for each prompt (the chat template applied, when used)."""
        if not self.use_chat_template:
            return list(prompts)
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's token ids, unpadded (special tokens added unless the chat template already has them)."""
        return self.tokenizer(self.texts(prompts), add_special_tokens=not self.use_chat_template)["input_ids"]

    def encode(self, prompts: list[str], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """``(input_ids, attention_mask)`` ``[B, P]``, left-padded: generation appends on the right."""
        encoded = self.tokenizer(
            self.texts(prompts), padding=True, return_tensors="pt", add_special_tokens=not self.use_chat_template
        )
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

    def decode(self, completion_ids: Tensor, completion_mask: Tensor) -> list[str]:
        """The completions' texts (special tokens, such as EOS, left out)."""
        ids = completion_ids.masked_fill(completion_mask == 0, self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Dataset rows to one dict of columns (a DataLoader's ``collate_fn`` for prompt rows)."""
    return {key: [row[key] for row in rows] for key in rows[0]}


def rename_prompt_column(data: Dataset, prompt_column: str, where: str) -> Dataset:
    """``data`` with its prompt column named ``prompt``; a missing one is refused with the columns it has."""
    if len(data) == 0:
        raise ConfigError(f"{where} is empty: it needs at least one row")
    if prompt_column not in data.column_names:
        raise ConfigError(
            f"{where} has no prompt column {prompt_column!r} (columns: {', '.join(data.column_names)}); "
            "set data.prompt_column"
        )
    if prompt_column != "prompt":
        if "prompt" in data.column_names:
            data = data.remove_columns("prompt")
        data = data.rename_column(prompt_column, "prompt")
    return data
