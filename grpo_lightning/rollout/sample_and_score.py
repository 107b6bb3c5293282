"""Sample and score: prompts in, scored completions out. The one piece every generating path shares.

The training round, held-out evaluation (greedy pass@1 and k samples for pass@k / maj@k) and rejection sampling
all call ``sample_and_score``, which asks the round's rollout kind (``rollout/kind.py: RolloutKind``,
``data.environment``) for its scored rows. ``SingleTurn``, here, is the core's own kind (``data.environment:
null``): encode the prompts, have the engine sample, decode, score with every reward. Another kind samples its own
way (an environment's multi-turn trajectories, ``integrations/environments/multiturn.py``; an agent's sessions,
``integrations/agents/rollout.py``) and, for completions it sampled, scores them through ``score_completions``: one path
from completions to a scored ``RolloutBatch``, whatever sampled them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rewards.step_ends import step_token_ends
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.kind import RolloutKind
from grpo_lightning.rollout.prompts import PromptEncoder

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
    environment: RolloutKind | None = None,
) -> RolloutBatch:
    """``params.group_size`` completions (one when greedy) for each prompt of ``rows``, decoded and scored by the
    rollout kind ``environment`` (None: ``SingleTurn``; ``RolloutKind.rollout`` says what the settings do)."""
    encoder.modality.check_run(engine, environment)  # what the policy's modality's rows can use (its images, ...)
    return rollout_kind(environment).rollout(
        rows, engine=engine, encoder=encoder, scorer=scorer, params=params, generator=generator,
        return_logprobs=return_logprobs, device=device, timings=timings,
    )  # fmt: skip


def rollout_kind(environment: RolloutKind | None) -> RolloutKind:
    """The round's rollout kind: ``data.environment``, or single-turn sampling where it is null."""
    return SingleTurn() if environment is None else environment


class SingleTurn(RolloutKind):
    """The core's rollout: one completion per sample, the engine's group sampling (one prefill per prompt), scored
    by the reward functions. Every declaration of ``RolloutKind`` keeps its default but one: its partial rollouts are
    ``rollout/partial.py``'s own."""

    partial_rollouts_refused = None

    def rollout(
        self,
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
    ) -> RolloutBatch:
        start = time.perf_counter()
        prompt_ids, prompt_mask, vision = encoder.encode_rows(rows, device)  # vision: a VLM's image inputs
        images = {} if vision is None else {"vision": vision}
        completions = engine.generate(
            prompt_ids, prompt_mask, params, generator=generator, return_logprobs=return_logprobs, **images
        )
        texts = encoder.decode(completions.completion_ids, completions.completion_mask)
        if timings is not None:
            timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - start
        group_size = 1 if params.greedy else params.group_size
        return score_completions(
            rows,
            completions,
            texts,
            encoder=encoder,
            scorer=scorer,
            params=params,
            vision=encoder.modality.repeat_rows(vision, group_size) if vision is not None else None,
            timings=timings,
        )


def score_completions(
    rows: dict[str, list[Any]],
    completions: Completions,
    texts: list[str],
    *,
    encoder: PromptEncoder,
    scorer: Scorer,
    params: SamplingParams,
    policy_lengths: list[int] | None = None,
    scored_prompts: list[Any] | None = None,
    columns: dict[str, list[Any]] | None = None,
    parts: dict[str, list[float | None]] | None = None,
    part_weights: dict[str, float] | None = None,
    vision: list[Any] | None = None,
    timings: dict[str, float] | None = None,
) -> RolloutBatch:
    """``completions`` (G per row of ``rows``, groups adjacent; ``texts``: what the rewards score) scored by
    ``scorer`` into a ``RolloutBatch``: the one path from sampled completions to scored rows.

    The reward functions get the rows' columns (each repeated for its group), ``completion_lengths`` (the policy's
    tokens: ``policy_lengths``, default every completion token) and ``completion_ids``, then ``columns`` (a kind's
    own: an environment's ``transcripts``); ``scored_prompts``: each completion's own prompt where a kind changed it
    (default the row's). ``parts``: the kind's own reward parts, reward columns beside the functions' under the
    scorer's one rule (None: not applicable), weighed by ``part_weights``. ``vision``: each completion's image
    inputs (a vision-language model's). ``timings["score"]`` accumulates the seconds spent here."""
    start = time.perf_counter()
    group_size = 1 if params.greedy else params.group_size
    prompts = repeat_each(rows["prompt"], group_size)
    every = {name: repeat_each(values, group_size) for name, values in rows.items() if name != "prompt"}
    if policy_lengths is None:
        policy_lengths = completions.completion_mask.sum(-1).tolist()
    every["completion_lengths"] = policy_lengths  # the policy's tokens, for length shaping
    # Each completion's tokens without padding, as TRL passes them (rewards that count or penalise tokens).
    ids, mask = completions.completion_ids.cpu(), completions.completion_mask.cpu().bool()
    every["completion_ids"] = [row[keep].tolist() for row, keep in zip(ids, mask)]
    every.update(columns or {})
    scored = prompts if scored_prompts is None else scored_prompts
    scores = scorer(scored, texts, every, parts=parts, part_weights=part_weights)
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
    # tables, its prompt's images, as the encoder read them (``Modality.logged_images``: not decoded again).
    if vision is not None:
        batch.vision, batch.images = vision, encoder.modality.logged_images(vision)
    batch.unscorable = torch.tensor(scores.unscorable, dtype=torch.bool, device=batch.rewards.device)
    batch.reward_log = dict(scores.metrics)
    batch.extra_columns = logged_columns(scores.extra_columns, len(texts))
    if scores.steps is not None:  # process rewards: one value per step, and where each step ends in tokens
        ends = step_token_ends(
            texts, completions.completion_ids, completions.completion_mask, encoder.tokenizer, scorer.step_separator
        )
        step_rewards = torch.full(ends.shape, float("nan"))
        for row, values in enumerate(scores.steps):
            step_rewards[row, : len(values)] = torch.tensor(values)
        batch.step_rewards, batch.step_ends = step_rewards.to(batch.rewards.device), ends.to(batch.rewards.device)
    if timings is not None:
        timings["score"] = timings.get("score", 0.0) + time.perf_counter() - start
    return batch
