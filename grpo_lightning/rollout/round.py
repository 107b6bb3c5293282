"""One rollout round, in the order of the algorithm: generate → score → (filter) → advantages → log-probs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo_lightning.loss import group_advantages, process_advantages
from grpo_lightning.rollout.batch import RolloutBatch

if TYPE_CHECKING:
    from grpo_lightning.module import GRPOModule


def repeat_each(values: list[Any], times: int) -> list[Any]:
    """``[a, b]`` → ``[a, a, b, b]`` for ``times=2``: one entry per completion, groups adjacent."""
    return [value for value in values for _ in range(times)]


def collect_rollout(
    module: GRPOModule,
    next_rows: Callable[[], dict[str, list[Any]]],
    *,
    optimizer_steps: int,
    dynamic_sampling: bool = False,
    max_sampling_rounds: int = 4,
    all_gather: Callable[[Tensor], Tensor] | None = None,
) -> RolloutBatch:
    """Sample G completions for each prompt of ``next_rows()``, score them and compute what the loss needs.

    ``optimizer_steps`` is how many optimizer steps the round will take (μ × mini-batches per pass): with more
    than one, π_old's log-probs are recorded, since every step after the first trains off-policy.

    ``next_rows`` returns the next prompts (a dict of columns: ``prompt`` and the dataset's other columns).
    With ``dynamic_sampling`` (DAPO), groups whose rewards are all equal are dropped and more prompts are drawn,
    up to ``max_sampling_rounds`` generations, until the rollout has as many informative groups as one draw;
    if the cap is reached the rollout is topped up with uninformative groups (zero advantage), so every rank
    always trains on the same number of rows. ``all_gather`` collects every rank's rewards for ``scale="batch"``.
    """
    objective, group_size = module.objective, module.sampling.group_size
    timings = {"generate": 0.0, "score": 0.0}
    record_old = optimizer_steps > 1
    batch = sample_and_score(module, next_rows(), timings, record_old=record_old)  # 1. generate (π_old), 2. score
    generated = len(batch)
    if dynamic_sampling:
        batch, generated, rounds = refill_informative(
            module,
            batch,
            next_rows,
            timings,
            group_size=group_size,
            max_rounds=max_sampling_rounds,
            record_old=record_old,
        )
    batch.advantages = compute_advantages(batch, module, all_gather)  # 3. group-relative advantages
    batch.loss_mask = batch.completion_mask.clone()
    if objective.mask_truncated_completions:
        batch.loss_mask[batch.truncated] = 0  # DAPO overlong filtering: truncated completions teach nothing

    start = time.perf_counter()
    # 4. log-probs: π_old if the round has several optimizer steps, π_ref if β > 0
    batch.old_logprobs, batch.ref_logprobs = module.rollout_logprobs(batch, record_old=record_old)
    timings["logprobs"] = time.perf_counter() - start

    batch.metrics = rollout_metrics(batch, group_size, timings)
    if dynamic_sampling:
        batch.metrics["rollout/sampling_rounds"] = float(rounds)
        batch.metrics["rollout/filtered_fraction"] = 1.0 - informative_groups(batch, group_size).float().mean().item()
        batch.metrics["rollout/generated_completions"] = float(generated)
    return batch


def sample_and_score(
    module: GRPOModule, rows: dict[str, list[Any]], timings: dict[str, float], *, record_old: bool = False
) -> RolloutBatch:
    """Generate G completions per prompt and score them with every reward function.

    ``record_old``: the round needs π_old's log-probs (kept from the sampler when ``old_logprobs`` allows).
    """
    group_size = module.sampling.group_size
    start = time.perf_counter()
    sampler_logprobs = module.old_logprobs_from_sampler(record_old)
    completions = module.generate(rows["prompt"], return_logprobs=sampler_logprobs)
    texts = module.decode(completions.completion_ids, completions.completion_mask)
    timings["generate"] += time.perf_counter() - start

    start = time.perf_counter()
    prompts = repeat_each(rows["prompt"], group_size)
    columns = {name: repeat_each(values, group_size) for name, values in rows.items() if name != "prompt"}
    columns["completion_lengths"] = completions.completion_mask.sum(-1).tolist()  # in tokens, for length shaping
    total, per_function = module.score(prompts, texts, columns)
    steps = module.score_steps(prompts, texts, columns, completions.completion_ids, completions.completion_mask)
    timings["score"] += time.perf_counter() - start

    batch = RolloutBatch(
        prompt_ids=completions.prompt_ids,
        prompt_mask=completions.prompt_mask,
        completion_ids=completions.completion_ids,
        completion_mask=completions.completion_mask,
        truncated=completions.truncated,
        rewards=torch.tensor(total, dtype=torch.float32, device=completions.completion_ids.device),
        prompts=prompts,
        completions=texts,
        reward_columns=per_function,
        old_logprobs=completions.logprobs,  # π_old from the sampler itself, or None: computed later if needed
    )
    if steps is not None:  # process rewards: one value per step, kept apart from the outcome total
        batch.step_rewards, batch.step_ends = steps
    return batch


def informative_groups(batch: RolloutBatch, group_size: int) -> Tensor:
    """[groups] bool: the group's rewards are not all equal (so its advantages are not all zero)."""
    grouped = batch.rewards.view(-1, group_size)
    return (grouped.max(-1).values - grouped.min(-1).values) > 1e-6


def refill_informative(
    module: GRPOModule,
    batch: RolloutBatch,
    next_rows: Callable[[], dict[str, list[Any]]],
    timings: dict[str, float],
    *,
    group_size: int,
    max_rounds: int,
    record_old: bool,
) -> tuple[RolloutBatch, int, int]:
    """DAPO dynamic sampling: keep informative groups, draw more prompts until there are enough of them."""
    wanted = len(batch) // group_size
    pad_token_id = module.tokenizer.pad_token_id
    kept, spare, generated, rounds = [], [], len(batch), 1
    while True:
        informative = informative_groups(batch, group_size)
        for group, useful in enumerate(informative.tolist()):
            rows = torch.arange(group * group_size, (group + 1) * group_size)
            (kept if useful else spare).append(batch.select(rows))
        if len(kept) >= wanted or rounds >= max_rounds:
            break
        batch = sample_and_score(module, next_rows(), timings, record_old=record_old)
        generated += len(batch)
        rounds += 1
    groups = (kept + spare)[:wanted]  # informative first; uninformative only to keep the size fixed
    return RolloutBatch.concat(groups, pad_token_id), generated, rounds


def compute_advantages(
    batch: RolloutBatch, module: GRPOModule, all_gather: Callable[[Tensor], Tensor] | None
) -> Tensor:
    """Outcome advantages ``[N]``; per-token ``[N, T]`` when a reward scores steps (outcome part added to each)."""
    objective, group_size = module.objective, module.sampling.group_size
    advantages = None
    if batch.reward_columns:  # outcome rewards
        batch_std = None
        if objective.advantage_scale == "batch" and all_gather is not None:
            batch_std = all_gather(batch.rewards).float().flatten().std(unbiased=objective.advantage_std == "sample")
        advantages = group_advantages(
            batch.rewards,
            group_size,
            scale=objective.advantage_scale,
            baseline=objective.advantage_baseline,
            eps=objective.advantage_eps,
            batch_std=batch_std,
            std=objective.advantage_std,
        )
    if batch.step_rewards is not None:  # process rewards (DeepSeekMath §4.1.3)
        per_token = process_advantages(
            batch.step_rewards,
            batch.step_ends,
            batch.completion_mask,
            group_size,
            eps=objective.advantage_eps,
            std=objective.advantage_std,
        )
        advantages = per_token if advantages is None else per_token + advantages[:, None] * batch.completion_mask
    return advantages


def rollout_metrics(batch: RolloutBatch, group_size: int, timings: dict[str, float]) -> dict[str, float]:
    """Scalar summaries of a round: rewards, advantages, lengths, the share of uninformative groups, timings."""
    rewards, advantages = batch.rewards.float(), batch.advantages.float()
    if advantages.dim() == 2:  # process rewards: summarise the advantages of real tokens
        advantages = advantages[batch.completion_mask.bool()]
    lengths = batch.completion_mask.sum(-1).float()
    metrics = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std(unbiased=False).item(),
        "rollout/advantage_mean": advantages.mean().item(),
        "rollout/advantage_std": advantages.std(unbiased=False).item(),
        "rollout/advantage_abs_max": advantages.abs().max().item(),
        "rollout/completion_length_mean": lengths.mean().item(),
        "rollout/completion_length_max": lengths.max().item(),
        "rollout/truncated_fraction": batch.truncated.float().mean().item(),
        # Groups whose rewards are all equal have zero advantage everywhere: they teach nothing.
        "rollout/zero_std_group_fraction": 1.0 - informative_groups(batch, group_size).float().mean().item(),
    }
    for name, values in batch.reward_columns.items():
        applicable = [v for v in values if v is not None]
        metrics[f"reward/{name}"] = sum(applicable) / len(applicable) if applicable else float("nan")
    if batch.step_rewards is not None:
        metrics["reward/process_step_mean"] = batch.step_rewards.nanmean().item()
    for phase, seconds in timings.items():
        metrics[f"time/{phase}"] = seconds
    if timings.get("generate"):
        metrics["time/generated_tokens_per_s"] = lengths.sum().item() / timings["generate"]
    return metrics
