"""Reward functions written for TRL 1.16's ``GRPOTrainer`` run unchanged, and a reward's misspelt kwargs are refused.

TRL's own reward functions (``trl.rewards``) score a round through ``sample_and_score`` (the path of the training
round): conversational completions as one-message lists, ``completion_ids`` exactly the completion's tokens, the
dataset's columns. ``async def`` rewards run concurrently, under the same time limit as the others. ``None`` is
left out of the weighted total as TRL's ``nansum`` leaves it; a completion no reward applies to scores 0, with a
warning. ``kwargs`` keys a reward does not take stop the run in one line, before any model loads.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from trl.rewards import accuracy_reward, get_repetition_penalty_reward, get_soft_overlong_punishment

from grpo_lightning.config import ConfigError, UpdateConfig
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardError, RewardSpec, register, score
from grpo_lightning.rewards.inputs import as_completions, call_arguments, completion_text, reward_settings
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.sample_and_score import sample_and_score

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
)
SEEN: dict[str, dict] = {}  # what the recording rewards were given, by name


class ScriptedEngine(RolloutEngine):
    """Answers the i-th completion of a call with ``texts[i]`` (then EOS), cut at ``max_new_tokens``."""

    name = "scripted"

    def __init__(self, tokenizer, texts: list[str]) -> None:
        super().__init__()
        self.tokenizer, self.texts = tokenizer, texts
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.policy = object()

    def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False):
        group = 1 if params.greedy else params.group_size
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
        rows = []
        for text in self.texts[: len(prompt_ids)]:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id]
            rows.append(ids[: params.max_new_tokens])
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        truncated = torch.tensor([r[-1] != self.eos_token_id for r in rows])
        return Completions(prompt_ids, prompt_mask, ids, mask, truncated)


def record(name: str):
    """A reward that records every keyword it was given under ``SEEN[name]`` and scores 0."""

    def fn(**kwargs):
        SEEN[name] = kwargs
        return [0.0] * len(kwargs["completions"])

    return register(name)(fn)


record("test_trl_record_chat")
record("test_trl_record_text")
register("test_trl_soft_overlong")(get_soft_overlong_punishment(max_completion_len=24, soft_punish_cache=8))
register("test_trl_repetition")(get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0))


def sample(prompts: list, texts: list[str], scorer: Scorer, tokenizer, group_size: int = 2, **columns):
    encoder = PromptEncoder(tokenizer, use_chat_template=bool(getattr(tokenizer, "chat_template", None)))
    return sample_and_score(
        {"prompt": prompts, **columns},
        engine=ScriptedEngine(tokenizer, texts),
        encoder=encoder,
        scorer=scorer,
        params=SamplingParams(group_size=group_size, max_new_tokens=32),
    )


def completion_tokens(batch) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(batch.completion_ids, batch.completion_mask)]


# ------------------------------------------------------------------------------------- TRL's rewards, unchanged
def test_trl_rewards_score_a_conversational_round_unchanged():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    prompts = [
        [{"role": "system", "content": "Think, then box."}, {"role": "user", "content": f"{i}+1="}] for i in (1, 2)
    ]
    texts = ["<think>1+1</think>\\boxed{2}", "\\boxed{2}", "<think>2+1</think>\\boxed{4}", "<think>x\\boxed{3}"]
    specs = [
        RewardSpec("trl.rewards.think_format_reward"),  # TRL's functions by import path, as a user writes them
        RewardSpec("trl.rewards.accuracy_reward", weight=2.0),
        RewardSpec("test_trl_soft_overlong", weight=0.5),
        RewardSpec("test_trl_record_chat", weight=0.0),
    ]
    batch = sample(prompts, texts, Scorer(specs), tokenizer, solution=["$2$", "$3$"])

    assert batch.completions == texts
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    tokens = completion_tokens(batch)
    assert batch.reward_columns["trl.rewards.think_format_reward"] == [1.0, 0.0, 1.0, 0.0]
    accuracy = accuracy_reward(chat, ["$2$", "$2$", "$3$", "$3$"])
    assert accuracy == [1.0, 1.0, 0.0, 1.0] and batch.reward_columns["trl.rewards.accuracy_reward"] == accuracy
    overlong = get_soft_overlong_punishment(24, 8)(tokens)
    assert batch.reward_columns["test_trl_soft_overlong"] == overlong and overlong == [-1.0, 0.0, -1.0, -0.25]
    expected = [f + 2.0 * a + 0.5 * o for f, a, o in zip([1.0, 0.0, 1.0, 0.0], accuracy, overlong)]
    assert batch.rewards.tolist() == pytest.approx(expected)

    seen = SEEN["test_trl_record_chat"]
    assert seen["prompts"] == [prompts[0], prompts[0], prompts[1], prompts[1]]  # as the dataset holds them
    assert seen["completions"] == chat  # TRL's conversational form
    assert seen["completion_ids"] == tokens  # the completion's tokens, EOS included, no padding
    assert seen["completion_ids"][0] == tokenizer(texts[0], add_special_tokens=False)["input_ids"] + [1]
    assert seen["solution"] == ["$2$", "$2$", "$3$", "$3$"]
    assert {"trainer_state", "log_extra", "log_metric", "completion_lengths"} <= set(seen)


def test_text_prompts_give_text_completions_and_the_completion_tokens():
    tokenizer = build_char_tokenizer()
    texts = ["abab" * 4, "abcdefgh", "aaaa", "abc"]  # the first is cut by max_new_tokens: no EOS, 16 tokens
    specs = [RewardSpec("test_trl_repetition"), RewardSpec("test_trl_record_text")]
    scorer = Scorer(specs)
    encoder = PromptEncoder(tokenizer)
    batch = sample_and_score(
        {"prompt": ["1+1=", "22+2="], "answer": ["2", "24"]},
        engine=ScriptedEngine(tokenizer, texts),
        encoder=encoder,
        scorer=scorer,
        params=SamplingParams(group_size=2, max_new_tokens=16),
    )
    seen, tokens = SEEN["test_trl_record_text"], completion_tokens(batch)
    assert seen["completions"] == texts and seen["prompts"] == ["1+1=", "1+1=", "22+2=", "22+2="]
    assert seen["completion_ids"] == tokens
    assert [len(t) for t in tokens] == [16, 9, 5, 4] and tokens[1][-1] == tokenizer.eos_token_id
    assert seen["answer"] == ["2", "2", "24", "24"]
    assert batch.reward_columns["test_trl_repetition"] == get_repetition_penalty_reward(2, -1.0)(tokens)


def test_a_completion_is_a_one_message_list_where_its_prompt_is_a_conversation():
    chat = [{"role": "user", "content": "hi"}]
    assert as_completions(["plain", chat], ["a", "b"]) == ["a", [{"role": "assistant", "content": "b"}]]
    assert as_completions([[], "x"], ["a", "b"]) == ["a", "b"]  # an empty list is no conversation
    assert completion_text([{"role": "assistant", "content": "b"}]) == "b" and completion_text("a") == "a"
    with pytest.raises(ValueError):
        as_completions(["p"], ["a", "b"])  # one prompt per completion


def test_our_built_in_rewards_read_conversational_completions():
    chat = [[{"role": "user", "content": "1+1="}]] * 2
    specs = [RewardSpec("exact_answer"), RewardSpec("math_accuracy"), RewardSpec("format", kwargs={"mode": "lenient"})]
    scores = Scorer(specs)(chat, ["2", "<think>a</think><answer>2</answer>"], {"answer": ["2", "2"]})
    assert scores.per_function == {"exact_answer": [1.0, 0.0], "math_accuracy": [0.0, 1.0], "format": [0.0, 1.0]}


def test_a_fixed_signature_gets_only_what_it_names():
    def fixed(prompts, completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    def positional(p, c, answer):  # first two named otherwise: passed positionally, as before
        return [float(x == a) for x, a in zip(c, answer)]

    columns = {"answer": ["a", "b"], "other": [1, 2], "completion_ids": [[1], [2]]}
    total, _ = score(
        [RewardSpec("fixed"), RewardSpec("positional")], [fixed, positional], ["p", "q"], ["a", "c"], columns
    )
    assert total == [2.0, 0.0]
    args, kwargs = call_arguments(fixed, ["p"], ["a"], {"answer": ["a"], "trainer_state": None})
    assert args == () and kwargs == {"prompts": ["p"], "completions": ["a"], "answer": ["a"]}


def test_trainer_state_is_what_the_rollout_was_told_and_unknown_is_loud():
    def by_step(completions, trainer_state, **kwargs):
        return [float(trainer_state.global_step)] * len(completions)

    register("test_trl_by_step")(by_step)
    scorer = Scorer([RewardSpec("test_trl_by_step")])
    with pytest.raises(RewardError, match=r"'test_trl_by_step' raised TrainerStateUnknown: trainer_state.global_step"):
        scorer(["p"], ["c"], {})
    scorer.trainer_state.update(global_step=7, epoch=1.5)
    assert scorer(["p"], ["c"], {}).total == [7.0]
    assert scorer.trainer_state.epoch == 1.5


def test_log_metric_and_log_extra_are_collected():
    def logs(completions, log_metric, log_extra, **kwargs):
        log_metric("reward/seen", float(len(completions)))
        log_extra("lengths", [len(c) for c in completions])
        return [1.0] * len(completions)

    register("test_trl_logs")(logs)
    scores = Scorer([RewardSpec("test_trl_logs")])(["p", "q"], ["a", "bcd"], {})
    assert scores.metrics == {"reward/seen": 2.0} and scores.extra_columns == {"lengths": [1, 3]}


# ------------------------------------------------------------------------------------------------ async def
def test_async_rewards_score_a_round_and_run_concurrently():
    """Each reward sets its own event, then waits for the other's: run one after the other, the first to run would
    wait for an event nobody sets and time out."""
    events: dict[str, asyncio.Event] = {}

    def waiting(mine: str, other: str, value: float):
        async def fn(prompts, completions, **kwargs):
            events.setdefault(mine, asyncio.Event()).set()
            await asyncio.wait_for(events.setdefault(other, asyncio.Event()).wait(), timeout=5)
            return [value] * len(completions)

        return fn

    def sync_reward(prompts, completions, **kwargs):
        return [0.25] * len(completions)

    specs = [RewardSpec("first", weight=1.0), RewardSpec("plain"), RewardSpec("second", weight=2.0)]
    fns = [waiting("a", "b", 1.0), sync_reward, waiting("b", "a", 0.5)]
    start = time.monotonic()
    total, per_function = score(specs, fns, ["p"] * 2, ["x", "y"], {}, timeout_s=10)
    assert time.monotonic() - start < 4
    assert list(per_function) == ["first", "plain", "second"]  # in the configured order
    assert total == [2.25, 2.25] and per_function["second"] == [0.5, 0.5]

    async def one(prompts, completions, **kwargs):
        await asyncio.sleep(0.5)
        return [1.0] * len(completions)

    start = time.monotonic()
    score([RewardSpec("x"), RewardSpec("y"), RewardSpec("z")], [one, one, one], ["p"], ["c"], {})
    assert time.monotonic() - start < 1.2  # three 0.5 s waits at once (1.5 s one after the other)


def test_an_async_reward_through_the_scorer_by_registered_name():
    async def judge(prompts, completions, answer, **kwargs):
        await asyncio.sleep(0)
        return [float(completion_text(c).strip() == a) for c, a in zip(completions, answer)]

    register("test_trl_async_judge")(judge)
    chat = [[{"role": "user", "content": "1+1="}]] * 2
    scores = Scorer([RewardSpec("test_trl_async_judge")])(chat, ["2", "3"], {"answer": ["2", "2"]})
    assert scores.total == [1.0, 0.0] and scores.correct == [True, False]


async def _slow_on_slow(prompts, completions, **kwargs):
    for completion in completions:
        if "slow" in completion:
            await asyncio.sleep(30)
    return [1.0] * len(completions)


async def _blocks(prompts, completions, **kwargs):
    time.sleep(1.5)  # blocks the event loop: no await, so no time limit can cancel it
    return [1.0] * len(completions)


async def _raises(prompts, completions, **kwargs):
    raise ValueError("judge unreachable")


def test_async_rewards_honour_the_time_limit_and_the_failure_handling():
    spec = RewardSpec("async_slow")
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"'async_slow' ran longer than timeout_s=0.2s") as info:
        score([spec], [_slow_on_slow], ["p"] * 3, ["ok", "slow", "ok"], {}, timeout_s=0.2)
    assert "completion 1 alone ('slow')" in str(info.value) and time.monotonic() - start < 5
    total, _ = score([spec], [_slow_on_slow], ["p"] * 2, ["ok", "slow"], {}, timeout_s=0.2, on_error="zero")
    assert total == [0.0, 0.0]

    with pytest.raises(RewardError, match=r"'async_blocks' \(async def\) ran past timeout_s=0.2s and blocked"):
        score([RewardSpec("async_blocks")], [_blocks], ["p"], ["c"], {}, timeout_s=0.2)
    assert score([spec], [_slow_on_slow], ["p"], ["ok"], {}, timeout_s=0.5)[0] == [1.0]  # a new loop serves

    with pytest.raises(RewardError, match=r"'async_raises' raised ValueError: judge unreachable") as info:
        score([RewardSpec("async_raises")], [_raises], ["p"], ["c"], {})
    assert "\n" not in str(info.value)
    assert score([RewardSpec("async_raises")], [_raises], ["p"], ["c"], {}, on_error="zero")[0] == [0.0]


# --------------------------------------------------------------------------------------------------- None
def test_none_is_left_out_of_the_total_as_trl_does_and_no_reward_at_all_warns(caplog):
    def only_first(prompts, completions, **kwargs):
        return [1.0, None, None]

    def only_second(prompts, completions, **kwargs):
        return [None, 0.5, None]

    register("test_trl_only_first")(only_first)
    register("test_trl_only_second")(only_second)
    scorer = Scorer([RewardSpec("test_trl_only_first", weight=2.0), RewardSpec("test_trl_only_second")])
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.rewards.scorer"):
        scores = scorer(["p", "q", "r"], ["a", "b", "c"], {})
    # TRL: None -> NaN, then the weighted nansum over the functions.
    per_function = torch.tensor([[1.0, float("nan")], [float("nan"), 0.5], [float("nan"), float("nan")]])
    assert scores.total == (per_function * torch.tensor([2.0, 1.0])).nansum(dim=1).tolist() == [2.0, 0.5, 0.0]
    assert scores.per_function == {"test_trl_only_first": [1.0, None, None], "test_trl_only_second": [None, 0.5, None]}
    assert scores.unscorable == [False, False, True]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "1 of 3 completions have no applicable reward" in warnings[0] and "'r'" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.rewards.scorer"):
        scorer(["p", "q", "r"], ["a", "b", "c"], {}, warn_unscorable=False)  # an environment's parts follow
    assert not caplog.records


# ----------------------------------------------------------------------------------------------- kwargs
def test_a_misspelt_kwarg_is_refused_in_one_line_naming_the_reward_and_its_valid_keys():
    with pytest.raises(ConfigError) as info:
        Scorer([RewardSpec("format"), RewardSpec("math_accuracy", kwargs={"mod": "lenient"})])
    assert str(info.value) == (
        "data.rewards[1] (math_accuracy): unknown kwargs key 'mod'; valid: modes, last_number, timeout_s, backend"
    )
    with pytest.raises(
        ConfigError, match=r"^data.rewards\[0\] \(exact_answer\): unknown kwargs key 'bogus'; valid: none"
    ):
        Scorer([RewardSpec("exact_answer", kwargs={"bogus": 1})])
    with pytest.raises(ConfigError, match=r"kwargs key 'completion_ids' is passed by the rollout itself"):
        Scorer([RewardSpec("trl.rewards.think_format_reward", kwargs={"completion_ids": [1]})])
    with pytest.raises(ConfigError, match=r"^eval.rewards\[0\] \(format\): unknown kwargs key 'mde'"):
        Scorer([RewardSpec("format", kwargs={"mde": "strict"})], setting="eval.rewards")
    # The keys that are settings pass; a function with **kwargs and no keyword-only parameter takes any key.
    Scorer([RewardSpec("format", kwargs={"mode": "lenient", "reward": 0.5})])
    Scorer([RewardSpec("trl.rewards.think_format_reward", kwargs={"anything": 1})])


def test_the_settings_a_reward_takes():
    def fixed(prompts, completions, answer, threshold=0.5):
        return [0.0] * len(completions)

    def keyword_only(prompts, completions, *, scale=1.0, **kwargs):
        return [0.0] * len(completions)

    def declared(prompts, completions, **kwargs):
        return [kwargs["level"]] * len(completions)

    declared.settings = ("level",)
    assert reward_settings(fixed) == ("answer", "threshold")
    assert reward_settings(keyword_only) == ("scale",)
    assert reward_settings(declared) == ("level",)
    assert reward_settings(accuracy_reward) is None  # TRL's: **kwargs, no keyword-only parameter


def test_a_kwargs_key_that_is_also_a_data_column_is_refused():
    scorer = Scorer([RewardSpec("format", kwargs={"mode": "lenient"})])
    scorer.check_columns(["prompt", "answer"], "the training data")
    with pytest.raises(
        ConfigError, match=r"data.rewards\[0\] \(format\): kwargs key 'mode' is also a column of the tr"
    ):
        scorer.check_columns(["prompt", "mode"], "the training data")


# ------------------------------------------------------------------- what reaches the advantages and the logs
def test_an_unscorable_completion_is_left_out_of_its_groups_baseline_with_advantage_zero():
    """TRL 1.16: a completion that every reward gives None is NaN in the group's nan-mean and nan-std, then 0."""
    from grpo_lightning.advantages import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 4.0, 2.0, 2.0])  # groups of 3; row 2 and row 5 unscorable (total 0)
    scorable = torch.tensor([True, True, False, True, True, False])
    adv = group_advantages(rewards, 3, scorable=scorable)
    # Group 1 over {1, 0}: mean 0.5, population std 0.5 -> ±1 (eps 1e-4); group 2 over {4, 2}: mean 3, std 1.
    expected = torch.tensor([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 1 / 1.0001, -1 / 1.0001, 0.0])
    torch.testing.assert_close(adv, expected)
    rloo = group_advantages(rewards, 3, scorable=scorable, baseline="rloo", scale="none")
    torch.testing.assert_close(rloo, torch.tensor([1.0, -1.0, 0.0, 2.0, -2.0, 0.0]))  # r_i - the other scorable one
    lone = group_advantages(torch.tensor([1.0, 0.0, 5.0]), 3, scorable=torch.tensor([True, False, False]))
    assert lone.tolist() == [0.0, 0.0, 0.0]  # one scorable completion: nothing to compare it with
    # All scorable: exactly the unmasked result.
    assert torch.equal(
        group_advantages(rewards, 3, scorable=torch.ones(6, dtype=torch.bool)), group_advantages(rewards, 3)
    )


def test_unscorable_rows_log_metric_and_log_extra_reach_the_rollout_and_its_table():
    from grpo_lightning.callbacks.completions import completion_rows
    from grpo_lightning.config import AdvantageConfig, SamplingConfig
    from grpo_lightning.rollout.round import RoundSettings, compute_advantages, rollout_metrics

    def partial(completions, log_metric, log_extra, **kwargs):
        log_metric("calls", 1.0)
        log_extra("first_char", [c[:1] for c in completions])
        return [None if c.startswith("z") else float(len(c)) for c in completions]

    register("test_trl_partial")(partial)
    tokenizer = build_char_tokenizer()
    batch = sample(["1+1=", "2+2="], ["ab", "z", "abcd", "a"], Scorer([RewardSpec("test_trl_partial")]), tokenizer)
    assert batch.unscorable.tolist() == [False, True, False, False]
    settings = RoundSettings(sampling=SamplingConfig(group_size=2), advantage=AdvantageConfig(), optimizer_steps=1)
    batch.advantages = compute_advantages(batch, settings)
    assert batch.advantages[1] == 0 and batch.advantages[0] == 0  # alone in its group once row 1 is out
    metrics = rollout_metrics(batch, settings, {})
    assert metrics["reward_log/calls"] == 1.0 and metrics["rollout/unscorable_fraction"] == 0.25
    columns, rows = completion_rows(batch)
    assert columns[-1] == "first_char" and [row[-1] for row in rows] == ["a", "z", "a", "a"]


def test_the_rollout_tells_rewards_the_training_step(tmp_path):
    from conftest import TINY, quiet_trainer

    from grpo_lightning import GRPOModule, RolloutDataModule
    from grpo_lightning.config import SamplingConfig

    seen = []

    def by_step(completions, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.epoch))
        return [float(len(c)) for c in completions]

    register("test_trl_steps_seen")(by_step)
    data = RolloutDataModule(
        rewards=[RewardSpec("test_trl_steps_seen")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=4),
        prompts_per_round=2,
        update=UpdateConfig(mini_batch_size=2),
        val_split=None,
    )
    quiet_trainer(tmp_path, max_epochs=2).fit(GRPOModule(tiny_model=TINY, lr=1e-3), datamodule=data)
    assert seen == [(0, 0), (2, 1)]  # each round is scored at the step and epoch it samples at (2 steps a round)
