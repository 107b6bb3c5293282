"""``ToolEnvironment``: the policy calls tools across turns; each call's result is the next observation.

After each policy turn, the last complete tool call of the turn (``formats.py``, ``chat_formats.py``) is run; its
result, or ``error: <why>`` when the tool is unknown, raises, returns something that is not text or runs past
``timeout_s``, is the observation, and the policy's next turn follows it. A turn without a tool call is the final
answer: the trajectory ends there and the configured rewards score it. Nothing the policy's call does stops the
rollout; a tool that is itself broken does (``ToolBroken``, or the sandbox's ``SandboxError``): one line naming the
tool, rather than the same ``error:`` observation on every call of the run.

A result longer than ``max_result_chars`` characters, or whose observation would pass ``max_observation_tokens``,
is cut inside its frame (``Environment.fit_observation``): the close tag or the template's end of the tool message
and the next assistant header stay, and the text says how many characters were cut.

Time limit: ``timeout_s`` interrupts the tool with ``SIGALRM`` (``rewards/combine.py: time_limit``), which stops
Python code, not a long C call, and only in the main thread (where rollouts run); the ``python`` tool's sandbox has
its own wall clock, bounded by ``timeout_s``, and kills its processes however the call ends. Untrusted code
belongs in ``python``, not in a user function.

Concurrency: ``max_concurrency`` > 1 runs the calls of a turn's trajectories at once in threads (for tools that wait
on I/O: a network call, a service), their results in the trajectories' order (``turn_loop.step_environments``), so
the same answers as one at a time. A call in a thread cannot be interrupted: past ``timeout_s`` it is answered
``error: timed out`` and left to finish in its own daemon thread, its result unused. With partial rollouts whose
``tokens_per_push`` is below ``max_new_tokens`` every call runs in a thread (``partial_turns.py``: the segments do
not wait for it; ``steps_in_threads``), ``max_concurrency`` of them at once, timed out so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments.base import SHORT_CUT_MARKER, Environment, Step, cut_marker
from grpo_lightning.integrations.environments.chat_formats import tool_format
from grpo_lightning.integrations.environments.formats import TagFormat, ToolFormat
from grpo_lightning.integrations.environments.tools import PythonTool, Tool, ToolBroken, resolve_tool
from grpo_lightning.integrations.sandbox.sandbox import SandboxError
from grpo_lightning.rewards.combine import TimeLimitExceeded, alarm_available, time_limit

# The longest cut the setup message makes room for in the full marker: a result of up to a billion characters.
_LARGEST_CUT = 999_999_999
# What every step of a tool environment counts (``rollout/<name>_mean`` in the logs): the same names every round.
TOOL_METRICS = ("tool_calls", "tool_errors", "tool_seconds")


def check_result_frame(environment: Environment, format: ToolFormat) -> None:
    """Refuses, in one line, a ``max_observation_tokens`` of ``environment`` (set up) that cannot hold ``format``'s
    result frame and a cut marker: every cut result would lose its frame."""
    smallest = environment.count_tokens(format.result(SHORT_CUT_MARKER))
    if smallest > environment.max_observation_tokens:
        full = environment.count_tokens(format.result(cut_marker(_LARGEST_CUT)))
        raise ConfigError(
            f"data.environment.init_args.max_observation_tokens = {environment.max_observation_tokens} cannot hold "
            f"the {format.name} format's result frame and a cut marker: set it to at least {smallest} ({full} to say "
            "how many characters a cut result lost)"
        )


class ToolEnvironment(Environment):
    """Tools by name (``calculator``, ``python``, ``pkg.module:fn``), called in the format of ``format``."""

    shared = (*Environment.shared, "tools", "format")  # stateless: every trajectory's copy uses the same
    steps_in_threads = True  # a call in a thread is timed out by ``_call``'s own thread, not SIGALRM

    def __init__(
        self,
        tools: list[str] | None = None,
        format: str = "auto",
        timeout_s: float = 10.0,
        max_result_chars: int = 200,
        max_turns: int = 4,
        max_turn_tokens: int | None = None,
        max_observation_tokens: int = 64,
        max_concurrency: int = 1,
    ) -> None:
        """
        Args:
            tools: the tools the policy may call; default ``[calculator]``.
            format: ``tag`` (``<tool>name: arg</tool>`` → ``<result>...</result>``), ``chat_template`` (the
                tokenizer's chat template's own calls: Hermes/Qwen ``<tool_call>`` or Llama-3 JSON), or ``auto``
                (the template's where it writes tool calls, else tags).
            timeout_s: time limit of one tool call (also bounds the ``python`` tool's sandbox clock).
            max_result_chars: a longer result is cut to this many characters (and says so).
            max_turns: policy turns per trajectory at most.
            max_turn_tokens: tokens per policy turn; None = ``data.sampling.max_new_tokens``.
            max_observation_tokens: tokens of one observation at most: the result is cut to fit inside its frame.
            max_concurrency: calls run at once in threads, one per trajectory of a turn (tools that wait on I/O);
                1: one at a time in the rollout's thread, interrupted at ``timeout_s`` (see the module docstring).
        """
        super().__init__(max_turns, max_turn_tokens, max_observation_tokens)
        if type(max_concurrency) is not int or max_concurrency < 1:
            raise ConfigError(
                f"data.environment.init_args.max_concurrency must be an integer >= 1 (got {max_concurrency!r})"
            )
        self.max_concurrency = max_concurrency
        if timeout_s <= 0:
            raise ConfigError(f"data.environment.init_args.timeout_s must be > 0 (got {timeout_s})")
        if max_result_chars < 1:
            raise ConfigError(f"data.environment.init_args.max_result_chars must be >= 1 (got {max_result_chars})")
        names = list(tools) if tools is not None else ["calculator"]
        if not names:
            raise ConfigError("data.environment.init_args.tools is empty: list at least one tool")
        self.tools: dict[str, Tool] = {name.rpartition(":")[2].rpartition(".")[2]: resolve_tool(name) for name in names}
        for name, tool in self.tools.items():
            if isinstance(tool, PythonTool):  # its sandbox stops the program by itself, before the alarm would
                self.tools[name] = tool.bounded(timeout_s)
        self.format_name, self.timeout_s, self.max_result_chars = format, timeout_s, max_result_chars
        if format not in ("tag", "chat_template", "auto"):
            raise ConfigError(f"data.environment.init_args.format must be tag, chat_template or auto (got {format!r})")
        self.format: ToolFormat = TagFormat()

    def setup(self, tokenizer: Any) -> None:
        """Picks the format for ``tokenizer`` and checks that an observation's frame fits its token limit."""
        super().setup(tokenizer)
        self.format = tool_format(self.format_name, tokenizer, self.chat_template_kwargs)
        check_result_frame(self, self.format)

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return self.format.stop_texts

    def reset(self, row: dict[str, Any]) -> str | None:
        return None

    def step(self, turn: str) -> Step:
        call = self.format.last_call(turn)
        if call is None:
            return final_answer()
        return tool_step(self, lambda: self.run(call.name, call.argument) if call.error is None else (call.error, True))

    def run(self, name: str | None, argument: str) -> tuple[str, bool]:
        """``(result text, failed)`` of one call. Raises only for a broken tool (``ToolBroken``: its own failure,
        not the call's, such as a sandbox that does not start) and for an interrupt by the user."""
        tool = self.tools.get(name or "")
        if tool is None:
            return f"unknown tool {name!r}; tools: {', '.join(self.tools)}", True
        try:
            value = self._call(tool, argument)
        except TimeLimitExceeded:
            return f"timed out after {self.timeout_s:g}s", True
        except (ToolBroken, SandboxError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ToolBroken(f"data.environment: the tool {name!r} is broken, not the policy's call: {reason}") from err
        except Exception as err:  # noqa: BLE001 - every failure of a call is an observation, never a crash
            return str(err) or type(err).__name__, True
        if not isinstance(value, str):
            return f"the tool returned {type(value).__name__}, not text", True
        return value, False

    def _call(self, tool: Tool, argument: str) -> Any:
        """``tool(argument)`` within ``timeout_s``: interrupted by ``SIGALRM`` in the main thread; in a thread of
        ``max_concurrency``, waited for at most ``timeout_s`` in a daemon thread of its own, then abandoned."""
        if alarm_available():
            with time_limit(self.timeout_s):
                return tool(argument)
        outcome: list[Any] = []

        def call() -> None:
            try:
                outcome.append((True, tool(argument)))
            except BaseException as err:  # noqa: BLE001 - raised in the waiting thread below
                outcome.append((False, err))

        runner = threading.Thread(target=call, daemon=True, name="tool-call")
        runner.start()
        runner.join(self.timeout_s)
        if not outcome:
            raise TimeLimitExceeded(self.timeout_s, None)
        returned, value = outcome[0]
        if not returned:
            raise value
        return value


def final_answer() -> Step:
    """The step of a turn without a tool call: the final answer, which ends the trajectory. It counts 0 of each
    ``TOOL_METRICS``, so that a round in which no trajectory calls a tool logs them as 0 rather than not at all (a
    metric that comes and goes breaks its curve and the runs' comparison)."""
    return Step(done=True, metrics=dict.fromkeys(TOOL_METRICS, 0.0))


def tool_step(environment: Any, call: Callable[[], tuple[str, bool]]) -> Step:
    """One tool call's answer: ``call()``'s ``(result, failed)``, a failure as ``error: <why>``, cut to fit its frame
    (``environment.format.result``, ``environment.max_result_chars``: ``ToolEnvironment``'s and ``TRLEnvironment``'s),
    and the call's counts and seconds."""
    start = time.perf_counter()
    text, failed = call()
    seconds = time.perf_counter() - start
    if failed:
        text = f"error: {text}"
    metrics = dict(zip(TOOL_METRICS, (1.0, float(failed), seconds), strict=True))
    result_frame = environment.format.result
    observation = environment.fit_observation(text, result_frame, max_chars=environment.max_result_chars)
    return Step(observation=observation, metrics=metrics)
