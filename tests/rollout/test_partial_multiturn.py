"""Partial rollouts of multi-turn environments (``integrations/environments/partial_turns.py``) without a process.

A scripted policy plays a calculator game on a character tokenizer: its first turn calls the tool on the prompt's
expression, its later turns call it again on the result or answer it; which of its options it takes is drawn from
the segment's generator, and a turn continued after a push goes on with an option its written part begins. Every
token's log-prob is -(version + 1) / 10, so each test reads which version drew which token. The environment keeps a
count of its calls in its observations (``#k``): a resumed run that did not restore its state would show it.
"""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch

from grpo_lightning.config import AdvantageConfig, ConfigError, SamplingConfig, ScheduleConfig
from grpo_lightning.config_checks import check_partial_rollouts
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.integrations.environments import Environment, Step, ToolEnvironment
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.partial import PartialSettings, Pool, SegmentPlan, run_segment
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings
from grpo_lightning.rollout.sample_and_score import sample_and_score
from grpo_lightning.rollout.schedule import PartialSchedule
from grpo_lightning.rollout.worker import FinishedSegment

TOKENIZER = build_char_tokenizer()
EOS = "<eos>"
G, MAX_NEW = 2, 128
PROMPTS = ["12*34=", "5*6=", "7+8=", "99-9=", "3*3=", "2+2="]


def mu(version: int) -> float:
    return -(version + 1) / 10


def options(before: str) -> list[str]:
    """The turns the policy may take after ``before`` (the context up to the turn's start)."""
    results = before.split("<result>")[1:]
    if not results:
        expression = before.split("=")[0]
        return [f"<tool>calculator: {expression}</tool>zz", f"<tool>calculator: {expression}*1</tool>zz"]
    value = results[-1].split(" #")[0]
    return [value + EOS] if len(results) >= 2 else [value + EOS, f"<tool>calculator: {value}+0</tool>zz"]


class ScriptedPolicy(RolloutEngine):
    """Each row's turn: an option of ``options`` that its written part begins (drawn from ``generator``), the rest of
    it decoded; stop sequences ignored (the rollout's text rule cuts the babble after ``</tool>``)."""

    name = "scripted"
    supports_partial_rollouts = True

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        self.calls: list[tuple[int, int, int]] = []  # (rows given, group_size, max_new_tokens)

    def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False):
        self.calls.append((prompt_ids.size(0), params.group_size, params.max_new_tokens))
        rows = []
        for ids, mask in zip(
            prompt_ids.repeat_interleave(params.group_size, 0), prompt_mask.repeat_interleave(params.group_size, 0)
        ):
            text = TOKENIZER.decode(ids[mask.bool()].tolist())
            start = text.rfind("</result>") + len("</result>") if "</result>" in text else text.index("=") + 1
            written = text[start:]
            fitting = [o for o in options(text[:start]) if o.startswith(written)]
            choice = fitting[int(torch.randint(len(fitting), (1,), generator=generator))]
            rows.append(
                TOKENIZER(choice[len(written) :], add_special_tokens=False)["input_ids"][: params.max_new_tokens]
            )
        width = max(1, max(len(r) for r in rows))
        ids = torch.tensor([r + [TOKENIZER.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logprobs = torch.where(mask.bool(), mu(self.version), 0.0) if return_logprobs else None
        truncated = torch.tensor([not r or r[-1] != TOKENIZER.eos_token_id for r in rows])
        return Completions(
            prompt_ids.repeat_interleave(params.group_size, 0),
            prompt_mask.repeat_interleave(params.group_size, 0),
            ids,
            mask,
            truncated,
            logprobs,
            logprobs,
        )


class CountingCalculator(ToolEnvironment):
    """The calculator, its observations numbered by the trajectory's calls so far (state a replay must restore)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(tools=["calculator"], format="tag", max_observation_tokens=48, **kwargs)
        self.calls = 0

    def step(self, turn: str) -> Step:
        step = super().step(turn)
        if step.observation is None:
            return Step(rewards={"answered": 1.0}, done=True, metrics=step.metrics)
        self.calls += 1
        result = step.observation.removeprefix("<result>").removesuffix("</result>")
        return Step(observation=f"<result>{result} #{self.calls}</result>", metrics={"tool_calls": 1.0})


CALLS = itertools.count()


class Forgetful(CountingCalculator):
    """Not deterministic: its numbering is global, so a replay answers otherwise."""

    def step(self, turn: str) -> Step:
        step = super().step(turn)
        if step.observation is not None:
            step.observation = step.observation.replace("</result>", f" @{next(CALLS)}</result>")
        return step


class Unreplayable(CountingCalculator):
    replays_exactly = False


@register("partial_multiturn_length")
def answer_length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


class Stream:
    """``per_draw`` prompts per draw, cycling through ``PROMPTS``."""

    def __init__(self, per_draw: int, position: int = 0) -> None:
        self.per_draw, self.position = per_draw, position

    def next_rows(self):
        rows = [PROMPTS[(self.position + i) % len(PROMPTS)] for i in range(self.per_draw)]
        self.position += self.per_draw
        return {"prompt": rows, "answer": ["0"] * len(rows)}


def round_settings(environment) -> RoundSettings:
    return RoundSettings(
        sampling=SamplingConfig(group_size=G, max_new_tokens=MAX_NEW),
        advantage=AdvantageConfig(),
        optimizer_steps=1,
        rollout_lag=1,
        environment=environment,
    )


def partial_settings(n: int = 2, budget: int = 16, staleness: int = 12) -> PartialSettings:
    return PartialSettings(n, G, budget, staleness, "drop", n * -(-MAX_NEW // budget))


SCORER = Scorer([RewardSpec("partial_multiturn_length")])


def segment(pool, engine, stream, environment, partial, index, version, waiting=0, held=None, counters=None):
    engine.version = version
    return run_segment(
        pool,
        SegmentPlan(index, version, waiting, partial),
        next_rows=stream.next_rows,
        engine=engine,
        encoder=PromptEncoder(TOKENIZER),
        scorer=SCORER,
        settings=round_settings(environment),
        generator=torch.Generator().manual_seed(index),
        held=held,
        counters=counters,
    )


# ------------------------------------------------------------------------------------------ the segments
def test_a_trajectory_longer_than_the_budget_spans_pushes_each_model_token_keeping_its_version():
    engine, stream, pool, environment = ScriptedPolicy(), Stream(2), Pool(), CountingCalculator()
    partial, budget, held = partial_settings(), 16, {}
    ready = [segment(pool, engine, stream, environment, partial, v, version=v, held=held) for v in range(10)]
    ready = [r for r in ready if r is not None]
    assert ready, "no group ended"
    for r in ready:
        batch = r.sampled.batch
        action = batch.action_mask.bool()
        versions = r.versions[:, : action.size(1)]
        assert (versions[action] >= 0).all() and (versions[batch.completion_mask.bool() & ~action] == -1).all()
        expected = torch.tensor([[mu(int(v)) for v in row] for row in versions])
        assert torch.equal(batch.engine_logprobs[action], expected[action].float())
        for row in versions:  # a segment draws at most the budget of model tokens of each trajectory
            assert all(int((row == v).sum()) <= budget for v in row[row >= 0].unique())
    rows = [(r, i) for r in ready for i in range(len(r.sampled.batch))]
    spanning = [(r, i) for r, i in rows if len(r.versions[i][r.versions[i] >= 0].unique()) >= 3]
    assert spanning and all(r.segments[i] >= 3 for r, i in spanning)  # over three pushes at least
    texts = [t for r in ready for t in r.sampled.batch.transcripts]
    assert any("#2</result>" in t for t in texts)  # two calls in one trajectory, numbered by its environment
    # A turn cut mid-way by the budget goes on under the next version: a policy stretch with two versions.
    mixed = 0
    for r, i in rows:
        action, versions = r.sampled.batch.action_mask[i].tolist(), r.versions[i].tolist()
        stretch: set[int] = set()
        for a, v in zip(action, versions):
            if a:
                stretch.add(v)
            else:
                mixed += len(stretch) > 1
                stretch = set()
    assert mixed


def test_a_budget_covering_max_new_tokens_samples_exactly_the_rounds_trajectories():
    environment = CountingCalculator()
    round_engine, engine = ScriptedPolicy(), ScriptedPolicy()
    rows = Stream(2).next_rows()
    expected = sample_and_score(
        rows,
        engine=round_engine,
        encoder=PromptEncoder(TOKENIZER),
        scorer=SCORER,
        params=SamplingParams.from_config(round_settings(environment).sampling),
        generator=torch.Generator().manual_seed(0),
        return_logprobs=True,
        environment=environment,
    )
    partial = PartialSettings(2, G, MAX_NEW, 1, "drop", 2)
    ready = segment(Pool(), engine, Stream(2), environment, partial, 0, version=0)
    assert engine.calls == round_engine.calls and engine.calls[0][1] == G  # the same calls: G per prompt first
    got = ready.sampled.batch
    for name in ("prompt_ids", "completion_ids", "completion_mask", "action_mask", "engine_logprobs", "rewards"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.transcripts == expected.transcripts and got.turn_stats.keys() == expected.turn_stats.keys()


# ------------------------------------------------------------------------------------------ checkpoints
class FakeWorker:
    """``RolloutWorker``'s surface in this process; its live environments (``held``) die with it, as a process's."""

    def __init__(self, position, n, environment):
        self.engine, self.stream, self.version = ScriptedPolicy(), Stream(n, position or 0), None
        self.environment, self.held, self.results = environment, {}, []

    def push(self, weights, version):
        self.version = version

    def submit_segment(self, plan, pool):
        pool = copy.deepcopy(pool)  # sent to another process: a copy
        ready = segment(
            pool, self.engine, self.stream, self.environment, plan.settings, plan.index, self.version, plan.waiting,
            self.held,
        )  # fmt: skip
        self.results.append(FinishedSegment(plan.index, pool, [ready] if ready else [], self.stream.position))

    def collect(self):
        return self.results.pop(0)

    def close(self):
        pass


def train(schedule, rounds, environment):
    out = {}
    for k in rounds:
        sampled = schedule.take(k, start_worker=lambda p: FakeWorker(p, 2, environment), weights=lambda: {})
        b = sampled.batch
        out[k] = (b.completion_ids.tolist(), b.action_mask.tolist(), b.engine_logprobs.tolist(), b.rewards.tolist(),
                  b.transcripts, dict(sampled.metrics))  # fmt: skip
    return out


def checkpointed(schedule):
    buffer = io.BytesIO()
    torch.save(schedule.state_dict(), buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def resumed_after(rounds: int, environment, partial):
    first = PartialSchedule(partial)
    trained = train(first, range(rounds), environment)
    state = checkpointed(first)
    resumed = PartialSchedule(partial)
    resumed.load_state_dict(state)
    return trained, state, resumed


def test_three_rounds_then_three_more_from_a_checkpoint_equal_six_with_trajectories_in_flight():
    partial = partial_settings()
    uninterrupted = train(PartialSchedule(partial), range(6), CountingCalculator())
    trained, state, resumed = resumed_after(3, CountingCalculator(), partial)
    samples = [s for g in state["pool"]["groups"] for s in g["samples"]]
    assert any(not s["ended"] and s["state"]["steps"] for s in samples)  # in flight, past a tool call: replayed
    assert any(not s["ended"] and s["state"]["turn"] for s in samples)  # in flight mid-turn
    assert any(s["stepping"] and s["state"]["pending"] for s in samples)  # its step running: replayed
    trained.update(train(resumed, range(3, 6), CountingCalculator()))
    assert trained == uninterrupted
    assert all(m["rollout/interrupted_sequences"] for *_, m in uninterrupted.values())
    assert all(m["rollout/environment_steps"] for *_, m in uninterrupted.values())


@pytest.mark.parametrize(
    ("environment", "error", "message"),
    [
        (Forgetful(), RuntimeError, r"^data.environment Forgetful answered a replay .*\(not deterministic\)"),
        (Unreplayable(), ConfigError, r"^data.environment Unreplayable declares replays_exactly = False"),
    ],
)
def test_a_resume_that_cannot_restore_an_environment_in_flight_is_refused_in_one_line(environment, error, message):
    partial = partial_settings()
    _, _, resumed = resumed_after(3, environment, partial)
    with pytest.raises(error, match=message):
        train(resumed, range(3, 6), environment)


# ---------------------------------------------------------------------------------------------- checks
def test_partial_rollouts_take_a_multi_turn_environment():
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=16, max_staleness=8)
    sampling = SamplingConfig(max_new_tokens=64)  # 4 pushes of tokens, + 4 turns whose steps join a push later
    check_partial_rollouts(schedule, sampling=sampling, engine=ScriptedPolicy(), environment=CountingCalculator())
    assert Environment.partial_rollouts_refused is None and Environment.replays_exactly
