"""``ToolEnvironment(max_concurrency=n)``: the calls of a turn's trajectories run at once in threads (tools that wait
on I/O), their answers in the trajectories' order; a call in a thread past ``timeout_s`` is answered as timed out."""

from __future__ import annotations

import threading
import time

import pytest

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.environments.turn_loop import step_environments
from grpo_lightning.models.tiny import build_char_tokenizer

TOGETHER = threading.Barrier(4)


def all_at_once(argument: str) -> str:
    """Returns only once four calls wait here together: calls made one after the other time out."""
    TOGETHER.wait(timeout=5)
    return f"got {argument}"


def sleeps(argument: str) -> str:
    time.sleep(float(argument))
    return "late"


def environments(tool: str, n: int, **kwargs) -> list[ToolEnvironment]:
    env = ToolEnvironment(tools=[f"test_tool_env_concurrency:{tool}"], format="tag", **kwargs)
    env.setup(build_char_tokenizer())
    return [env.spawn() for _ in range(n)]


def test_the_calls_of_a_turn_run_at_once_and_answer_in_the_trajectories_order():
    envs = environments("all_at_once", 4, max_concurrency=4)
    turns = [f"<tool>all_at_once: {i}</tool>" for i in range(4)]
    steps = step_environments(envs, turns, max_workers=envs[0].max_concurrency)
    assert [s.observation for s in steps] == [f"<result>got {i}</result>" for i in range(4)]


def test_a_call_in_a_thread_past_its_time_limit_is_answered_as_timed_out():
    envs = environments("sleeps", 2, max_concurrency=2, timeout_s=0.2)
    steps = step_environments(envs, ["<tool>sleeps: 0</tool>", "<tool>sleeps: 3</tool>"], max_workers=2)
    assert steps[0].observation == "<result>late</result>"
    assert steps[1].observation == "<result>error: timed out after 0.2s</result>"


def test_max_concurrency_below_one_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^data.environment.init_args.max_concurrency must be an integer >= 1"):
        ToolEnvironment(max_concurrency=0)
