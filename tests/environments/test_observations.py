"""Observations within their limit and per-trajectory copies of an environment.

An observation longer than ``max_observation_tokens`` is cut in its *text*, inside its frame (``</result>``, or the
chat template's end of the tool message and next assistant header: ``test_chat_formats.py``), and says it was cut;
the rollout's token cut is a last resort, with one warning. ``spawn`` shares the tokenizer, not per-trajectory state.
"""

from __future__ import annotations

import warnings

import pytest
from test_multiturn import ScriptedEngine

from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.integrations.environments import Environment, Step, ToolEnvironment
from grpo_lightning.integrations.environments.multiturn import generate_trajectories
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rollout.prompts import PromptEncoder


def long_lookup(argument: str) -> str:
    return "0123456789" * 50


def tag_env(**kwargs) -> ToolEnvironment:
    env = ToolEnvironment(tools=["calculator", f"{__name__}:long_lookup"], format="tag", **kwargs)
    env.setup(build_char_tokenizer())
    return env


def rollout(environment: Environment, script, group: int = 2, max_new_tokens: int = 200):
    tokenizer = build_char_tokenizer()
    return generate_trajectories(
        {"prompt": ["q="]},
        engine=ScriptedEngine(tokenizer, script),
        encoder=PromptEncoder(tokenizer),
        environment=environment,
        params=SamplingParams(group_size=group, max_new_tokens=max_new_tokens),
    )


def env_text(out, tokenizer, row: int = 0) -> str:
    """The environment's tokens of a trajectory, decoded."""
    ids, action = out.completions.completion_ids[row].tolist(), out.action_mask[row].tolist()
    n = int(out.completions.completion_mask[row].sum())
    return tokenizer.decode([i for i, a in zip(ids[:n], action[:n]) if a == 0])


# ------------------------------------------------------------------------------------------- fit_observation
def test_fit_observation_cuts_the_text_inside_its_frame_and_says_so():
    env = tag_env(max_observation_tokens=60)
    wrap = env.format.result
    assert env.fit_observation("408", wrap) == "<result>408</result>"  # fits: unchanged
    text = "0123456789" * 50
    fitted = env.fit_observation(text, wrap)
    kept = fitted.removeprefix("<result>").split("...")[0]
    assert fitted == f"<result>{kept}... [cut: {len(text) - len(kept)} more characters]</result>"
    assert env.count_tokens(fitted) <= 60 and text.startswith(kept)
    longer = f"<result>{text[: len(kept) + 1]}... [cut: {len(text) - len(kept) - 1} more characters]</result>"
    assert env.count_tokens(longer) > 60  # the longest prefix that fits
    # max_chars cuts first, and says so too
    assert env.fit_observation("abcdefgh", wrap, max_chars=3) == "<result>abc... [cut: 5 more characters]</result>"
    # Where the full marker leaves no room (the calculator demo's 32 tokens, a character each), "..." says it
    env.max_observation_tokens = 32
    assert env.fit_observation(text, wrap) == "<result>" + text[:12] + "...</result>"


def test_fit_observation_tokenizes_a_logarithmic_number_of_times():
    env = tag_env(max_observation_tokens=60)
    calls = []
    count = env.count_tokens
    env.count_tokens = lambda text: (calls.append(len(text)), count(text))[1]
    env.fit_observation("x" * 100_000, env.format.result)
    assert len(calls) <= 2 + 17 + 1  # keep, empty, then a binary search over 100,000 lengths


def test_a_tool_result_past_the_token_limit_keeps_its_close_tag_in_the_rollout():
    env = ToolEnvironment(tools=[f"{__name__}:long_lookup"], format="tag", max_observation_tokens=60)
    env.max_result_chars = 1000

    def policy(context: str) -> str:
        return "done<eos>" if context.endswith("</result>") else "<tool>long_lookup: q</tool>"

    out = rollout(env, policy)
    observed = env_text(out, build_char_tokenizer())
    assert observed.startswith("<result>0123") and observed.endswith(" more characters]</result>")
    assert len(observed) <= 60 and "... [cut: " in observed
    assert out.final_texts == ["done", "done"] and not out.completions.truncated.any()


def test_a_frame_too_small_for_the_limit_is_refused_at_setup():
    env = ToolEnvironment(tools=["calculator"], format="tag", max_observation_tokens=19)
    with pytest.raises(ConfigError) as refused:
        env.setup(build_char_tokenizer())
    message = str(refused.value)
    assert message.startswith("data.environment.init_args.max_observation_tokens = 19 cannot hold the tag format")
    assert "set it to at least 20 (53 to say how many characters a cut result lost)" in message
    assert "\n" not in message
    ToolEnvironment(format="tag", max_observation_tokens=20).setup(build_char_tokenizer())  # <result>...</result>


def test_an_oversize_observation_is_cut_by_the_rollout_as_a_last_resort_with_one_warning():
    class Verbose(Environment):
        def reset(self, row):
            return "R" * 50

        def step(self, turn):
            return Step(observation="<o>" + "S" * 50 + "</o>")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rollout(Verbose(max_turns=2, max_observation_tokens=10), lambda context: "a<eos>")
    assert out.stats["env_tokens"] == [20.0, 20.0]  # first observation and one step, 10 tokens each
    mentions = [w for w in caught if "fit_observation" in str(w.message)]
    assert len(mentions) == 1, [str(w.message) for w in caught]
    assert "Verbose returned an observation of 50 tokens (max_observation_tokens = 10)" in str(mentions[0].message)


# -------------------------------------------------------------------------------------------------- spawn
class Notebook(Environment):
    """Keeps what it saw: per-trajectory state."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def reset(self, row):
        self.seen.append(row["prompt"])

    def step(self, turn):
        self.seen.append(turn)
        return Step(done=True)


class CountingTools(ToolEnvironment):
    def __init__(self) -> None:
        super().__init__(format="tag")
        self.calls: list[str] = []

    def step(self, turn):
        self.calls.append(turn)
        return super().step(turn)


@pytest.mark.parametrize("make", [Notebook, CountingTools])
def test_a_spawned_environment_shares_the_tokenizer_and_keeps_its_own_state(make):
    env = make()
    env.setup(build_char_tokenizer())
    first, second = env.spawn(), env.spawn()
    assert first.tokenizer is env.tokenizer and second.tokenizer is env.tokenizer  # never copied per trajectory
    state = "seen" if make is Notebook else "calls"
    getattr(first, state).append("turn of the first trajectory")
    assert getattr(second, state) == [] and getattr(env, state) == []
    if make is CountingTools:
        assert first.tools is env.tools
        assert first.step("<tool>calculator: 2+3</tool>").observation == "<result>5</result>"
