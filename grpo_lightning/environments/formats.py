"""How a tool call and its result are written in text: the simple tag format, or the tokenizer's chat template.

- ``TagFormat`` (the default): ``<tool>calculator: 12*34</tool>`` is answered by ``<result>408</result>``. Short,
  and learnable by a tiny character-level model.
- ``ChatTemplateFormat``: the Hermes / Qwen convention that chat templates with tool support use,
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>``; the result is rendered
  by the tokenizer's own chat template as a ``tool`` message after the assistant's turn (so the observation holds
  the template's end-of-turn, tool-message and next assistant-header text, exactly as the template writes them).

``tool_format("auto", tokenizer)`` picks the chat template's format when the template handles tool calls
(mentions ``tool_call``), the tag format otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from grpo_lightning.config import ConfigError

# A marker the assistant's content is replaced by when rendering, to find where the template's own text begins.
_MARK = "\x00GRPO_TURN\x00"


@dataclass
class ToolCall:
    """A parsed call: the tool's name and its argument text (``None`` name: the call could not be parsed)."""

    name: str | None
    argument: str
    error: str | None = None


class TagFormat:
    """``<tool>name: argument</tool>`` → ``<result>text</result>``."""

    def __init__(
        self,
        open_tag: str = "<tool>",
        close_tag: str = "</tool>",
        result_open: str = "<result>",
        result_close: str = "</result>",
    ) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.result_open, self.result_close = result_open, result_close
        self._call = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)

    @property
    def stop_text(self) -> str:
        return self.close_tag

    def last_call(self, turn: str) -> ToolCall | None:
        """The last complete call in ``turn``, or None when it has none (the turn is then a final answer)."""
        calls = self._call.findall(turn)
        if not calls:
            return None
        name, sep, argument = calls[-1].partition(":")
        if not sep:
            return ToolCall(None, calls[-1], "a call is written <tool>name: argument</tool>")
        return ToolCall(name.strip(), argument.strip())

    def result(self, text: str) -> str:
        return f"{self.result_open}{text}{self.result_close}"


class ChatTemplateFormat:
    """Hermes-style JSON calls in ``<tool_call>`` tags; results rendered by the tokenizer's chat template."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._call = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    @property
    def stop_text(self) -> str:
        return self.close_tag

    def last_call(self, turn: str) -> ToolCall | None:
        calls = self._call.findall(turn)
        if not calls:
            return None
        try:
            call = json.loads(calls[-1])
            name, arguments = call["name"], call.get("arguments", "")
        except (ValueError, KeyError, TypeError):
            return ToolCall(None, calls[-1], 'a call is {"name": ..., "arguments": ...} in JSON')
        if isinstance(arguments, dict) and len(arguments) == 1:
            arguments = next(iter(arguments.values()))  # one-argument tools take the value itself
        return ToolCall(str(name), arguments if isinstance(arguments, str) else json.dumps(arguments))

    def result(self, text: str) -> str:
        """What the template writes after an assistant turn for a tool message holding ``text``, up to the next
        assistant turn's header."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        rendered = self.tokenizer.apply_chat_template(
            [*messages, {"role": "tool", "content": text}], tokenize=False, add_generation_prompt=True
        )
        if _MARK not in rendered:
            raise ConfigError(
                "data.environment.init_args.format: the chat template does not render the assistant's text"
            )
        return rendered.split(_MARK, 1)[1]


def tool_format(name: str, tokenizer: Any) -> TagFormat | ChatTemplateFormat:
    """The format ``name`` (``tag``, ``chat_template`` or ``auto``) for ``tokenizer``."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if name == "auto":
        name = "chat_template" if isinstance(template, str) and "tool_call" in template else "tag"
    if name == "tag":
        return TagFormat()
    if name == "chat_template":
        if not template:
            raise ConfigError("data.environment.init_args.format: chat_template needs a tokenizer with a chat template")
        return ChatTemplateFormat(tokenizer)
    raise ConfigError(f"data.environment.init_args.format must be tag, chat_template or auto (got {name!r})")
