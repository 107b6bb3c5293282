"""Chat messages an environment answers with (skyrl-gym's, OpenEnv's text as a message), as an observation frame.

An observation is tokenized on its own and appended after the policy's turn
(``integrations/environments/multiturn.py``). When the environment answers with chat messages, the frame is what the
tokenizer's chat template writes after an assistant
turn for those messages, up to and including the next assistant header (the generation prompt):

    ...<the turn><|im_end|>  |  \\n<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n
         (the policy's tokens)  |  (the frame: tokenized on its own)

The template's end of the assistant turn (``<|im_end|>``, Llama's ``<|eot_id|>``) is the policy's end token, drawn
by the policy: the frame leaves it out rather than repeating it. Found by rendering a marker as the assistant's
content (as ``chat_formats.ChatTemplateFormat`` renders a tool result); nothing before the marker is used, so the
frame does not depend on the conversation the trajectory holds. Without a chat template (``plain``), the frame is
the messages' contents, one per line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_lightning.config import ConfigError

FRAMES = ("auto", "chat_template", "plain")
_MARK = "\x00GRPO_OBSERVATION\x00"  # the assistant's content while rendering: where the template's own text begins
Message = dict[str, Any]


def check_frame(name: str, setting: str) -> str:
    """``name`` when it is one of ``FRAMES``; ``ConfigError`` naming ``setting`` otherwise."""
    if name not in FRAMES:
        raise ConfigError(f"{setting} must be one of {', '.join(FRAMES)} (got {name!r})")
    return name


class MessageFrame:
    """Renders an environment's messages as the text appended after an assistant turn (see the module docstring)."""

    def __init__(self, tokenizer: Any, frame: str = "auto", template_kwargs: dict[str, Any] | None = None) -> None:
        """
        Args:
            tokenizer: the policy's tokenizer.
            frame: ``chat_template`` (the tokenizer's template; refused without one), ``plain`` (the contents, one
                per line) or ``auto`` (the template when the tokenizer has one).
            template_kwargs: the template's variables (``data.chat_template_kwargs``), as the prompts use them.
        """
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if frame == "chat_template" and not has_template:
            raise ConfigError(
                "data.environment.init_args.frame: chat_template needs a tokenizer with a chat template; use plain"
            )
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})
        self.chat = frame == "chat_template" or (frame == "auto" and has_template)
        self.turn_end = self._turn_end() if self.chat else ""

    def _after_turn(self, messages: list[Message]) -> str:
        conversation = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}, *messages]
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
        except Exception as err:  # noqa: BLE001 - a template's own refusal (roles it does not take, their order)
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            roles = ", ".join(str(m.get("role")) for m in messages) or "none"
            raise ConfigError(
                f"data.environment: the chat template cannot render the environment's messages (roles: {roles}) "
                f"after an assistant turn ({reason}); set init_args.frame: plain, or a role the template takes"
            ) from err
        if _MARK not in rendered:
            raise ConfigError(
                "data.environment: the chat template does not render an assistant message's content; set "
                "init_args.frame: plain"
            )
        return rendered.split(_MARK, 1)[1]

    def _turn_end(self) -> str:
        # The longest added token the template writes right after the assistant's content: its end-of-turn token.
        after = self._after_turn([])
        added = getattr(self.tokenizer, "get_added_vocab", dict)()
        return max((token for token in added if token and after.startswith(token)), key=len, default="")

    def render(self, messages: list[Message]) -> str:
        """The frame of ``messages`` (after the turn's end token, up to the next assistant header)."""
        if not self.chat:
            return "\n".join(str(m.get("content") or "") for m in messages)
        after = self._after_turn(messages)
        if not after.startswith(self.turn_end):  # the template ends a turn differently after these messages
            raise ConfigError(
                f"data.environment: the chat template ends an assistant turn with {self.turn_end!r} before some "
                "messages and not before others; set init_args.frame: plain"
            )
        return after[len(self.turn_end) :]

    def renderer(self, messages: list[Message]) -> Callable[[str], str]:
        """``text -> render(messages with the last one's content replaced by text)``: what ``fit_observation``
        cuts inside (the last message's content; the earlier ones are kept whole)."""
        head, last = messages[:-1], messages[-1]
        return lambda text: self.render([*head, {**last, "content": text}])


def fit_messages(environment: Any, frame: MessageFrame, messages: list[Message]) -> str:
    """The frame of ``messages`` within ``environment.max_observation_tokens`` (``Environment.fit_observation``: the
    last message's content cut to fit, its frame kept); with no message, the bare frame (the next header)."""
    if not messages:
        return frame.render([])
    return environment.fit_observation(str(messages[-1].get("content") or ""), frame.renderer(messages))


def check_frame_fits(environment: Any, frame: MessageFrame, role: str) -> None:
    """Refuses, in one line, a ``max_observation_tokens`` that cannot hold a ``role`` message's frame with a cut
    marker: every observation would lose its frame (the next assistant header with it)."""
    smallest = environment.count_tokens(frame.render([{"role": role, "content": "..."}]))
    if smallest > environment.max_observation_tokens:
        raise ConfigError(
            f"data.environment.init_args.max_observation_tokens = {environment.max_observation_tokens} cannot hold "
            f"an observation's frame (a {role} message and the next assistant header: {smallest} tokens); set it to "
            f"at least {smallest}"
        )
