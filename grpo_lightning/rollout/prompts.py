"""Prompts: where they come from (``load_prompts``) and how they become token ids (``PromptEncoder``).

Every path that feeds a prompt to the model (the training round, held-out evaluation, multi-turn rollouts, SFT's
examples, rejection sampling, the up-front length check) encodes it with ``PromptEncoder``, so a prompt is
tokenized the same way everywhere.

A prompt is a string, or a conversation: a list of ``{"role", "content"}`` messages (system, user, earlier
assistant turns), the format of TRL and most chat datasets on the Hub. A conversation needs the tokenizer's chat
template; it is rendered with the generation prompt, so the completion is the assistant's next message (or, when
the conversation ends with an assistant message, the continuation of that message: a prefilled answer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset
from torch import Tensor

from grpo_lightning.config import ConfigError
from grpo_lightning.config_checks import check_prompts
from grpo_lightning.modality import TEXT, Modality
from grpo_lightning.tasks import is_task, load_task

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
Prompt = str | list[dict[str, Any]]
# apply_chat_template's own arguments: set by the encoder, never through data.chat_template_kwargs.
_RESERVED_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict")


def is_local_file(source: str) -> bool:
    """``source`` names a local ``.jsonl/.json/.parquet/.csv`` file (one split: the file itself)."""
    return Path(source).suffix.lower() in FILE_FORMATS


def load_prompts(
    source: str,
    split: str,
    *,
    subset: str | None = None,
    task_kwargs: dict | None = None,
    setting: str = "data.dataset",
    curriculum: bool = False,
) -> Dataset:
    """A built-in task's split (``reasoning_gym:<task>`` too), a local jsonl/json/parquet/csv file, or a split of a
    Hub dataset.

    ``setting`` names the config key that gave ``source``, for error messages; ``curriculum`` (``data.curriculum``
    is set): a task with difficulty levels makes rows of every level (``tasks.load_task``).
    """
    if is_task(source):  # a ``reasoning_gym:`` name imports reasoning-gym only here, when a config names one
        splits = load_task(source, curriculum=curriculum, **(task_kwargs or {}))
        if split not in splits:
            raise ConfigError(f"task {source!r} has no split {split!r}; it has {', '.join(splits)}")
        return splits[split]
    suffix = Path(source).suffix.lower()
    if suffix in FILE_FORMATS:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{setting}: no such file {source!r}")
        if path.stat().st_size == 0 or (suffix != ".parquet" and not path.read_text(errors="replace").strip()):
            raise ConfigError(f"{setting}: the file {source!r} is empty; it needs at least one row")
        # A local file is one split: the file itself (``split`` names the split of a Hub dataset only).
        try:
            return load_dataset(FILE_FORMATS[suffix], data_files=source, split="train")
        except Exception as err:  # a malformed file: name it, with the reader's own words
            raise ConfigError(f"{setting}: cannot read {source!r} as {FILE_FORMATS[suffix]}: {err}") from err
    try:
        return load_dataset(source, subset, split=split)
    except ValueError as err:  # a Hub dataset without that split (many RL datasets have only ``train``)
        if not str(err).startswith("Unknown split"):
            raise dataset_error(source, setting, err) from err
        raise ConfigError(
            f"{setting} ({source}) has no split {split!r} ({str(err).splitlines()[0]}); set data.train_split / "
            "data.val_split, or data.val_fraction to hold out a share of the training rows"
        ) from err
    except Exception as err:  # noqa: BLE001 - no such Hub dataset, no network, a folder that holds none: one line
        raise dataset_error(source, setting, err) from err


def dataset_error(source: str, setting: str, err: BaseException) -> ConfigError:
    """``datasets``' failure to load ``source`` as one line naming ``setting``: its message's first line, and its
    cause's (``DatasetGenerationError`` says only that generating failed)."""
    said = [(str(e).strip().splitlines() or [type(e).__name__])[0] for e in (err, err.__cause__) if e is not None]
    local = "" if Path(source).exists() else " (no local file or folder of that name either)"
    return ConfigError(f"{setting}: cannot load {source!r}{local}: {': '.join(said)[:300]}")


def is_conversation(prompt: Any) -> bool:
    """``prompt`` is a list of messages (not a plain string)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str)


def prompt_problem(prompt: Any) -> str | None:
    """Why ``prompt`` is not a usable prompt (a non-empty string or a conversation of messages), or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else f"the prompt is {prompt!r}; every row needs a non-empty prompt"
    if not is_conversation(prompt):
        return f"the prompt is {prompt!r}: a prompt is a string or a list of {{role, content}} messages"
    if not prompt:
        return "the prompt is an empty list of messages"
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return f"message {i} of the prompt is {message!r}, not a {{role, content}} message"
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            return f"message {i} of the prompt ({message['role']}) has no text content (got {content!r})"
    return None


def prompt_key(prompt: Prompt) -> str:
    """A prompt as a string that identifies it (a dict key): a string as it is, a conversation as its JSON text.
    (For display, ``rewards.inputs.prompt_text`` writes a conversation as ``role: content`` lines.)"""
    if isinstance(prompt, str):
        return prompt
    return json.dumps([_clean(m) for m in prompt], ensure_ascii=False)


@contextmanager
def prompts_as_keys(rollout: Any) -> Iterator[None]:
    """``rollout.prompts`` as ``prompt_key`` gives them while the block runs (for what matches prompts by key)."""
    prompts, rollout.prompts = rollout.prompts, [prompt_key(p) for p in rollout.prompts]
    try:
        yield
    finally:
        rollout.prompts = prompts


def response_text(value: Any, setting: str = "data.response_column") -> str:
    """A response column's value as text: a string, or a conversational completion (one assistant message, as
    TRL's prompt-completion datasets hold it)."""
    if isinstance(value, str):
        return value
    if is_conversation(value) and len(value) == 1 and isinstance(value[0], Mapping):
        message = value[0]
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    if isinstance(value, (int, float)):
        return str(value)
    raise ConfigError(f"{setting}: a response is text or [{{role: assistant, content}}] (got {value!r})")


def _clean(message: Mapping[str, Any]) -> dict[str, Any]:
    # A dataset column of messages is a list of structs: every message has every key any message has, None where
    # it had none. A template tests ``message.tool_calls is defined``: the Nones must go.
    return {key: value for key, value in message.items() if value is not None}


class PromptEncoder:
    """Prompts (strings or conversations) to left-padded token ids, through the chat template when used, and back."""

    continues_token_exact: bool = True
    """A multi-turn rollout may continue a trajectory from the engine's kept keys and values (its new tokens alone
    prefilled: ``engines/continuation.py``); a vision-language model's encoder says no (its cache holds M-RoPE
    offsets: each turn is prefilled whole, with its images)."""

    def __init__(
        self,
        tokenizer: Any,
        use_chat_template: bool | str | None = False,
        *,
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        modality: Modality = TEXT,
    ) -> None:
        """
        Args:
            tokenizer: the policy's tokenizer (left padding).
            use_chat_template: render each prompt with the tokenizer's chat template (a string prompt as a user
                message); ``auto`` or None: when the tokenizer has one. True without one is refused.
            system_prompt: a system message put first in every prompt that has none (needs the chat template).
            chat_template_kwargs: further arguments of ``tokenizer.apply_chat_template`` (the template's
                variables, e.g. Qwen3's ``enable_thinking: false``).
            modality: the policy's (``grpo_lightning/modality.py``): what the rows' inputs are, how they repeat
            for
                a group, which engines can take them. Text here; another modality's encoder passes its own.
        """
        self.modality = modality
        check_chat_settings(use_chat_template, system_prompt, chat_template_kwargs)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template is True and not has_template:
            raise ConfigError(
                "data.use_chat_template is true but the tokenizer has no chat template (tokenizer.chat_template is "
                "unset): set it to auto or false, or use a model whose tokenizer has one"
            )
        self.tokenizer = tokenizer
        self.use_chat_template = has_template if use_chat_template in (None, "auto") else bool(use_chat_template)
        self.system_prompt, self.chat_template_kwargs = system_prompt, dict(chat_template_kwargs or {})
        if not self.use_chat_template and (system_prompt is not None or self.chat_template_kwargs):
            name = "data.system_prompt" if system_prompt is not None else "data.chat_template_kwargs"
            raise ConfigError(f"{name} needs a chat template, and the tokenizer has none (data.use_chat_template)")

    def messages(self, prompt: Prompt) -> list[dict[str, Any]]:
        """The conversation the template renders for ``prompt`` (its messages, the system prompt first if set)."""
        problem = self.prompt_problem(prompt)
        if problem is not None:
            raise ConfigError(f"data.prompt_column: {problem}")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [_clean(m) for m in prompt]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def prompt_problem(self, prompt: Any) -> str | None:
        """Why ``prompt`` is not one this encoder renders (``prompt_problem``), or None."""
        return prompt_problem(prompt)

    def check_rows(self, data: Dataset, where: str) -> None:
        """Every row of ``data`` (its ``prompt`` column) is a prompt this encoder renders; refused in one line that
        names ``where`` and the row. (A vision-language model's encoder checks the rows' images too.)"""
        for row, prompt in enumerate(data["prompt"]):
            problem = self.prompt_problem(prompt)
            if problem is not None:
                raise ConfigError(f"{where} row {row}: {problem}")

    def encode_rows(
        self, rows: Mapping[str, list[Any]], device: torch.device | str = "cpu"
    ) -> tuple[Tensor, Tensor, list[dict[str, Tensor]] | None]:
        """``encode`` of a round's ``rows`` (a dict of columns with ``prompt``), and each row's inputs beyond its ids
        (``modality.Rows``): None here; another modality's encoder (a vision-language model's:
        ``integrations/vision/encoder.py``) makes them."""
        prompt_ids, prompt_mask = self.encode(rows["prompt"], device)
        return prompt_ids, prompt_mask, None

    def render(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> str:
        """The text the model is given for one prompt; ``tools``: function schemas the chat template lists in it
        (``apply_chat_template``'s ``tools``, as TRL renders a prompt for its environments' tools)."""
        if not self.use_chat_template:
            if tools:
                raise ConfigError(
                    "data.environment lists its tools in the prompt through the chat template: set "
                    "data.use_chat_template to auto or true, with a tokenizer that has one"
                )
            if is_conversation(prompt):
                raise ConfigError(
                    "data.prompt_column holds conversations (lists of {role, content} messages), which need a chat "
                    "template: data.use_chat_template is false or the tokenizer has no chat template"
                )
            return prompt
        messages = self.messages(prompt)
        prefilled = messages[-1]["role"] == "assistant"  # the completion continues the assistant's message
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=not prefilled,
            continue_final_message=prefilled,
            **self.chat_template_kwargs,
            **({"tools": tools} if tools else {}),  # `if tools`: Llama's template writes its tool preamble for []
        )

    def trajectory_ids(self, prompt: Prompt, tools: list[dict[str, Any]] | None, row: Mapping[str, Any]) -> list[int]:
        """A multi-turn trajectory's own prompt (an environment's: its tools listed, or reset's text inside) as token
        ids; ``row``: its dataset row (a vision-language model's encoder expands the row's images in it)."""
        return self.text_token_ids([self.render(prompt, tools)])[0]

    def trajectory_inputs(
        self, prompt: Prompt, tools: list[dict[str, Any]] | None, row: Mapping[str, Any]
    ) -> tuple[list[int], Any]:
        """``trajectory_ids`` and the trajectory's own inputs beyond its ids: None here (the row's are kept); a
        vision-language model's encoder gives image inputs that know this prompt."""
        return self.trajectory_ids(prompt, tools, row), None

    def rendered_lengths(self, rendered: list[str], data: Any) -> list[int]:
        """Each row of ``data``'s prompt length in tokens, as the model reads it (``rendered``: the prompts'
        texts); a vision-language model's encoder counts each image's expanded tokens."""
        return [len(ids) for ids in self.text_token_ids(rendered)]

    def texts(self, prompts: list[Prompt]) -> list[str]:
        """The text the model is given for each prompt (the chat template applied, when used)."""
        return [self.render(p) for p in prompts]

    def text_token_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of rendered ``texts`` (special tokens added unless the chat template already has them)."""
        return self.tokenizer(texts, add_special_tokens=not self.use_chat_template)["input_ids"]

    def token_ids(self, prompts: list[Prompt]) -> list[list[int]]:
        """Each prompt's token ids, unpadded."""
        return self.text_token_ids(self.texts(prompts))

    def encode(self, prompts: list[Prompt], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """``(input_ids, attention_mask)`` ``[B, P]``, left-padded: generation appends on the right."""
        encoded = self.tokenizer(
            self.texts(prompts), padding=True, return_tensors="pt", add_special_tokens=not self.use_chat_template
        )
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

    def decode(self, completion_ids: Tensor, completion_mask: Tensor) -> list[str]:
        """The completions' texts (special tokens, such as EOS, left out)."""
        ids = completion_ids.masked_fill(completion_mask == 0, self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


def prompt_encoder(modality: Modality, tokenizer: Any, use_chat_template: Any, **settings: Any) -> PromptEncoder:
    """The prompt encoder of ``modality`` for ``tokenizer`` (``Modality.prompt_encoder``), the text one when the
    modality adds none; ``settings``: ``PromptEncoder``'s chat settings."""
    encoder = modality.prompt_encoder(tokenizer, use_chat_template, **settings)
    return encoder if encoder is not None else PromptEncoder(tokenizer, use_chat_template, **settings)


def check_chat_settings(use_chat_template: Any, system_prompt: Any, chat_template_kwargs: Any) -> None:
    """The chat settings' types and combinations that need no tokenizer, refused in one line."""
    if use_chat_template not in (True, False, "auto", None):
        raise ConfigError(f"data.use_chat_template must be true, false or auto (got {use_chat_template!r})")
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt.strip()):
        raise ConfigError(f"data.system_prompt must be a non-empty string or null (got {system_prompt!r})")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise ConfigError(f"data.chat_template_kwargs must be a mapping (got {chat_template_kwargs!r})")
    reserved = [key for key in (chat_template_kwargs or {}) if key in _RESERVED_KWARGS]
    if reserved:
        raise ConfigError(f"data.chat_template_kwargs: {reserved[0]!r} is set by the prompt encoder; leave it out")
    if use_chat_template is False and (system_prompt is not None or chat_template_kwargs):
        name = "data.system_prompt" if system_prompt is not None else "data.chat_template_kwargs"
        raise ConfigError(f"{name} needs the tokenizer's chat template, but data.use_chat_template is false")


def check_prompt_rows(
    data: Dataset,
    where: str,
    encoder: PromptEncoder,
    *,
    context_length: int | None = None,
    max_new_tokens: int = 0,
    context_name: str = "the model's context",
    tools: Sequence[list[dict[str, Any]] | None] | None = None,
) -> None:
    """Every prompt is a non-empty string or a well-formed conversation the encoder can render, and the longest
    one as the model is given it, plus the completion, fits the context (``validation.check_prompts``). ``tools``:
    each row's function schemas, listed in its prompt (an environment's ``prompt_tools``)."""
    prompts = data["prompt"]
    encoder.check_rows(data, where)
    texts = encoder.texts(list(prompts)) if tools is None else [encoder.render(p, t) for p, t in zip(prompts, tools)]
    check_prompts(
        {"prompt": texts},  # rendered: the lengths are the model's
        where,
        token_lengths=lambda rendered: encoder.rendered_lengths(rendered, data),
        context_length=context_length,
        max_new_tokens=max_new_tokens,
        context_name=context_name,
    )


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
