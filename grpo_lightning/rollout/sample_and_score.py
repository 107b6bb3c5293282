"""Sample and score: prompts in, scored completions out. The one piece every generating path shares.

The training round, held-out evaluation (greedy pass@1 and k samples for pass@k / maj@k) and rejection sampling
all call ``sample_and_score``: encode the prompts, have the engine sample, decode, score with every reward.
With an environment (``data.environment``) the engine samples multi-turn trajectories instead
(``rollout/multiturn.py``) and the rewards score each trajectory's final turn; with an ``AgentEnvironment`` the
user's agents run their own loops against the run's gateway (``agents/rollout.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from grpo_lightning.agents.environment import AgentEnvironment
from grpo_lightning.agents.rollout import sample_and_score_agents
from grpo_lightning.engines.base import RolloutEngine, SamplingParams
from grpo_lightning.environments.base import Environment
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rewards.step_ends import step_token_ends
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.multiturn import generate_trajectories
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.vision.engines import check_vision_run
from grpo_lightning.vision.inputs import repeat_rows

log = logging.getLogger(__name__)


def repeat_each(values: list[Any], times: int) -> list[Any]:
    """``[a, b]`` → ``[a, a, b, b]`` for ``times=2``: one entry per completion, groups adjacent."""
    return [value for value in values for _ in range(times)]


def logged_columns(columns: dict[str, list[Any]], rows: int) -> dict[str, list[Any]]:
    """The ``log_extra`` columns of one value per completion; another length is dropped with a warning (it could not
    be put beside the completions)."""
    kept = {}
    for name, values in columns.items():
        if len(values) == rows:
            kept[name] = list(values)
        else:
            log.warning("log_extra column %r has %d values for %d completions: not logged", name, len(values), rows)
    return kept


def sample_and_score(
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
    environment: Environment | None = None,
) -> RolloutBatch:
    """``params.group_size`` completions (one when greedy) for each prompt of ``rows``, decoded and scored.

    ``rows`` holds the ``prompt`` column and the dataset's other columns (passed on to the reward functions).
    ``return_logprobs`` keeps the engine's log-probs of the sampled tokens in ``RolloutBatch.engine_logprobs``.
    ``timings``, when given, accumulates the seconds spent in ``generate`` and ``score`` (and ``environment``,
    the part of generating spent in the environment's steps, with an ``environment``).
    """
    check_vision_run(encoder.tokenizer, engine, environment)  # a vision-language model's: what it can use yet
    if isinstance(environment, AgentEnvironment):  # the user's agent runs its own loop (agents/rollout.py)
        return sample_and_score_agents(
            rows, agent=environment, engine=engine, encoder=encoder, scorer=scorer, params=params,
            generator=generator, device=device, timings=timings,
        )  # fmt: skip
    group_size = 1 if params.greedy else params.group_size
    start = time.perf_counter()
    trajectories = vision = None  # vision: each prompt's image inputs, from a vision-language model's encoder
    if environment is None:
        prompt_ids, prompt_mask, vision = encoder.encode_rows(rows, device)
        images = {} if vision is None else {"vision": vision}
        completions = engine.generate(
            prompt_ids, prompt_mask, params, generator=generator, return_logprobs=return_logprobs, **images
        )
        texts = encoder.decode(completions.completion_ids, completions.completion_mask)
        policy_lengths = completions.completion_mask.sum(-1).tolist()
    else:
        trajectories = generate_trajectories(
            rows,
            engine=engine,
            encoder=encoder,
            environment=environment,
            params=params,
            generator=generator,
            return_logprobs=return_logprobs,
            device=device,
        )
        completions, texts = trajectories.completions, trajectories.final_texts
        policy_lengths = trajectories.action_mask.sum(-1).tolist()
    generated = time.perf_counter()

    prompts = repeat_each(rows["prompt"], group_size)
    columns = {name: repeat_each(values, group_size) for name, values in rows.items() if name != "prompt"}
    columns["completion_lengths"] = policy_lengths  # the policy's tokens, for length shaping
    # Each completion's tokens without padding, as TRL passes them (rewards that count or penalise tokens).
    ids, mask = completions.completion_ids.cpu(), completions.completion_mask.cpu().bool()
    columns["completion_ids"] = [row[keep].tolist() for row, keep in zip(ids, mask)]
    if trajectories is not None:
        columns["transcripts"] = trajectories.transcripts  # every turn, for rewards that judge the tool use
        columns["environments"] = trajectories.environments  # each trajectory's environment, as TRL passes them
    # An environment may have changed a trajectory's prompt (TRL's: reset's text in its last message): the rewards
    # see each trajectory's own, as TRL's do.
    scored = trajectories.prompts if trajectories is not None else prompts
    parts = weights = None
    if trajectories is not None:  # the environment's reward parts are reward columns, each with its weight
        parts = {f"env_{name}": values for name, values in trajectories.env_rewards.items()}
        weights = {f"env_{name}": weight for name, weight in environment.reward_weights().items()}
    scores = scorer(scored, texts, columns, parts=parts, part_weights=weights)
    batch = RolloutBatch(
        prompt_ids=completions.prompt_ids,
        prompt_mask=completions.prompt_mask,
        completion_ids=completions.completion_ids,
        completion_mask=completions.completion_mask,
        truncated=completions.truncated,
        rewards=torch.tensor(scores.total, dtype=torch.float32, device=completions.completion_ids.device),
        prompts=prompts,
        completions=texts,
        reward_columns=scores.per_function,
        reward_weights=scores.weights,
        engine_logprobs=completions.logprobs,
        policy_logprobs=completions.policy_logprobs,
        correct=scores.correct,
        temperature=params.temperature,
        max_new_tokens=params.max_new_tokens,
    )
    # A vision-language model's rows: each one's image inputs (a trajectory's are its prompt's) and, for the logs'
    # tables, its prompt's images, as the encoder read them (``SourcedRow.images``: not decoded again).
    vision = repeat_rows(vision, group_size) if vision is not None else trajectories and trajectories.vision
    if vision is not None:
        batch.vision, batch.images = vision, [row.images for row in vision]
    batch.unscorable = torch.tensor(scores.unscorable, dtype=torch.bool, device=batch.rewards.device)
    batch.reward_log = dict(scores.metrics)
    batch.extra_columns = logged_columns(scores.extra_columns, len(texts))
    if trajectories is not None:
        batch.action_mask = trajectories.action_mask
        batch.transcripts, batch.turn_stats = trajectories.transcripts, trajectories.stats
    if scores.steps is not None:  # process rewards: one value per step, and where each step ends in tokens
        ends = step_token_ends(
            texts, completions.completion_ids, completions.completion_mask, encoder.tokenizer, scorer.step_separator
        )
        step_rewards = torch.full(ends.shape, float("nan"))
        for row, values in enumerate(scores.steps):
            step_rewards[row, : len(values)] = torch.tensor(values)
        batch.step_rewards, batch.step_ends = step_rewards.to(batch.rewards.device), ends.to(batch.rewards.device)
    if timings is not None:
        timings["generate"] = timings.get("generate", 0.0) + generated - start
        if trajectories is not None:
            timings["environment"] = timings.get("environment", 0.0) + trajectories.environment_s
        timings["score"] = timings.get("score", 0.0) + time.perf_counter() - generated
    return batch
