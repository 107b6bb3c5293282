"""``ToolEnvironment``: the policy calls tools across turns; each call's result is the next observation.

After each policy turn, the last complete tool call of the turn (``formats.py``) is run; its result, or
``error: <why>`` when the tool is unknown, raises, returns something that is not text or runs past ``timeout_s``,
is the observation, and the policy's next turn follows it. A turn without a tool call is the final answer: the
trajectory ends there and the configured rewards score it. Nothing a tool does stops the rollout.

Time limit: ``timeout_s`` interrupts the tool with ``SIGALRM`` (``rewards/combine.py: time_limit``), which stops
Python code, not a long C call, and only in the main thread (where rollouts run); the ``python`` tool has the
sandbox's own wall clock, enforced by killing its process. Untrusted code belongs in ``python``, not in a
user function.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.environments.base import Environment, Step
from grpo_lightning.environments.formats import ChatTemplateFormat, TagFormat, tool_format
from grpo_lightning.environments.tools import Tool, resolve_tool
from grpo_lightning.rewards.combine import TimeLimitExceeded, time_limit


class ToolEnvironment(Environment):
    """Tools by name (``calculator``, ``python``, ``pkg.module:fn``), called in the format of ``format``."""

    def __init__(
        self,
        tools: list[str] | None = None,
        format: str = "auto",
        timeout_s: float = 10.0,
        max_result_chars: int = 200,
        max_turns: int = 4,
        max_turn_tokens: int | None = None,
        max_observation_tokens: int = 64,
    ) -> None:
        """
        Args:
            tools: the tools the policy may call; default ``[calculator]``.
            format: ``tag`` (``<tool>name: arg</tool>`` → ``<result>...</result>``), ``chat_template`` (the
                tokenizer's Hermes-style ``<tool_call>`` JSON), or ``auto`` (the template's where it has tool
                calls, else tags).
            timeout_s: time limit of one tool call.
            max_result_chars: a longer result is cut to this many characters.
            max_turns: policy turns per trajectory at most.
            max_turn_tokens: tokens per policy turn; None = ``data.sampling.max_new_tokens``.
            max_observation_tokens: observations are cut to this many tokens.
        """
        super().__init__(max_turns, max_turn_tokens, max_observation_tokens)
        if timeout_s <= 0:
            raise ConfigError(f"data.environment.init_args.timeout_s must be > 0 (got {timeout_s})")
        if max_result_chars < 1:
            raise ConfigError(f"data.environment.init_args.max_result_chars must be >= 1 (got {max_result_chars})")
        names = list(tools) if tools is not None else ["calculator"]
        if not names:
            raise ConfigError("data.environment.init_args.tools is empty: list at least one tool")
        self.tools: dict[str, Tool] = {name.rpartition(":")[2].rpartition(".")[2]: resolve_tool(name) for name in names}
        self.format_name, self.timeout_s, self.max_result_chars = format, timeout_s, max_result_chars
        if format not in ("tag", "chat_template", "auto"):
            raise ConfigError(f"data.environment.init_args.format must be tag, chat_template or auto (got {format!r})")
        self.format: TagFormat | ChatTemplateFormat = TagFormat()

    def setup(self, tokenizer: Any) -> None:
        super().setup(tokenizer)
        self.format = tool_format(self.format_name, tokenizer)

    def spawn(self) -> ToolEnvironment:
        """A shallow copy: tools, format and tokenizer are shared (a tool call keeps no per-trajectory state)."""
        return copy.copy(self)

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return (self.format.stop_text,)

    def reset(self, row: dict[str, Any]) -> str | None:
        return None

    def step(self, turn: str) -> Step:
        call = self.format.last_call(turn)
        if call is None:
            return Step(done=True)  # no tool call: the final answer
        start = time.perf_counter()
        text, failed = self.run(call.name, call.argument) if call.error is None else (call.error, True)
        seconds = time.perf_counter() - start
        if failed:
            text = f"error: {text}"
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars]
        metrics = {"tool_calls": 1.0, "tool_errors": float(failed), "tool_seconds": seconds}
        return Step(observation=self.format.result(text), metrics=metrics)

    def run(self, name: str | None, argument: str) -> tuple[str, bool]:
        """``(result text, failed)`` of one call; never raises (an interrupt by the user aside)."""
        tool = self.tools.get(name or "")
        if tool is None:
            return f"unknown tool {name!r}; tools: {', '.join(self.tools)}", True
        try:
            with time_limit(self.timeout_s):
                value = tool(argument)
        except TimeLimitExceeded:
            return f"timed out after {self.timeout_s:g}s", True
        except Exception as err:  # noqa: BLE001 - every failure of a tool is an observation, never a crash
            return str(err) or type(err).__name__, True
        if not isinstance(value, str):
            return f"the tool returned {type(value).__name__}, not text", True
        return value, False
