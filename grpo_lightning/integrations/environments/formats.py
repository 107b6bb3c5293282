"""How a tool call and its result are written in text: the simple tag format, or the tokenizer's chat template.

- ``TagFormat`` (the default): ``<tool>calculator: 12*34</tool>`` is answered by ``<result>408</result>``. Short,
  and learnable by a tiny character-level model.
- the chat template's own format (``chat_formats.py``): Hermes / Qwen ``<tool_call>{json}</tool_call>`` or
  Llama-3.1+ JSON calls, each result rendered by the template as a tool message.

``chat_formats.tool_format(name, tokenizer)`` picks one for the ``format`` setting. Here: ``ToolCall``, the
``ToolFormat`` interface, ``TagFormat`` and ``argument_text``, which the chat formats share.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ToolCall:
    """A parsed call: the tool's name and its argument text (``None`` name: the call could not be parsed)."""

    name: str | None
    argument: str
    error: str | None = None
    arguments: Any = None
    """A JSON call's arguments as the call wrote them (an object: by name, typed), for tools that take several;
    None for the tag format, whose call is one text."""


class ToolFormat(Protocol):
    """What ``ToolEnvironment`` needs of a format."""

    name: str
    """Its name in messages (``tag``, ``hermes``, ``llama3_json``)."""

    @property
    def stop_texts(self) -> tuple[str, ...]:
        """Texts that end a policy turn holding a call, so that the environment can answer it."""

    def last_call(self, turn: str) -> ToolCall | None:
        """The last complete call in ``turn``, or None when it has none (the turn is then a final answer)."""

    def result(self, text: str) -> str:
        """The observation that answers a call with ``text``: the result inside its frame, up to the next turn."""


class TaggedCalls:
    """Calls written between an open and a close tag (ours, Hermes'); a turn holding one stops at the close tag."""

    def __init__(self, open_tag: str, close_tag: str) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self._call = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return (self.close_tag,)

    def tagged_calls(self, turn: str) -> list[str]:
        """What each complete call of ``turn`` holds between its tags, in order."""
        return self._call.findall(turn)


class TagFormat(TaggedCalls):
    """``<tool>name: argument</tool>`` → ``<result>text</result>``."""

    name = "tag"

    def __init__(
        self,
        open_tag: str = "<tool>",
        close_tag: str = "</tool>",
        result_open: str = "<result>",
        result_close: str = "</result>",
    ) -> None:
        super().__init__(open_tag, close_tag)
        self.result_open, self.result_close = result_open, result_close

    def last_call(self, turn: str) -> ToolCall | None:
        """The last complete call in ``turn``, or None when it has none (the turn is then a final answer)."""
        calls = self.tagged_calls(turn)
        if not calls:
            return None
        name, sep, argument = calls[-1].partition(":")
        if not sep:
            return ToolCall(None, calls[-1], "a call is written <tool>name: argument</tool>")
        return ToolCall(name.strip(), argument.strip())

    def result(self, text: str) -> str:
        return f"{self.result_open}{text}{self.result_close}"


def argument_text(arguments: Any) -> str:
    """A JSON call's arguments as the one text a tool takes: a single argument's value itself, else the JSON."""
    if isinstance(arguments, dict) and len(arguments) == 1:
        arguments = next(iter(arguments.values()))
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
