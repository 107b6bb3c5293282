"""Partial rollouts of a multi-turn environment, its steps in the background (``integrations/environments/
partial_turns.py``): a turn that ends in segment k is launched in the segment's thread pool and its trajectory
parked; its observation joins in segment k + 1, which first waits for the steps still running.

The scripted policy and the counting calculator of ``test_partial_multiturn.py``; the environments below hold their
steps (a gate the test opens, a sleep, an exception) to show what a segment waits for and when.
"""

from __future__ import annotations

import threading
import time

import pytest
from test_partial_multiturn import (
    PROMPTS,
    CountingCalculator,
    ScriptedPolicy,
    Stream,
    partial_settings,
    segment,
)

from grpo_lightning.config import ConfigError, SamplingConfig, ScheduleConfig
from grpo_lightning.config_checks import check_partial_rollouts
from grpo_lightning.integrations.environments import Step, ToolEnvironment
from grpo_lightning.rollout.partial import Pool

GATE = threading.Event()


class Gated(CountingCalculator):
    """The counting calculator whose every step waits for ``GATE`` (2 s at most: a segment that waited for its
    steps would take that long), its trajectories' steps all at once."""

    def __init__(self) -> None:
        super().__init__(max_concurrency=8)

    def step(self, turn: str) -> Step:
        GATE.wait(timeout=2)
        return super().step(turn)


class Failing(CountingCalculator):
    """Every step raises, naming its trajectory's prompt; the first prompt's step ends last."""

    def reset(self, row):
        self.prompt = row["prompt"]
        return super().reset(row)

    def step(self, turn: str) -> Step:
        if self.prompt == PROMPTS[0]:
            time.sleep(0.2)
        raise RuntimeError(f"step failed on {self.prompt}")


def calculator(argument: str) -> str:
    """A tool behind a slow service: a call on an expression ending in ``*1`` takes a second."""
    time.sleep(1.0 if argument.strip().endswith("*1") else 0.0)
    return "slow"


def run(pool, engine, stream, environment, partial, index, held, counters=None):
    """Segment ``index`` under version ``index`` (its seed too)."""
    return segment(pool, engine, stream, environment, partial, index, index, held=held, counters=counters)


def samples_of(pool):
    return [s for g in pool.groups for s in g.samples]


def test_a_turn_that_ends_is_stepped_in_the_background_and_its_observation_joins_in_the_next_segment():
    GATE.clear()
    engine, stream, pool, held, environment = ScriptedPolicy(), Stream(2), Pool(), {}, Gated()
    partial = partial_settings(budget=64, staleness=12)  # every first turn (a tool call) ends in segment 0
    counters: dict[str, float] = {}
    assert run(pool, engine, stream, environment, partial, 0, held, counters) is None
    assert counters.keys() >= {"generate", "environment", "environment_wait"}  # sent though no group ended
    samples = samples_of(pool)
    assert all(not s.state["steps"] for s in samples), "a step ran inside the segment that ended its turn"
    assert all(s.stepping and not s.ended for s in samples)  # parked: its step may end it
    assert all(s.state["pending"][0].startswith("<tool>calculator") for s in samples)  # in the checkpoint's record
    threading.Timer(0.3, GATE.set).start()
    counters = {}
    run(pool, engine, stream, environment, partial, 1, held, counters)
    assert counters["environment_wait"] >= 0.2  # segment 1 waited for the steps, first
    for sample in samples:
        versions = sample.versions
        observation = versions.index(-1)  # the observation joined at segment 1's start: before its tokens
        assert set(versions[:observation]) == {0} and 0 not in versions[observation:] and 1 in versions
        assert sample.state["observations"][0].endswith(" #1</result>") and sample.state["steps"]


def test_a_trajectory_whose_final_answer_is_being_stepped_is_not_ended_nor_scored_before_the_step_is_collected():
    GATE.set()
    engine, stream, pool, held, environment = ScriptedPolicy(), Stream(2), Pool(), {}, CountingCalculator()
    partial = partial_settings(budget=64, staleness=12)
    answering, scored = [], 0
    for index in range(8):
        ready = run(pool, engine, stream, environment, partial, index, held)
        assert not any(s.stepping and s.ended for s in samples_of(pool))
        scored += 0 if ready is None else len(ready.numbers)
        answering += [
            (index, s) for s in samples_of(pool) if s.stepping and not s.state["pending"][0].startswith("<tool>")
        ]
        for when, sample in answering:
            if when == index - 1:  # the final answer's step, collected in the next segment: ended there
                assert sample.ended and sample.state["rewards"] == {"answered": 1.0} and not sample.stepping
    assert answering and scored


def test_a_step_that_raises_is_raised_when_the_next_segment_collects_it_the_first_in_trajectory_order():
    engine, stream, pool, held, environment = ScriptedPolicy(), Stream(2), Pool(), {}, Failing()
    partial = partial_settings(budget=64, staleness=12)
    run(pool, engine, stream, environment, partial, 0, held)  # launched, not waited for: nothing raised yet
    with pytest.raises(RuntimeError, match=rf"^step failed on {PROMPTS[0].replace('*', '[*]')}$"):
        run(pool, engine, stream, environment, partial, 1, held)


def test_a_step_in_a_thread_past_its_time_limit_is_answered_as_timed_out():
    environment = ToolEnvironment(
        tools=["test_partial_background_steps:calculator"], format="tag", timeout_s=0.2, max_concurrency=4,
        max_observation_tokens=64,
    )  # fmt: skip
    engine, stream, pool, held = ScriptedPolicy(), Stream(2), Pool(), {}
    partial = partial_settings(budget=64, staleness=12)
    run(pool, engine, stream, environment, partial, 0, held)
    pending = {id(s): s.state["pending"][0] for s in samples_of(pool)}
    run(pool, engine, stream, environment, partial, 1, held)
    answers = {}
    for sample in samples_of(pool):
        turn, observation = sample.state["steps"][0], sample.state["observations"][0]
        assert turn == pending[id(sample)]
        answers[turn.endswith("*1</tool>")] = observation
    assert answers == {True: "<result>error: timed out after 0.2s</result>", False: "<result>slow</result>"}


def test_a_staleness_bound_below_a_trajectorys_pushes_and_turns_is_refused_in_one_line():
    sampling, engine, environment = SamplingConfig(max_new_tokens=64), ScriptedPolicy(), CountingCalculator()
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=16, max_staleness=7)
    message = (
        r"^data.schedule.max_staleness 7 is below the 8 pushes .* tokens_per_push 16 \(\+ 4: its environment steps"
    )
    with pytest.raises(ConfigError, match=message):
        check_partial_rollouts(schedule, sampling=sampling, engine=engine, environment=environment)
    # A budget that covers max_new_tokens steps inside the segment, as a round: a push per trajectory.
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=64, max_staleness=1)
    check_partial_rollouts(schedule, sampling=sampling, engine=engine, environment=environment)


class MainThread(CountingCalculator):
    """Steps that need the main thread (a SIGALRM time limit, as TRL's classes): never in the background."""

    steps_in_threads = False
    threads: set[str] = set()  # noqa: RUF012 - the test's record, shared by every copy

    def step(self, turn: str) -> Step:
        MainThread.threads.add(threading.current_thread().name)
        return super().step(turn)


def test_an_environment_whose_steps_need_the_main_thread_is_stepped_inside_the_segment_as_before():
    engine, stream, pool, held, environment = ScriptedPolicy(), Stream(2), Pool(), {}, MainThread()
    run(pool, engine, stream, environment, partial_settings(budget=64, staleness=12), 0, held)
    samples = samples_of(pool)
    assert not any(s.stepping for s in samples) and any(s.state["steps"] for s in samples)
    assert MainThread.threads == {threading.main_thread().name}
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=16, max_staleness=4)
    check_partial_rollouts(schedule, sampling=SamplingConfig(max_new_tokens=64), engine=engine, environment=environment)
