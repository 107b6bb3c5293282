"""``SkyRLGymEnvironment``: a skyrl-gym environment (``skyrl-gym`` 0.4) by id, one instance per trajectory.

skyrl-gym's text environments (``BaseTextEnv``) are made per trajectory with ``skyrl_gym.make(id,
env_config=..., extras=row)``; ``init(prompt messages) -> (messages, metadata)`` gives the prompt the model starts
from; ``step(turn text) -> {observations, reward, done, metadata}`` answers each turn with chat messages;
``close()`` ends it. As SkyRL's generator runs them (``SkyRLGymGenerator.agent_loop``):

- the environment is the row's ``env_class`` column (SkyRL's dataset format), or ``env_id`` for every row; its
  ``env_config`` is ``env_config[<id>]``; ``extras`` are the row's other columns (``reward_spec``, ``extra_info``,
  ...) and ``max_turns`` (which SkyRL also puts there);
- the messages ``init`` returns are the trajectory's prompt (``trajectory_prompt``);
- each step's messages are rendered by the chat template after the turn, up to the next assistant header
  (``message_frames.py``), tokenized on their own and appended: the turn's tokens stay the policy's own (SkyRL's
  "token-in-token-out"); a ``postprocessed_action`` the environment returns is not applied (it would change the
  turn's tokens after the fact; SkyRL warns about it too);
- each step's ``reward`` is summed into the reward part ``reward_name`` (``env_skyrl_gym``, weight
  ``reward_weight``); SkyRL places each at its turn's last token instead: the total is the same.

An environment that raises is reported in one line naming it (``RuntimeError``): a Python environment in this
process, its faults are not transient (a tool's own network calls retry themselves).
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.errors import EnvironmentCrashed
from grpo_lightning.integrations.environments.base import Environment, Step
from grpo_lightning.integrations.environments.message_frames import (
    MessageFrame,
    check_frame,
    check_frame_fits,
    fit_messages,
)

SETTING = "data.environment.init_args"
INSTALL = 'pip install -e ".[skyrl-gym]"'
COLUMN = "env_class"  # SkyRL's dataset column naming a row's environment


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError as err:
        raise ConfigError(f"data.environment: SkyRLGymEnvironment needs skyrl-gym ({err}); {INSTALL}") from err
    return skyrl_gym


def _messages(prompt: Any) -> list[dict[str, Any]]:
    """The prompt as chat messages (a string as one user message), copied: ``init`` may change them."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    # A dataset column of messages is a list of structs: keys another message has are None here (left out).
    return [{k: copy.deepcopy(v) for k, v in dict(m).items() if v is not None} for m in prompt]


class SkyRLGymEnvironment(Environment):
    """A skyrl-gym environment by id (``env_id``, or each row's ``env_class``); one instance per trajectory."""

    shared = (*Environment.shared, "frame", "configs")

    def __init__(
        self,
        env_id: str | None = None,
        env_config: dict[str, dict[str, Any]] | None = None,
        imports: list[str] | None = None,
        frame: str = "auto",
        reward_name: str = "skyrl_gym",
        reward_weight: float = 1.0,
        max_concurrency: int = 1,
        max_turns: int = 4,
        max_turn_tokens: int | None = None,
        max_observation_tokens: int = 256,
    ) -> None:
        """
        Args:
            env_id: the registered id of every row's environment (``gsm8k_multi_turn``); null: each row's
                ``env_class`` column names its own (SkyRL's dataset format).
            env_config: each environment's ``env_config``, by id (``{text2sql: {db_file_path: ...}}``; SkyRL's
                ``environment.skyrl_gym.<id>``).
            imports: modules imported first, which register environments of their own (``skyrl_gym.register``).
            frame: ``chat_template`` (the step's messages rendered by the chat template, up to the next assistant
                header), ``plain`` (their contents) or ``auto`` (the chat template when the tokenizer has one).
            reward_name: the reward part the steps' rewards are summed into (``env_<reward_name>``).
            reward_weight: the weight of the part's column, as a ``data.rewards`` weight (``reward_weights``).
            max_concurrency: trajectories stepped at once (threads: for environments that wait on I/O).
            max_turns: policy turns per trajectory at most (also given to the environment as ``extras.max_turns``).
            max_turn_tokens: tokens per policy turn; None = ``data.sampling.max_new_tokens``.
            max_observation_tokens: tokens of one observation at most (the last message's text cut inside its frame).
        """
        super().__init__(max_turns, max_turn_tokens, max_observation_tokens)
        _skyrl_gym()  # installed, or one line naming the extra
        for module in imports or []:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise ConfigError(f"{SETTING}.imports: cannot import {module!r} ({_one_line(err)})") from err
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ConfigError(f"{SETTING}.max_concurrency must be an integer >= 1 (got {max_concurrency!r})")
        if env_config is not None and not (
            isinstance(env_config, dict) and all(isinstance(v, dict) for v in env_config.values())
        ):
            raise ConfigError(f"{SETTING}.env_config must map an environment id to its config ({{id: {{...}}}})")
        from omegaconf import OmegaConf  # a dependency of skyrl-gym: environments read their config as attributes

        self.configs = {key: OmegaConf.create(value) for key, value in (env_config or {}).items()}
        self.env_id, self.frame_name = env_id, check_frame(frame, f"{SETTING}.frame")
        if env_id is not None:
            self.check_id(env_id, f"{SETTING}.env_id")
        for key in self.configs:
            self.check_id(key, f"{SETTING}.env_config")
        self.reward_name, self.reward_weight, self.max_concurrency = reward_name, float(reward_weight), max_concurrency
        self.frame: MessageFrame | None = None
        self.env: Any = None  # this trajectory's instance (a spawned copy's)
        self.id: str | None = None
        self.prompt: list[dict[str, Any]] | None = None

    @staticmethod
    def check_id(env_id: Any, where: str) -> None:
        """Refuses, in one line, an id skyrl-gym has not registered."""
        registry = _skyrl_gym().envs.registration.registry
        if env_id not in registry:
            raise ConfigError(
                f"{where}: {env_id!r} is not a registered skyrl-gym environment; registered: {', '.join(registry)} "
                f"(register your own in a module named in {SETTING}.imports)"
            )

    def setup(self, tokenizer: Any) -> None:
        """Renders the observation frame and checks it fits ``max_observation_tokens``."""
        super().setup(tokenizer)
        self.frame = MessageFrame(tokenizer, self.frame_name, self.chat_template_kwargs)
        check_frame_fits(self, self.frame, "user")

    def required_columns(self) -> tuple[str, ...]:
        return (COLUMN,) if self.env_id is None else ()

    def check_rows(self, data: Any, where: str) -> None:
        """Each row's environment is registered, and each environment is made from the first row that uses it (its
        own check of the row: a missing ``reward_spec``), before training."""
        ids = data[COLUMN] if self.env_id is None else [self.env_id] * len(data)
        first: dict[str, int] = {}
        for index, env_id in enumerate(ids):
            self.check_id(env_id, f"{where} row {index}: its {COLUMN}")
            first.setdefault(env_id, index)
        for env_id, index in first.items():
            self.make(env_id, data[index], f"{where} row {index}").close()

    def make(self, env_id: str, row: dict[str, Any], where: str = "data.environment") -> Any:
        """``skyrl_gym.make(env_id, env_config=..., extras=row's columns + max_turns)``; one line if it fails."""
        extras = {key: value for key, value in row.items() if key not in ("prompt", COLUMN)}
        extras["max_turns"] = self.max_turns  # as SkyRL's generator sets it
        try:
            return _skyrl_gym().make(env_id, env_config=self.configs.get(env_id), extras=extras)
        except Exception as err:  # noqa: BLE001 - an environment's own refusal of the row (asserts, KeyErrors)
            raise ConfigError(
                f"{where}: the skyrl-gym environment {env_id!r} cannot start from this row "
                f"({type(err).__name__}: {_one_line(err)}); its columns are passed as extras"
            ) from err

    def reset(self, row: dict[str, Any]) -> str | None:
        """Makes this trajectory's instance and ``init``s it with the prompt; its messages become the prompt."""
        self.id = self.env_id if self.env_id is not None else row.get(COLUMN)
        self.env = self.make(self.id, row)
        given = _messages(row["prompt"])
        messages, _ = self._call("init", copy.deepcopy(given))
        self.prompt = None if messages == given else list(messages)
        return None

    def trajectory_prompt(self, prompt: Any) -> Any:
        """The messages ``init`` returned (``prompt`` itself when it changed nothing)."""
        return prompt if self.prompt is None else self.prompt

    def step(self, turn: str) -> Step:
        output = self._call("step", turn)
        reward = output.get("reward")
        rewards = {} if reward is None else {self.reward_name: float(reward)}  # weighed by reward_weights()
        if output.get("done"):
            return Step(rewards=rewards, done=True)
        observation = fit_messages(self, self.frame, list(output.get("observations") or []))
        return Step(observation=observation, rewards=rewards)

    def reward_weights(self) -> dict[str, float]:
        """``reward_weight``, the weight of the column ``env_<reward_name>``."""
        return {self.reward_name: self.reward_weight}

    def final_rewards(self) -> dict[str, float]:
        """Closes this trajectory's instance (its rewards came with its steps)."""
        if self.env is not None:
            env, self.env = self.env, None
            env.close()
        return {}

    def _call(self, method: str, *arguments: Any) -> Any:
        try:
            return getattr(self.env, method)(*arguments)
        except Exception as err:  # noqa: BLE001 - the environment's own failure: one line naming it
            raise EnvironmentCrashed(
                f"data.environment: the skyrl-gym environment {self.id!r} failed in {method} "
                f"({type(err).__name__}: {_one_line(err)})"
            ) from err
