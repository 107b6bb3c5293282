"""``OpenEnvEnvironment``: an OpenEnv environment server (``openenv`` 0.10), one WebSocket session per trajectory.

OpenEnv serves an environment (``reset(**kwargs) -> Observation``, ``step(Action) -> Observation``; an observation
carries ``reward`` and ``done``) over HTTP/WebSocket; its client (``EnvClient``: ``GenericEnvClient`` with dicts, or an
environment's own typed client) holds one session, an environment instance of its own on the server, per
connection. Here each trajectory's copy opens a session at ``reset`` and closes it when the trajectory ends
(``final_rewards``); every copy's session runs on one event loop thread shared by the copies.

The server is reached at ``url``, or started by the run from ``server`` (``pkg.module:app`` or a command with
``{port}``; ``local_server.py``) and stopped with it (``close``, the interpreter's exit, the trainer's death).

A turn becomes an action ``{action_field: turn text}`` (the client's action class built from it, for a typed client);
the observation's text (``observation_field``, or its one field besides ``done``/``reward``/``metadata``, or
its fields as JSON) is the next observation: a ``observation_role`` message rendered by the chat template after the
turn (``message_frames.py``), or the text as it is (``frame: plain``). Reset's text goes into the prompt
(``trajectory_prompt``: appended to its last message); each step's ``reward`` is the reward part ``reward_name``
(``env_openenv``, weight ``reward_weight``), and ``done`` ends the trajectory.

Faults (a refused connection, a timeout, a server error, a dropped session) are retried ``max_retries`` times, each
request ``timeout_s`` at most, by replaying the trajectory on a new session; then one line naming the environment
and its URL (``openenv_sessions.py``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import typing
from collections.abc import Mapping
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments.base import Environment, Step
from grpo_lightning.integrations.environments.local_server import server_command
from grpo_lightning.integrations.environments.message_frames import (
    MessageFrame,
    check_frame,
    check_frame_fits,
    fit_messages,
)
from grpo_lightning.integrations.environments.openenv_sessions import (
    SETTING,
    OpenEnvBackend,
    OpenEnvSession,
    get_json,
    jsonable,
    one_line,
    with_retries,
)

INSTALL = 'pip install -e ".[openenv]"'
_STANDARD_FIELDS = ("done", "reward", "metadata")


def _client_classes() -> tuple[type, type]:
    """``(EnvClient, GenericEnvClient)``; ``ConfigError`` naming the extra when openenv is not installed."""
    try:
        from openenv.core.env_client import EnvClient
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as err:
        raise ConfigError(f"data.environment: OpenEnvEnvironment needs the openenv package ({err}); {INSTALL}") from err
    return EnvClient, GenericEnvClient


def _import(spec: str, setting: str) -> Any:
    module, sep, name = spec.partition(":")
    if not sep:
        module, _, name = spec.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{setting}: cannot import {spec!r} ({one_line(err)}); write pkg.module:Class") from err


def action_class(client_class: type, env_client: type) -> type | None:
    """The action class of ``client_class``'s ``EnvClient[Action, Observation, State]`` base; None for a client of
    plain dicts (``GenericEnvClient``) or one that does not name its action class."""
    for klass in client_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            arguments = typing.get_args(base)
            if typing.get_origin(base) is env_client and arguments and inspect.isclass(arguments[0]):
                return None if issubclass(arguments[0], Mapping) else arguments[0]
    return None


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment server, reached at ``url`` or started from ``server``; one session per trajectory."""

    shared = (*Environment.shared, "backend", "client_class", "action_class", "frame")

    def __init__(
        self,
        url: str | None = None,
        server: str | list[str] | None = None,
        client: str | None = None,
        action_field: str = "message",
        observation_field: str | None = None,
        reset_columns: list[str] | None = None,
        observe_reset: bool = True,
        frame: str = "auto",
        observation_role: str = "user",
        reward_name: str = "openenv",
        reward_weight: float = 1.0,
        timeout_s: float = 30.0,
        max_retries: int = 2,
        max_concurrency: int = 8,
        startup_timeout_s: float = 120.0,
        max_turns: int = 4,
        max_turn_tokens: int | None = None,
        max_observation_tokens: int = 256,
    ) -> None:
        """
        Args:
            url: a running server (``http://host:port``); or
            server: one the run starts and stops: ``pkg.module:app`` (served by uvicorn) or a command (a string or
                a list) with ``{port}`` where it takes its port.
            client: the environment's client class (``pkg.module:EchoEnv``, an ``EnvClient``); default
                ``GenericEnvClient`` (actions and observations as dicts).
            action_field: the action's text field: a turn is sent as ``{action_field: turn text}``.
            observation_field: the observation's text field; default: its one field besides done, reward and
                metadata (several: all of them, as JSON).
            reset_columns: dataset columns passed to the server's ``reset`` as keyword arguments (e.g. ``seed``).
            observe_reset: reset's observation is appended to the prompt (its last message).
            frame: ``chat_template`` (an observation is an ``observation_role`` message rendered by the chat template,
                up to the next assistant header), ``plain`` (its text as it is) or ``auto`` (the chat template when
                the tokenizer has one).
            observation_role: the role of an observation's message (``user``, or ``tool`` for a template that takes it).
            reward_name: the reward part the observations' rewards are summed into (``env_<reward_name>``).
            reward_weight: the weight of the part's column, as a ``data.rewards`` weight (``reward_weights``).
            timeout_s: time limit of one request (connect, reset, step).
            max_retries: tries after the first, for a fault of the server or the connection.
            max_concurrency: trajectories stepped at once (threads; 1: one at a time).
            startup_timeout_s: how long a server the run starts may take to answer.
            max_turns: policy turns per trajectory at most.
            max_turn_tokens: tokens per policy turn; None = ``data.sampling.max_new_tokens``.
            max_observation_tokens: tokens of one observation at most (its text cut inside its frame).
        """
        super().__init__(max_turns, max_turn_tokens, max_observation_tokens)
        if (url is None) == (server is None):
            raise ConfigError(f"{SETTING}: give url (a running OpenEnv server) or server (one the run starts): one")
        if url is not None and not re.match(r"^(https?|wss?)://[^/\s]+", str(url)):
            raise ConfigError(f"{SETTING}.url must be http://host:port (got {url!r})")
        for name, value, low in (("timeout_s", timeout_s, 0), ("startup_timeout_s", startup_timeout_s, 0)):
            if not value > low:
                raise ConfigError(f"{SETTING}.{name} must be > 0 (got {value})")
        for name, value, low in (("max_retries", max_retries, 0), ("max_concurrency", max_concurrency, 1)):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{SETTING}.{name} must be an integer >= {low} (got {value!r})")
        if not action_field or not isinstance(action_field, str):
            raise ConfigError(f"{SETTING}.action_field must name the action's text field (got {action_field!r})")
        self.reset_columns = list(reset_columns or [])
        if not all(isinstance(column, str) for column in self.reset_columns):
            raise ConfigError(f"{SETTING}.reset_columns must be a list of column names (got {reset_columns!r})")
        self.frame_name = check_frame(frame, f"{SETTING}.frame")
        env_client, generic = _client_classes()
        self.client_class = generic if client is None else _import(client, f"{SETTING}.client")
        if not (inspect.isclass(self.client_class) and issubclass(self.client_class, env_client)):
            raise ConfigError(f"{SETTING}.client: {client!r} is not an OpenEnv client class (an EnvClient subclass)")
        self.action_class = action_class(self.client_class, env_client)
        argv = server_command(server, f"{SETTING}.server") if server is not None else None
        self.backend = OpenEnvBackend(str(url).rstrip("/") if url else None, argv, startup_timeout_s)
        self.action_field, self.observation_field = action_field, observation_field
        self.observe_reset, self.observation_role = observe_reset, observation_role
        self.reward_name, self.reward_weight = reward_name, float(reward_weight)
        self.timeout_s, self.max_retries, self.max_concurrency = timeout_s, max_retries, max_concurrency
        self.frame: MessageFrame | None = None
        self.session: OpenEnvSession | None = None  # this trajectory's (a spawned copy's), from reset
        self.first: str | None = None  # reset's text, for the prompt

    # ------------------------------------------------------------------------------------------ setup, checks
    def setup(self, tokenizer: Any) -> None:
        """Renders the observation frame, checks it fits ``max_observation_tokens``, and checks a running server's
        schema (``url``) against ``action_field`` / ``observation_field`` now, before training."""
        super().setup(tokenizer)
        self.frame = MessageFrame(tokenizer, self.frame_name, self.chat_template_kwargs)
        check_frame_fits(self, self.frame, self.observation_role)
        if self.backend.server is None:
            self.check_schema()

    def required_columns(self) -> tuple[str, ...]:
        return tuple(self.reset_columns)

    def check_schema(self) -> None:
        """Refuses, in one line, an ``action_field`` / ``observation_field`` the server's ``/schema`` does not list
        (a server without ``/schema``: nothing to check). Once per server."""
        if self.backend.checked:
            return
        schema = with_retries(
            "read its /schema",
            lambda url: get_json(re.sub(r"^ws", "http", url) + "/schema", self.timeout_s),
            backend=self.backend,
            where=lambda: self.backend.describe(self.client_class),
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
        )
        self.backend.checked = True
        for setting, field, part in (
            ("action_field", self.action_field, "action"),
            ("observation_field", self.observation_field, "observation"),
        ):
            properties = ((schema or {}).get(part) or {}).get("properties")
            if field is not None and properties and field not in properties:
                known = ", ".join(name for name in properties if name not in _STANDARD_FIELDS)
                raise ConfigError(f"{SETTING}.{setting}: the server's {part} has no field {field!r}; it has {known}")

    # ------------------------------------------------------------------------------------------ one trajectory
    def reset(self, row: dict[str, Any]) -> str | None:
        """Opens this trajectory's session and resets it with the row's ``reset_columns``; reset's text goes into
        the prompt (``trajectory_prompt``), not after it."""
        self.check_schema()
        self.session = OpenEnvSession(self.backend, self.client_class, self.timeout_s, self.max_retries)
        answer = self.session.reset({column: row[column] for column in self.reset_columns})
        self.first = self.observation_text(answer["observation"]) if self.observe_reset else None
        return None

    def trajectory_prompt(self, prompt: Any) -> Any:
        """``prompt`` with reset's text appended to its last message (to the text, for a string prompt)."""
        if not self.first:
            return prompt
        if isinstance(prompt, str):
            return f"{prompt}\n\n{self.first}"
        last = dict(prompt[-1])
        last["content"] = f"{last.get('content') or ''}\n\n{self.first}"
        return [*prompt[:-1], last]

    def step(self, turn: str) -> Step:
        """Sends the turn as an action; the observation (unless done), its reward and whether it is done."""
        action = self.make_action(turn)
        if self.session is None:
            raise RuntimeError("OpenEnvEnvironment.step before reset: a trajectory's copy is reset first")
        before = self.session.retries
        answer = self.session.step(action)
        rewards = {} if answer["reward"] is None else {self.reward_name: float(answer["reward"])}  # reward_weights()
        metrics = {"openenv_retries": float(self.session.retries - before)}
        if answer["done"]:
            return Step(rewards=rewards, done=True, metrics=metrics)
        text = self.observation_text(answer["observation"])
        observation = fit_messages(self, self.frame, self._messages(text))
        return Step(observation=observation, rewards=rewards, metrics=metrics)

    def final_rewards(self) -> dict[str, float]:
        """Closes this trajectory's session; reset's reward, when it gave one."""
        if self.session is None:
            return {}
        self.session.close()
        reward = (self.session.reset_answer or {}).get("reward")
        return {self.reward_name: float(reward)} if reward else {}

    def reward_weights(self) -> dict[str, float]:
        """``reward_weight``, the weight of the column ``env_<reward_name>`` (applied where data.rewards' are)."""
        return {self.reward_name: self.reward_weight}

    def close(self) -> None:
        """Closes every open session and stops the server the run started (also done at the interpreter's exit)."""
        self.backend.close()

    def __enter__(self) -> OpenEnvEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ text and actions
    def _messages(self, text: str) -> list[dict[str, Any]]:
        return [{"role": self.observation_role, "content": text}]

    def make_action(self, turn: str) -> Any:
        """The action a turn is sent as: ``{action_field: turn}``, or the client's action class built from it."""
        if self.action_class is None:
            return {self.action_field: turn}
        try:
            return self.action_class(**{self.action_field: turn})
        except Exception as err:  # noqa: BLE001 - pydantic's validation error: the setting does not fit the class
            raise ConfigError(
                f"{SETTING}.action_field: {self.action_class.__name__}({self.action_field}=<turn text>) fails "
                f"({one_line(err)}); name the action's text field"
            ) from err

    def observation_text(self, observation: Any) -> str:
        """The text of an observation: ``observation_field``, its one field besides done/reward/metadata, or its
        fields as JSON."""
        data = jsonable(observation)
        if not isinstance(data, Mapping):
            return str(data)
        if self.observation_field is not None:
            if self.observation_field not in data:
                known = ", ".join(k for k in data if k not in _STANDARD_FIELDS)
                raise ConfigError(
                    f"{SETTING}.observation_field: the observation has no field {self.observation_field!r}; "
                    f"its fields: {known}"
                )
            value = data[self.observation_field]
        else:
            fields = {k: v for k, v in data.items() if k not in _STANDARD_FIELDS}
            value = next(iter(fields.values())) if len(fields) == 1 else fields
        return value if isinstance(value, str) else json.dumps(value, default=str)
