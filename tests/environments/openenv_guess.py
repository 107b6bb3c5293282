"""A small OpenEnv environment for the tests (server side, against ``openenv`` 0.10): guess a number.

``reset(target=...)`` starts an episode (without one: a random puzzle, named in the observation: a reset that is not
deterministic); each step
reads the last number of the action's ``message``: the target ends the episode with reward 1, another number is
answered ``higher`` / ``lower`` (reward -0.1), no number ``say a number`` (reward 0). Words in the message drive the
faults the tests need: ``sleep:<s>`` sleeps first (a slow step), ``crash`` raises (a broken environment),
``flaky`` raises on its first step of the whole server only (a transient fault). ``app`` serves it with room for 64
sessions, ``small_app`` with room for 2. The server counts the steps in flight (``STATS``), to see concurrency.
"""

from __future__ import annotations

import random
import re
import threading
import time
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

STATS = {"in_flight": 0, "most_in_flight": 0, "flaky_failed": False, "steps": 0}
_LOCK = threading.Lock()


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id="none", step_count=0)
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: Any = None, **_: Any):
        self._state = State(episode_id=episode_id or "episode", step_count=0)
        if target is not None:
            self.target = int(target)
            return GuessObservation(feedback="Guess the number.", done=False, reward=0.0)
        self.target = random.randint(1, 10**6)  # a puzzle of its own, which the observation names
        return GuessObservation(feedback=f"Guess the number (puzzle {random.randint(1, 10**9)}).", reward=0.0)

    def step(self, action: GuessAction, **_: Any) -> GuessObservation:
        with _LOCK:
            STATS["in_flight"] += 1
            STATS["steps"] += 1
            STATS["most_in_flight"] = max(STATS["most_in_flight"], STATS["in_flight"])
        try:
            return self._answer(action.message)
        finally:
            with _LOCK:
                STATS["in_flight"] -= 1

    def _answer(self, message: str) -> GuessObservation:
        self._state.step_count += 1
        slow = re.search(r"sleep:([0-9.]+)", message)
        if slow:
            time.sleep(float(slow.group(1)))
        if "crash" in message:
            raise RuntimeError("the environment crashed")
        if "flaky" in message:
            with _LOCK:
                failed, STATS["flaky_failed"] = STATS["flaky_failed"], True
            if not failed:
                raise RuntimeError("a transient fault")
        numbers = re.findall(r"-?\d+", re.sub(r"sleep:[0-9.]+", "", message))
        if not numbers:
            return GuessObservation(feedback="say a number", done=False, reward=0.0)
        guess = int(numbers[-1])
        if guess == self.target:
            return GuessObservation(feedback="right", done=True, reward=1.0)
        return GuessObservation(feedback="higher" if guess < self.target else "lower", done=False, reward=-0.1)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
small_app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=2)
