"""``AgentEnvironment``: ``data.environment`` for agents that run their own loop against an OpenAI endpoint.

The other environments answer the policy turn by turn (``reset``/``step``, ``integrations/environments/multiturn.py``);
here the user's agent owns the loop. For every trajectory (G per prompt) the run opens a session on the round's gateway
(``integrations/agents/gateway.py``) and runs the agent with that session's base URL, the gateway's token as API key,
and the
dataset row:

- a function ``agent(base_url: str, api_key: str, row: dict) -> float | dict[str, float] | None`` (``agent:
  my_pkg.agents:solve``), called in a thread (``max_concurrency`` at once), e.g. with
  ``openai.OpenAI(base_url=base_url, api_key=api_key)``;
- or a program (``command: [python, my_agent.py]``), given ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (which the
  ``openai`` client reads by itself) and the row as JSON on stdin (also in ``GRPO_AGENT_ROW``); its reward is the
  last line of its stdout, as JSON (a number, an object of named numbers, or null).

Its return value is its reward: a number is the reward part ``agent``, a dict of numbers the parts
``agent_<name>``, None none (``data.rewards`` then decide alone). Parts are added to the weighted sum of
``data.rewards``, which score the session's last completion text, as an environment's reward parts are.

A session ends when its agent returns, or after ``timeout_s`` (a program is killed then; a function's thread is
left to finish on its own, its calls refused). An agent that raises, returns something else, or runs past its
time stops the run (``on_error: raise``) or leaves its trajectory out of the loss and of its group's baseline
(``on_error: skip``), counted as ``agent/failed_sessions`` and ``agent/timed_out_sessions``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from grpo_lightning.config import ConfigError
from grpo_lightning.errors import EnvironmentCrashed
from grpo_lightning.integrations.agents.rollout import sample_and_score_agents
from grpo_lightning.integrations.agents.serving import CallServer
from grpo_lightning.integrations.agents.sessions import SessionOutcome
from grpo_lightning.integrations.environments.base import Environment, Step

if TYPE_CHECKING:
    import torch

    from grpo_lightning.engines.base import RolloutEngine, SamplingParams
    from grpo_lightning.rewards.scorer import Scorer
    from grpo_lightning.rollout.batch import RolloutBatch
    from grpo_lightning.rollout.prompts import PromptEncoder

__all__ = ["AgentEnvironment", "SessionOutcome", "failure", "resolve_agent", "reward_parts"]

SETTING = "data.environment.init_args"
AgentFn = Callable[[str, str, dict[str, Any]], Any]


class AgentEnvironment(Environment):
    """A user's agent, run unchanged against the run's OpenAI-compatible gateway (see the module docstring)."""

    carries_images = False  # its agents call the run's endpoint with text only
    partial_rollouts_refused = (
        "an agent's program runs its own loop and holds its own state between its calls to the gateway, so a "
        "trajectory cannot be paused at a weight push by a token budget (a call in flight would have to wait for the "
        "next push inside the program's HTTP request) nor be checkpointed or replayed into a resumed run; use "
        "partial_rollouts: false (rollout_lag: 1 still hides a round's generation behind the update)"
    )

    def __init__(
        self,
        agent: str | AgentFn | None = None,
        command: str | Sequence[str] | None = None,
        max_calls: int = 16,
        max_call_tokens: int | None = None,
        max_concurrency: int = 16,
        timeout_s: float = 600.0,
        host: str = "127.0.0.1",
        port: int = 0,
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        """
        Args:
            agent: the agent function, or its import path ``package.module:function``.
            command: instead of ``agent``, a program to run per trajectory (a list of arguments, or one string
                split on spaces).
            max_calls: model calls per session at most (later ones are answered 429).
            max_call_tokens: tokens one call may generate at most (a request's ``max_tokens`` is capped by it);
                None: ``data.sampling.max_new_tokens``.
            max_concurrency: agents running at once.
            timeout_s: seconds one session may run.
            host: the address the gateway binds (``127.0.0.1``: this machine only; ``0.0.0.0`` for agents in
                containers; the token is required either way).
            port: the gateway's port; 0: a free one each round.
            on_error: ``raise`` stops the run when an agent fails; ``skip`` trains without its trajectory.
        """
        if (agent is None) == (command is None):
            raise ConfigError(f"{SETTING}: set exactly one of agent (a function's import path) and command")
        for name, value in (("max_calls", max_calls), ("max_concurrency", max_concurrency)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{SETTING}.{name} must be an integer >= 1 (got {value!r})")
        if max_call_tokens is not None and (type(max_call_tokens) is not int or max_call_tokens < 1):
            raise ConfigError(f"{SETTING}.max_call_tokens must be an integer >= 1 or null (got {max_call_tokens!r})")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"{SETTING}.timeout_s must be a number of seconds > 0 (got {timeout_s!r})")
        if not isinstance(host, str) or not host:
            raise ConfigError(f"{SETTING}.host must be an address such as 127.0.0.1 (got {host!r})")
        if type(port) is not int or not 0 <= port < 65536:
            raise ConfigError(f"{SETTING}.port must be 0 (a free port) or a port number (got {port!r})")
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"{SETTING}.on_error must be raise or skip (got {on_error!r})")
        super().__init__(max_turns=max_calls, max_turn_tokens=max_call_tokens)
        self.agent = resolve_agent(agent) if agent is not None else None
        self.command = command.split() if isinstance(command, str) else list(command or [])
        if command is not None and not self.command:
            raise ConfigError(f"{SETTING}.command is empty: name the program to run")
        self.max_concurrency, self.timeout_s, self.on_error = max_concurrency, float(timeout_s), on_error
        self.host, self.port = host, port

    def rollout(
        self,
        rows: dict[str, list[Any]],
        *,
        engine: RolloutEngine,
        encoder: PromptEncoder,
        scorer: Scorer,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
        device: torch.device | str = "cpu",
        timings: dict[str, float] | None = None,
    ) -> RolloutBatch:
        """The agents' sessions, G per row, as rows scored per session (``integrations/agents/rollout.py``); the
        engine's log-probs are always kept (the gateway records them with every call)."""
        return sample_and_score_agents(
            rows, agent=self, engine=engine, encoder=encoder, scorer=scorer, params=params, generator=generator,
            device=device, timings=timings,
        )  # fmt: skip

    def reset(self, row: dict[str, Any]) -> str | None:
        raise TypeError(
            "AgentEnvironment has no turns to answer: its agent runs its own loop (integrations/agents/rollout.py)"
        )

    def step(self, turn: str) -> Step:
        raise TypeError(
            "AgentEnvironment has no turns to answer: its agent runs its own loop (integrations/agents/rollout.py)"
        )

    # ------------------------------------------------------------------------------------- the sessions
    def run_sessions(self, rows: list[dict[str, Any]], server: CallServer) -> list[SessionOutcome]:
        """Run the agent once per row (``max_concurrency`` at once), serving their calls on this thread until every
        session has ended; the outcomes in the order of ``rows``."""
        gateway = server.gateway
        outcomes = [SessionOutcome(dict(row)) for row in rows]
        waiting, active = list(reversed(outcomes)), []
        while waiting or active:
            while waiting and len(active) < self.max_concurrency:
                outcome = waiting.pop()
                outcome.session = gateway.open_session()
                outcome.deadline = time.monotonic() + self.timeout_s
                active.append(outcome)
                threading.Thread(target=self._run, args=(outcome, gateway), name="agent", daemon=True).start()
            server.serve(gateway.next_requests(timeout=0.01))
            now = time.monotonic()
            for outcome in list(active):
                if not outcome.finished and now > outcome.deadline:
                    outcome.timed_out = True
                    gateway.close_session(outcome.session)
                    if outcome.process is not None:
                        outcome.process.kill()
                if outcome.finished or outcome.timed_out:
                    active.remove(outcome)
                    if outcome.failed and self.on_error == "raise":
                        failed = failure(outcome, self.timeout_s)
                        raise EnvironmentCrashed(f"{SETTING}: {failed} (on_error: skip goes on)")
        return outcomes

    def _run(self, outcome: SessionOutcome, gateway: Any) -> None:
        """One agent run (in its own thread); the session closes when it returns."""
        try:
            base_url = gateway.base_url(outcome.session)
            if self.agent is not None:
                value = self.agent(base_url, gateway.token, outcome.row)
            else:
                value = self._run_command(outcome, base_url, gateway.token)
            if not outcome.timed_out:  # a late return is not its reward: its session was already given up
                outcome.rewards, outcome.result = reward_parts(value), value
        except Exception as err:  # the agent's own failure: reported by the round (on_error)
            outcome.error = f"{type(err).__name__}: {err}"
        finally:
            gateway.close_session(outcome.session)
            outcome.finished = True

    def _run_command(self, outcome: SessionOutcome, base_url: str, token: str) -> Any:
        row = json.dumps(outcome.row, default=str)
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": token, "GRPO_AGENT_ROW": row}
        process = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        outcome.process = process
        out, err = process.communicate(row)
        if process.returncode != 0:
            tail = " | ".join(err.strip().splitlines()[-3:])
            raise RuntimeError(f"the agent command exited with {process.returncode}: {tail}")
        last = next((line for line in reversed(out.splitlines()) if line.strip()), "null")
        try:
            return json.loads(last)
        except ValueError as parse:
            raise ValueError(f"the agent command's last line is not JSON: {last[:80]!r}") from parse


def resolve_agent(agent: str | AgentFn) -> AgentFn:
    """``agent`` as a function: itself, or the one its import path ``package.module:function`` names."""
    if callable(agent):
        return agent
    if not isinstance(agent, str) or ":" not in agent:
        raise ConfigError(f"{SETTING}.agent must be an import path package.module:function (got {agent!r})")
    module, _, name = agent.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{SETTING}.agent: cannot import {agent!r} ({err})") from err
    if not callable(fn):
        raise ConfigError(f"{SETTING}.agent: {agent!r} is not callable")
    return fn


def reward_parts(value: Any) -> dict[str, float]:
    """An agent's return value as named reward parts: a number → ``agent``, a dict → ``agent_<name>``, None → none."""
    if value is None:
        return {}
    parts = value if isinstance(value, dict) else {"": value}
    out = {}
    for name, part in parts.items():
        if not isinstance(part, (int, float)) or not math.isfinite(part):
            raise TypeError(f"the agent returned {value!r}: return a number, a dict of numbers, or None")
        out[f"agent_{name}" if name else "agent"] = float(part)
    return out


def failure(outcome: SessionOutcome, timeout_s: float) -> str:
    """Why ``outcome`` failed, in one line naming its row's prompt."""
    prompt = str(outcome.row.get("prompt"))[:60]
    if outcome.timed_out:
        return f"the agent ran past timeout_s = {timeout_s:g} s on the prompt {prompt!r}"
    return f"the agent failed on the prompt {prompt!r}: {outcome.error}"
