"""Tool calls in the chat template's own format, found by rendering one: Hermes / Qwen tags, Llama-3 JSON calls.

``detect_chat_format`` renders a probe conversation with the tokenizer's template (a user message, an assistant
message whose ``tool_calls`` hold one call, the ``tool`` message that answers it, the generation prompt) and reads
what the template wrote for the call:

==========================================================  ===============================================
the call written as                                         format
==========================================================  ===============================================
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``  ``HermesFormat`` (Hermes, Qwen2.5, Qwen3): the
                                                            turn stops at ``</tool_call>``
``{"name": ..., "parameters": {...}}`` + an end token         ``Llama3JsonFormat`` (Llama-3.1/3.2/3.3): the
                                                            turn is the JSON call, ended by ``<|eot_id|>`` or
                                                            ``<|eom_id|>`` (EOS ids of Llama's generation
                                                            config, and stop texts here)
``[TOOL_CALLS]...`` (Mistral) or anything else              refused in one line
nothing of the call (the template ignores ``tool_calls``)   None: no tool support (``auto`` → tags)
==========================================================  ===============================================

Results are rendered by the template itself, as the ``tool`` message after the assistant's turn, up to and
including the next assistant header: the observation holds exactly the template's text (Qwen's ``<|im_end|>`` and
``<tool_response>`` user message; Llama's ``ipython`` message, its result JSON-encoded as the template writes it).
A Llama turn already ends with its end token (drawn by the policy), so that token is not repeated.
"""

from __future__ import annotations

import json
import re
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments.formats import TagFormat, TaggedCalls, ToolCall, ToolFormat, argument_text

SETTING = "data.environment.init_args.format"
FAMILIES = "Hermes/Qwen (<tool_call> tags) or Llama-3.1+ (JSON calls)"
# A marker the assistant's content is replaced by when rendering, to find where the template's own text begins.
_MARK = "\x00GRPO_TURN\x00"
_NAME, _ARGUMENTS, _RESULT = "grpo_probe_tool", {"grpo_probe_argument": "grpo_probe_value"}, "grpo_probe_result"
_CALL = {"id": "call12345", "type": "function", "function": {"name": _NAME, "arguments": _ARGUMENTS}}
_PROBE = [  # a call id of 9 letters and digits: Mistral's templates refuse any other
    {"role": "user", "content": "grpo probe"},
    {"role": "assistant", "content": "", "tool_calls": [_CALL]},
    {"role": "tool", "tool_call_id": "call12345", "name": _NAME, "content": _RESULT},
]
_LLAMA_ENDS = ("<|eot_id|>", "<|eom_id|>")
_PYTHON_TAG = "<|python_tag|>"


class ChatTemplateFormat:
    """Results rendered by the tokenizer's chat template as a ``tool`` message after the assistant's turn."""

    name = "chat_template"

    def __init__(self, tokenizer: Any, turn_end: str = "", template_kwargs: dict[str, Any] | None = None) -> None:
        """``turn_end``: the template's end of an assistant turn that the policy's turn already ends with;
        ``template_kwargs``: the template's variables (``data.chat_template_kwargs``), as the prompts use them."""
        self.tokenizer, self.turn_end = tokenizer, turn_end
        self.template_kwargs = dict(template_kwargs or {})

    def result(self, text: str) -> str:
        """What the template writes after an assistant turn (its ``turn_end`` aside) for a tool message holding
        ``text``, up to and including the next assistant turn's header."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        rendered = self.tokenizer.apply_chat_template(
            [*messages, {"role": "tool", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            **self.template_kwargs,
        )
        if _MARK not in rendered:
            raise ConfigError(f"{SETTING}: the chat template does not render the assistant's text; use format: tag")
        after = rendered.split(_MARK, 1)[1]
        if not after.startswith(self.turn_end):
            raise ConfigError(f"{SETTING}: the chat template does not end an assistant turn with {self.turn_end!r}")
        return after[len(self.turn_end) :]


class HermesFormat(ChatTemplateFormat, TaggedCalls):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the turn stopped at the close tag."""

    name = "hermes"

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        ChatTemplateFormat.__init__(self, tokenizer, template_kwargs=template_kwargs)
        TaggedCalls.__init__(self, "<tool_call>", "</tool_call>")

    def last_call(self, turn: str) -> ToolCall | None:
        calls = self.tagged_calls(turn)
        if not calls:
            return None
        try:
            call = json.loads(calls[-1])
            name, arguments = call["name"], call.get("arguments", "")
        except (ValueError, KeyError, TypeError, AttributeError):
            return ToolCall(None, calls[-1], 'a call is {"name": ..., "arguments": ...} in JSON')
        return ToolCall(str(name), argument_text(arguments), arguments=arguments)


class Llama3JsonFormat(ChatTemplateFormat):
    """Llama-3.1+: the turn is ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or not), ended by
    ``<|eot_id|>`` / ``<|eom_id|>``; a turn that is not such an object is a final answer."""

    name = "llama3_json"
    _start = re.compile(r'\{\s*"name"\s*:')

    def __init__(self, tokenizer: Any, turn_end: str, template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, turn_end, template_kwargs)
        added = getattr(tokenizer, "get_added_vocab", dict)()
        self._stops = tuple(dict.fromkeys((turn_end, *(end for end in _LLAMA_ENDS if end in added))))

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return self._stops

    def last_call(self, turn: str) -> ToolCall | None:
        text = turn.strip()
        text = text[len(_PYTHON_TAG) :].lstrip() if text.startswith(_PYTHON_TAG) else text
        if not self._start.match(text):
            return None
        error = 'a call is {"name": ..., "parameters": {...}} in JSON'
        try:
            call, _ = json.JSONDecoder().raw_decode(text)
        except ValueError:
            return ToolCall(None, text, error)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall(None, text, error)
        arguments = call.get("parameters", call.get("arguments", {}))
        return ToolCall(call["name"], argument_text(arguments), arguments=arguments)


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def detect_chat_format(
    tokenizer: Any, template_kwargs: dict[str, Any] | None = None
) -> HermesFormat | Llama3JsonFormat | None:
    """The tool-call format the tokenizer's chat template writes (module docstring), rendering with
    ``template_kwargs`` (the template's variables); None when it writes none; ``ConfigError`` (one line) for a form
    not parsed here."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    template_kwargs = dict(template_kwargs or {})
    try:
        rendered = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception as err:  # noqa: BLE001 - any template error: a template without tools may refuse the tool role
        if "tool" not in str(template):
            return None
        raise ConfigError(
            f"{SETTING}: the chat template fails on a tool call and its result ({_one_line(err)}); use format: tag"
        ) from err
    if _NAME not in rendered:
        return None
    if "[TOOL_CALLS]" in rendered:
        raise ConfigError(
            f"{SETTING}: the chat template writes Mistral-style [TOOL_CALLS] calls, not parsed here; use format: tag, "
            f"or a {FAMILIES} template"
        )
    tagged = re.search(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", rendered, re.DOTALL)
    if tagged and _probe_call(tagged.group(1), "arguments"):
        return HermesFormat(tokenizer, template_kwargs)
    found = re.search(r'\{\s*"name"\s*:\s*"' + _NAME + '"', rendered)
    if found:
        try:
            call, length = json.JSONDecoder().raw_decode(rendered[found.start() :])
        except ValueError:
            call, length = None, 0
        after = rendered[found.start() + length :]
        added = getattr(tokenizer, "get_added_vocab", dict)()
        end = max((token for token in added if after.startswith(token)), key=len, default="")  # one token ends it
        if isinstance(call, dict) and call.get("parameters") == _ARGUMENTS and end:
            return Llama3JsonFormat(tokenizer, end, template_kwargs)
    at = rendered.index(_NAME)
    seen = rendered[max(0, at - 30) : at + len(_NAME) + 50]
    raise ConfigError(
        f"{SETTING}: the chat template writes tool calls in a form not parsed here ({seen!r}); use format: tag, or a "
        f"{FAMILIES} template"
    )


def _probe_call(text: str, key: str) -> bool:
    try:
        call = json.loads(text)
    except ValueError:
        return False
    return isinstance(call, dict) and call.get("name") == _NAME and call.get(key) == _ARGUMENTS


def tool_format(name: str, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> ToolFormat:
    """The format the ``format`` setting ``name`` stands for: ``tag``; ``chat_template`` (the family the template
    writes, refused when it writes none parsed here); ``auto`` (that family, or tags when the template does not
    handle tools). Refused in one line (``ConfigError``) for a template whose tool calls are not parsed here.
    ``template_kwargs``: the template's variables (``data.chat_template_kwargs``), for every rendering."""
    if name == "tag":
        return TagFormat()
    if name not in ("chat_template", "auto"):
        raise ConfigError(f"{SETTING} must be tag, chat_template or auto (got {name!r})")
    if name == "chat_template" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{SETTING}: chat_template needs a tokenizer with a chat template; use format: tag")
    family = detect_chat_format(tokenizer, template_kwargs)
    if family is None and name == "chat_template":
        raise ConfigError(
            f"{SETTING}: the tokenizer's chat template does not write tool calls (a call rendered with it is left "
            f"out); use format: tag, or a {FAMILIES} template"
        )
    return family or TagFormat()
