"""One rollout round, in the order of the algorithm: generate → score → advantages → log-probs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo_lightning.loss import group_advantages
from grpo_lightning.rollout.batch import RolloutBatch

if TYPE_CHECKING:
    from grpo_lightning.module import GRPOModule


def repeat_each(values: list[Any], times: int) -> list[Any]:
    """``[a, b]`` → ``[a, a, b, b]`` for ``times=2``: one entry per completion, groups adjacent."""
    return [value for value in values for _ in range(times)]


def collect_rollout(
    module: GRPOModule,
    rows: dict[str, list[Any]],
    *,
    all_gather: Callable[[Tensor], Tensor] | None = None,
) -> RolloutBatch:
    """Sample G completions for each prompt of ``rows``, score them and compute what the loss needs.

    ``rows`` maps column names to lists (``prompt`` plus the dataset's other columns). ``all_gather`` collects
    the rewards of every rank, for advantage scaling by the whole batch's std under data parallelism.
    """
    objective, group_size = module.objective, module.sampling.group_size
    timings: dict[str, float] = {}

    start = time.perf_counter()
    completions = module.generate(rows["prompt"])  # 1. generate (π_old)
    texts = module.decode(completions.completion_ids, completions.completion_mask)
    timings["generate"] = time.perf_counter() - start

    start = time.perf_counter()
    prompts = repeat_each(rows["prompt"], group_size)
    columns = {name: repeat_each(values, group_size) for name, values in rows.items() if name != "prompt"}
    columns["completion_lengths"] = completions.completion_mask.sum(-1).tolist()  # in tokens, for length shaping
    total, per_function = module.score(prompts, texts, columns)  # 2. score
    rewards = torch.tensor(total, dtype=torch.float32)
    timings["score"] = time.perf_counter() - start

    batch_std = None  # 3. group-relative advantages
    if objective.advantage_scale == "batch" and all_gather is not None:
        batch_std = all_gather(rewards).float().flatten().std(unbiased=False)
    advantages = group_advantages(
        rewards,
        group_size,
        scale=objective.advantage_scale,
        baseline=objective.advantage_baseline,
        eps=objective.advantage_eps,
        batch_std=batch_std,
    )

    loss_mask = completions.completion_mask.clone()
    if objective.mask_truncated_completions:
        loss_mask[completions.truncated] = 0

    start = time.perf_counter()
    old_logprobs, ref_logprobs = module.rollout_logprobs(completions)  # 4. log-probs (old if μ > 1, ref if β > 0)
    timings["logprobs"] = time.perf_counter() - start

    device = completions.completion_ids.device
    batch = RolloutBatch(
        prompt_ids=completions.prompt_ids,
        prompt_mask=completions.prompt_mask,
        completion_ids=completions.completion_ids,
        completion_mask=loss_mask,
        advantages=advantages.to(device),
        rewards=rewards.to(device),
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        prompts=prompts,
        completions=texts,
        reward_columns=per_function,
    )
    batch.metrics = rollout_metrics(batch, completions.completion_mask, completions.truncated, group_size, timings)
    return batch


def rollout_metrics(
    batch: RolloutBatch, generated_mask: Tensor, truncated: Tensor, group_size: int, timings: dict[str, float]
) -> dict[str, float]:
    """Scalar summaries of a round: rewards, advantages, lengths, the share of uninformative groups, timings."""
    rewards, advantages = batch.rewards.float(), batch.advantages.float()
    lengths = generated_mask.sum(-1).float()
    group_std = rewards.view(-1, group_size).std(-1, unbiased=False)
    metrics = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std(unbiased=False).item(),
        "rollout/advantage_mean": advantages.mean().item(),
        "rollout/advantage_std": advantages.std(unbiased=False).item(),
        "rollout/advantage_abs_max": advantages.abs().max().item(),
        "rollout/completion_length_mean": lengths.mean().item(),
        "rollout/completion_length_max": lengths.max().item(),
        "rollout/truncated_fraction": truncated.float().mean().item(),
        # Groups whose rewards are all equal have zero advantage everywhere: they teach nothing.
        "rollout/zero_std_group_fraction": (group_std < 1e-6).float().mean().item(),
    }
    for name, values in batch.reward_columns.items():
        applicable = [v for v in values if v is not None]
        metrics[f"reward/{name}"] = sum(applicable) / len(applicable) if applicable else float("nan")
    for phase, seconds in timings.items():
        metrics[f"time/{phase}"] = seconds
    if timings.get("generate"):
        metrics["time/generated_tokens_per_s"] = lengths.sum().item() / timings["generate"]
    return metrics
