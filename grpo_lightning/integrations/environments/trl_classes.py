"""``TRLEnvironment``: a class written for TRL 1.16's ``environment_factory`` runs here unchanged.

TRL's convention (``GRPOTrainer(environment_factory=...)``, read from its ``grpo_trainer.py``):

- the factory (a class, or a callable returning an instance) makes an instance per rollout; ``reset(**row)`` starts
  it from the dataset row and returns None or text, which TRL appends to the prompt's last message;
- every public function of the class (``inspect.getmembers(cls, inspect.isfunction)``: by name, not ``_``-prefixed,
  ``reset`` and ``get_reward`` aside) is a tool, described by ``transformers.utils.get_json_schema`` (type hints and
  a Google-style docstring) and listed in the prompt by the chat template (``apply_chat_template(tools=...)``);
- a tool call runs the method with the call's JSON arguments by name; ``str`` of its return value is the tool message;
- ``get_reward()``, when the class has it, is asked once the rollout is over: a reward of weight 1, named after the
  class, added to the reward functions' weighted sum;
- a dict of factories chooses per row by the row's ``environment`` column, which ``reset`` is not given.

Here the same class runs through the multi-turn rollout (``integrations/environments/multiturn.py``): one fresh instance
per trajectory (made when its copy of this environment is reset, as the row names the class); the schemas reach the
prompt through ``prompt_tools`` and reset's text through ``trajectory_prompt`` (rendered as TRL renders them); calls
and results are in the chat template's own format (``chat_formats.py``); ``get_reward`` is a ``final_rewards`` part
``<ClassName>`` (logged ``reward/env_<ClassName>``), a reward column of weight 1 as in TRL: None (TRL's NaN) for a
trajectory of another class or whose ``get_reward`` returned None, so out of that column's mean and, when no other
column scores it, out of its group's baseline (``rewards/scorer.py``); reward functions get each trajectory's prompt
as TRL's do (reset's text in it) and its instance as ``environments`` (``reward_view``).

Where this differs from TRL, on purpose:

- a turn stops at its first complete call and that call is answered (TRL runs every call of a turn);
- a failed call is answered ``error: <why>`` as ``ToolEnvironment`` answers it (TRL writes ``{'error': '<why>'}``),
  and a call past ``timeout_s`` fails (TRL has no time limit);
- a result is cut to fit ``max_observation_tokens`` inside the template's frame (TRL keeps it whole, or drops it and
  ends the rollout when it overflows the completion length);
- a fresh instance per trajectory (TRL keeps a pool of instances and resets them between rollouts);
- ``max_turns`` bounds the turns (TRL's ``max_tool_calling_iterations`` is unbounded by default); text only (a list
  of content parts from ``reset`` or a tool is not supported);
- ``data.rewards`` is still needed (TRL's ``reward_funcs`` may be left out when the class has ``get_reward``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from dataclasses import dataclass
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments.base import Environment, Step
from grpo_lightning.integrations.environments.chat_formats import FAMILIES, SETTING, detect_chat_format
from grpo_lightning.integrations.environments.formats import TagFormat, ToolCall, ToolFormat
from grpo_lightning.integrations.environments.tool_env import check_result_frame, final_answer, tool_step
from grpo_lightning.integrations.environments.tools import ToolBroken
from grpo_lightning.rewards.time_limits import TimeLimitExceeded, time_limit

FACTORY = "data.environment.init_args.factory"
COLUMN = "environment"  # TRL's: the row's name of its environment, with a dict of factories
_NOT_TOOLS = ("reset", "get_reward")


@dataclass(frozen=True)
class TRLClass:
    """One factory of ``factory``, resolved: what makes an instance, its class and the tools TRL derives from it."""

    spec: str
    make: Any  # the class or the callable: called with no argument, one instance per trajectory
    cls: type
    methods: dict[str, str]  # a tool's name (its schema's) → the method's attribute name
    schemas: list[dict[str, Any]]  # transformers.utils.get_json_schema of each public method, in TRL's order
    rewarded: bool  # the class defines get_reward

    def parameters(self, tool: str) -> dict[str, Any]:
        """The schemas of ``tool``'s parameters, by name."""
        schema = next(s for s in self.schemas if s["function"]["name"] == tool)
        return schema["function"]["parameters"].get("properties", {})


def _import(spec: str, setting: str) -> Any:
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise ConfigError(f"{setting}: {spec!r} is not an import path; write pkg.module:Class")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{setting}: cannot import {spec!r} ({err})") from err


def resolve_class(spec: str, setting: str = FACTORY) -> TRLClass:
    """The factory ``spec`` names (``pkg.module:Class``, or a callable returning an instance, which is called once
    here to learn its class, as TRL probes one), checked as TRL checks it and its tools' schemas derived as TRL
    derives them; ``ConfigError`` in one line for what TRL would refuse or fail on."""
    from transformers.utils import get_json_schema

    make = _import(spec, setting)
    if not callable(make):
        raise ConfigError(f"{setting}: {spec!r} is not a class or a callable that returns an environment")
    cls = make if inspect.isclass(make) else type(make())
    functions = dict(inspect.getmembers(cls, inspect.isfunction))  # on the class: properties are not evaluated
    if "reset" not in functions:
        raise ConfigError(
            f"{setting}: {spec} ({cls.__name__}) has no reset method; a TRL environment class defines "
            "reset(**row), returning the first observation or None"
        )
    methods, schemas = {}, []
    for member, function in functions.items():  # sorted by name, as TRL lists them
        if member in _NOT_TOOLS or member.startswith("_"):
            continue
        try:
            schema = get_json_schema(function)  # the receiver (self) is left out, as for a bound method
        except Exception as err:  # noqa: BLE001 - transformers' parsing errors: TRL would fail on the first prompt
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ConfigError(
                f"{setting}: {cls.__name__}.{member} is public, so a tool, but has no schema ({reason}); give it type "
                "hints and a Google-style docstring with Args:, or name it _private"
            ) from err
        methods[schema["function"]["name"]] = member
        schemas.append(schema)
    return TRLClass(spec, make, cls, methods, schemas, "get_reward" in functions)


def _awaited(value: Any) -> Any:
    # TRL accepts async tools and an async get_reward: run to completion here (rollouts run no event loop).
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def _types(schema: Any) -> tuple[str, ...]:
    """The JSON types a parameter's schema allows (``type``, a list of them, ``anyOf``/``oneOf``, ``nullable``)."""
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    found = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for choices in (schema.get("anyOf"), schema.get("oneOf")):
        found += [t for choice in choices or () for t in _types(choice)]
    return (*found, "null") if schema.get("nullable") else tuple(found)


def typed_argument(value: Any, schema: Any) -> Any:
    """A call's argument as the tool's schema types it: a string given for a parameter that takes no string
    (``"7"`` for an integer) read as that type, as TRL's response parser reads one; anything else unchanged."""
    types = _types(schema)
    if not isinstance(value, str) or not types or "string" in types:
        return value
    text = value.strip()
    for kind in types:
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind == "null" and text in ("null", "None"):
            return None
        try:
            decoded = json.loads(text)
        except ValueError:
            continue
        is_number = isinstance(decoded, (int, float)) and not isinstance(decoded, bool)
        if kind == "integer" and is_number and float(decoded).is_integer():
            return int(decoded)
        if (kind == "number" and is_number) or (kind, type(decoded)) in (("object", dict), ("array", list)):
            return decoded
    return value


class TRLEnvironment(Environment):
    """A TRL ``environment_factory`` class (or a dict of them, chosen by the row's ``environment`` column)."""

    shared = (*Environment.shared, "format", "classes")  # read-only: every trajectory's copy uses the same

    def __init__(
        self,
        factory: str | dict[str, str],
        timeout_s: float | None = 10.0,
        max_result_chars: int | None = None,
        max_turns: int = 4,
        max_turn_tokens: int | None = None,
        max_observation_tokens: int = 256,
    ) -> None:
        """
        Args:
            factory: ``pkg.module:Class`` (a class, or a callable returning an instance), as TRL's
                ``environment_factory`` takes it; or ``{name: pkg.module:Class}``, each row choosing by its
                ``environment`` column (TRL's dict of factories).
            timeout_s: time limit of one tool call; null: none (as in TRL).
            max_result_chars: a longer result is cut to this many characters (and says so); null: no limit but
                ``max_observation_tokens``.
            max_turns: policy turns per trajectory at most.
            max_turn_tokens: tokens per policy turn; None = ``data.sampling.max_new_tokens``.
            max_observation_tokens: tokens of one observation at most: the result is cut to fit inside its frame.
        """
        super().__init__(max_turns, max_turn_tokens, max_observation_tokens)
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"data.environment.init_args.timeout_s must be > 0 or null (got {timeout_s})")
        if max_result_chars is not None and max_result_chars < 1:
            raise ConfigError(
                f"data.environment.init_args.max_result_chars must be >= 1 or null (got {max_result_chars})"
            )
        self.by_row = isinstance(factory, dict)
        if self.by_row and not factory:
            raise ConfigError(f"{FACTORY} is an empty mapping: name at least one environment class")
        specs = factory if isinstance(factory, dict) else {None: factory}
        for name, spec in specs.items():
            if not isinstance(spec, str) or (self.by_row and not isinstance(name, str)):
                raise ConfigError(
                    f"{FACTORY} must be pkg.module:Class or {{name: pkg.module:Class}} (got {name!r}: {spec!r})"
                )
        self.classes: dict[str | None, TRLClass] = {
            name: resolve_class(spec, FACTORY if name is None else f"{FACTORY}.{name}") for name, spec in specs.items()
        }
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self.format: ToolFormat = TagFormat()  # the chat template's, from setup
        self.chosen: TRLClass | None = None  # this trajectory's class and instance (a spawned copy's, from reset)
        self.instance: Any = None
        self.first: str | None = None

    def setup(self, tokenizer: Any) -> None:
        """Finds the chat template's tool-call format (TRL needs a template that renders tool calls) and checks
        that a result's frame fits ``max_observation_tokens``."""
        super().setup(tokenizer)
        if "tools" in self.chat_template_kwargs:
            raise ConfigError(
                "data.chat_template_kwargs.tools: with TRLEnvironment the tools are the classes' public methods; "
                "leave tools out"
            )
        needs = f"TRLEnvironment calls tools in the chat template's own format: a {FAMILIES} template"
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"data.environment: the tokenizer has no chat template; {needs}")
        try:
            family = detect_chat_format(tokenizer, self.chat_template_kwargs)
        except ConfigError as err:
            reason = str(err).removeprefix(f"{SETTING}: ").split("; use format")[0]
            raise ConfigError(f"data.environment: {reason}; {needs}") from err
        if family is None:
            raise ConfigError(f"data.environment: the tokenizer's chat template does not write tool calls; {needs}")
        self.format = family
        check_result_frame(self, self.format)

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return self.format.stop_texts

    def required_columns(self) -> tuple[str, ...]:
        return (COLUMN,) if self.by_row else ()

    def _known(self) -> str:
        return f"one of {FACTORY}'s names ({', '.join(str(name) for name in self.classes)})"

    def check_rows(self, data: Any, where: str) -> None:
        if not self.by_row:
            return
        for row, name in enumerate(data[COLUMN]):
            if name not in self.classes:
                raise ConfigError(f"{where} row {row}: its {COLUMN} {name!r} is not {self._known()}")

    def chosen_class(self, row: dict[str, Any]) -> TRLClass:
        """The class ``row`` runs: the one factory, or the one its ``environment`` column names."""
        name = row.get(COLUMN) if self.by_row else None
        if name not in self.classes:
            raise ConfigError(f"data.environment: a row's {COLUMN} {name!r} is not {self._known()}")
        return self.classes[name]

    def prompt_tools(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        return self.chosen_class(row).schemas or None  # TRL's `or None`: no tool preamble for a class without tools

    def reset(self, row: dict[str, Any]) -> str | None:
        """A fresh instance of the row's class, reset with the row (the ``environment`` column left out, as TRL
        does with a dict of factories); reset's text goes into the prompt (``trajectory_prompt``), not after it."""
        self.chosen = self.chosen_class(row)
        self.instance = self.chosen.make()
        arguments = {key: value for key, value in row.items() if not (self.by_row and key == COLUMN)}
        first = _awaited(self.instance.reset(**arguments))
        if first is not None and not isinstance(first, str):
            raise ConfigError(
                f"data.environment: {self.chosen.cls.__name__}.reset returned {type(first).__name__}; it returns the "
                "first observation as text, or None (content parts are not supported)"
            )
        self.first = first
        return None

    def trajectory_prompt(self, prompt: Any) -> Any:
        """``prompt`` with reset's text appended to its last message, as TRL appends it."""
        if not self.first:
            return prompt
        if isinstance(prompt, str):  # rendered as the user message: the same text as the message appended to
            return prompt + self.first
        last = dict(prompt[-1])
        last["content"] = (last.get("content") or "") + self.first
        return [*prompt[:-1], last]

    def step(self, turn: str) -> Step:
        call = self.format.last_call(turn)
        if call is None:
            return final_answer()  # no tool call: the final answer
        return tool_step(self, lambda: self.run(call) if call.error is None else (call.error, True))

    def run(self, call: ToolCall) -> tuple[str, bool]:
        """``(result text, failed)`` of one call on this trajectory's instance: the method called with the call's
        arguments by name, typed by its schema. Raises only for ``ToolBroken`` and an interrupt."""
        if self.chosen is None:
            raise RuntimeError("TRLEnvironment.run before reset: a trajectory's copy is reset first")
        member = self.chosen.methods.get(call.name or "")
        if member is None:
            return f"unknown tool {call.name!r}; tools: {', '.join(self.chosen.methods) or 'none'}", True
        arguments = call.arguments
        if isinstance(arguments, str) and arguments.strip():
            try:  # a call that wrote its arguments as a JSON string
                arguments = json.loads(arguments)
            except ValueError:
                pass
        arguments = {} if arguments in (None, "") else arguments
        if not isinstance(arguments, dict):
            return f"the arguments must be a JSON object of named arguments (got {arguments!r})", True
        properties = self.chosen.parameters(call.name)
        arguments = {key: typed_argument(value, properties.get(key)) for key, value in arguments.items()}
        try:
            with time_limit(self.timeout_s):
                value = _awaited(getattr(self.instance, member)(**arguments))
        except TimeLimitExceeded:
            return f"timed out after {self.timeout_s:g}s", True
        except ToolBroken as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ToolBroken(
                f"data.environment: the tool {call.name!r} is broken, not the policy's call: {reason}"
            ) from err
        except Exception as err:  # noqa: BLE001 - every failure of a call is an observation, never a crash
            return str(err) or type(err).__name__, True
        return str(value), False  # TRL's tool message: str of the return value

    def reward_view(self) -> Any:
        """The user's instance, as TRL's reward functions get it in ``environments``."""
        return self.instance

    def final_rewards(self) -> dict[str, float]:
        """``{ClassName: get_reward()}`` when the class has ``get_reward`` (None from it: no reward part)."""
        if self.chosen is None or not self.chosen.rewarded:
            return {}
        value = _awaited(self.instance.get_reward())
        if value is None:
            return {}
        try:
            return {self.chosen.cls.__name__: float(value)}
        except (TypeError, ValueError):
            raise ConfigError(
                f"data.environment: {self.chosen.cls.__name__}.get_reward() returned {value!r}, not a number"
            ) from None
