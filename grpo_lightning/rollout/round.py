"""One rollout round, top to bottom: generate → score → filter → advantages → old/ref log-probs → micro-batches.

``run_round`` owns no model. It is given the engine that samples, the encoder and scorer of the prompts and
completions, and ``logprobs``, the function that computes π_old's and π_ref's log-probs of the rollout (the
LightningModule's ``rollout_logprobs``). The DataModule calls it at every epoch start; one round = one epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from grpo_lightning.advantage_registry import AdvantageInputs, estimate_advantages
from grpo_lightning.advantages import distillation_advantages, process_advantages
from grpo_lightning.config import AdvantageConfig, ConfigError, SamplingConfig
from grpo_lightning.engines.base import RolloutEngine, SamplingParams
from grpo_lightning.rewards.combine import column_weight
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.kind import RolloutKind
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.sample_and_score import rollout_kind, sample_and_score


class LogprobFn(Protocol):
    """``(old, ref)`` log-probs ``[N, T]`` of a rollout's completion tokens (None where not asked for)."""

    def __call__(self, batch: RolloutBatch, *, old: bool, ref: bool) -> tuple[Tensor | None, Tensor | None]: ...


@dataclass
class RoundSettings:
    """The algorithm's settings for a round (all from ``data``)."""

    sampling: SamplingConfig
    advantage: AdvantageConfig
    optimizer_steps: int
    """How many optimizer steps the round takes (μ × mini-batches per pass): with more than one, every step
    after the first trains off-policy, so π_old's log-probs are recorded."""
    old_logprobs: Literal["auto", "sampler", "recompute"] = "auto"
    engine_logprobs_exact: bool = True
    """Whether the engine's sampled-token log-probs equal the trainer's (``auto`` then takes them as π_old)."""
    importance_correction: bool = False
    """Keep the engine's log-probs for the truncated importance-sampling correction (an engine that is not the
    trainer: vLLM)."""
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    environment: RolloutKind | None = None
    """The rollout kind (``data.environment``, ``rollout/kind.py``): multi-turn rollouts against an environment, an
    agent's sessions, ...; None = one completion each (single-turn sampling)."""
    reference: bool = True
    """Whether there is a reference model (β > 0): π_ref's log-probs for the KL term."""
    rollout_lag: int = 0
    """L: the rollout trained on was sampled by the policy of L rounds before (``rollout/schedule.py``)."""
    pack_tokens: int | str | None = "auto"
    """``data.update.pack_tokens``: how the log-prob passes over this rollout pack its sequences
    (``models/packing.py``)."""
    correction: Literal["decoupled", "behaviour", "none"] = "decoupled"
    """At a lag: ``decoupled`` (ratio to π_prox, the policy at the update's start, times the behaviour weight
    π_prox / μ, truncated or masked), ``behaviour`` (ratio to μ directly) or ``none`` (ratio to π_prox only)."""
    teacher_weight: float | None = None
    """On-policy distillation (``model.teacher``): this round's λ of the per-token advantage λ · (log π_T − log π_S)
    (``integrations/distillation/teacher.py``); None: no teacher this round. π_S, the student's unfiltered log-probs,
    are then recorded as π_old (at a lag with ``behaviour``, where π_old is μ, by a pass of their own:
    ``student_pass``)."""

    @property
    def record_old(self) -> bool:
        """Whether the loss needs π_old's log-probs: after a round's first optimizer step the policy is no longer
        the one the ratio is taken to; at a lag with ``behaviour``, the ratio is to the sampler's (μ) always; with a
        teacher, π_S of the distillation advantage."""
        lagged_behaviour = self.rollout_lag > 0 and self.correction == "behaviour"
        return self.optimizer_steps > 1 or lagged_behaviour or self.teacher_weight is not None

    @property
    def student_pass(self) -> bool:
        """Whether π_S of the distillation advantage needs a pass of the trainer's beside π_old: at a lag with
        ``behaviour`` π_old is μ, the sampler's filtered distribution (top-p / top-k / the EOS ban: log μ ≥ log π),
        not the student's; π_S is then π_prox, as with the other corrections."""
        return self.teacher_weight is not None and self.rollout_lag > 0 and self.correction == "behaviour"

    @property
    def old_from_engine(self) -> bool:
        """Whether π_old is the engine's log-probs (no pass of the trainer's): at lag 0 where they are the
        trainer's own (or ``sampler`` says so); at a lag with ``behaviour``, μ is π_old by definition."""
        if self.rollout_lag > 0:
            return self.correction == "behaviour"
        exact = self.old_logprobs == "auto" and self.engine_logprobs_exact
        return self.record_old and (self.old_logprobs == "sampler" or exact)

    @property
    def behaviour_weight(self) -> bool:
        """Whether the loss weighs each token by π_old / μ (the engine's log-probs kept): an engine that is not
        the trainer (vLLM), or a lag with the ``decoupled`` correction."""
        if self.rollout_lag > 0:
            return self.correction == "decoupled"
        return self.importance_correction

    @property
    def engine_logprobs(self) -> bool:
        """Whether the engine must return its log-probs (for π_old or the behaviour weight)."""
        return self.old_from_engine or self.behaviour_weight


@dataclass
class SampledRound:
    """Steps 1–3 of a round (generate, score, filter): all that needs no model of the trainer's and no other rank,
    so a background process can make it (``rollout/worker.py``)."""

    batch: RolloutBatch
    generated: int = 0
    """Completions generated (dynamic sampling draws more than it keeps)."""
    draws: int = 1
    """Generations it took (each one ``next_rows()``)."""
    timings: dict[str, float] = field(default_factory=dict)
    version: int = 0
    """The weights that sampled it: the number of rounds trained when they were taken (``rollout/schedule.py``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What its schedule logs of it beside the round's own metrics (partial rollouts: ages, segments, stale groups)."""


def run_round(
    next_rows: Callable[[], dict[str, list[Any]]],
    *,
    engine: RolloutEngine,
    encoder: PromptEncoder,
    scorer: Scorer,
    logprobs: LogprobFn,
    settings: RoundSettings,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    all_gather: Callable[[Tensor], Tensor] | None = None,
    per_rank: Callable[[Any], list[Any]] | None = None,
) -> RolloutBatch:
    """Sample G completions for each prompt of ``next_rows()``, score them and compute what the loss needs:
    ``sample_round`` then ``finish_round``, in one go (lag 0)."""
    sampled = sample_round(
        next_rows, engine=engine, encoder=encoder, scorer=scorer, settings=settings, generator=generator, device=device
    )
    return finish_round(sampled, logprobs=logprobs, settings=settings, all_gather=all_gather, per_rank=per_rank)


def sample_round(
    next_rows: Callable[[], dict[str, list[Any]]],
    *,
    engine: RolloutEngine,
    encoder: PromptEncoder,
    scorer: Scorer,
    settings: RoundSettings,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> SampledRound:
    """1. generate (π_old), 2. score, 3. filter.

    ``next_rows`` returns the next prompts (a dict of columns: ``prompt`` and the dataset's other columns).
    With ``dynamic_sampling`` (DAPO), groups that carry no signal (every advantage 0: ``informative_groups``) are
    dropped and more prompts are drawn, up to ``max_sampling_rounds`` generations, until the rollout has as many
    informative groups as one draw; if the cap is reached the rollout is topped up with uninformative groups (zero
    advantage), so every rank always trains on the same number of rows.
    """
    timings: dict[str, float] = {}

    def sample() -> RolloutBatch:
        return sample_and_score(
            next_rows(),
            engine=engine,
            encoder=encoder,
            scorer=scorer,
            params=SamplingParams.from_config(settings.sampling),
            generator=generator,
            return_logprobs=settings.engine_logprobs,
            device=device,
            timings=timings,
            environment=settings.environment,
        )

    batch = sample()  # 1. generate (π_old) and 2. score
    generated, draws = len(batch), 1
    if settings.dynamic_sampling:  # 3. filter: DAPO dynamic sampling
        batch, generated, draws = refill_informative(batch, sample, settings, encoder.tokenizer.pad_token_id)
    return SampledRound(batch, generated, draws, timings)


def finish_round(
    sampled: SampledRound,
    *,
    logprobs: LogprobFn,
    settings: RoundSettings,
    all_gather: Callable[[Tensor], Tensor] | None = None,
    per_rank: Callable[[Any], list[Any]] | None = None,
    teacher: Callable[[RolloutBatch], Tensor] | None = None,
) -> RolloutBatch:
    """4. advantages, the loss mask, 5. π_old's and π_ref's log-probs (and with a teacher, its log-probs and the
    distillation advantage), and the round's metrics, on the trainer's side (the current weights; collectives
    where ranks must agree). ``teacher``: the teacher's log-probs ``[N, T]`` of a rollout's completion tokens.

    ``all_gather`` collects every rank's rewards for ``scale: batch``; ``per_rank`` collects a small value of every
    rank, in rank order (``collectives.gather_per_rank``), to agree on the environment's metric and reward names.
    Both are collectives, None in a single process.
    """
    batch, timings = sampled.batch, dict(sampled.timings)
    if rollout_kind(settings.environment).names_vary_by_rank and per_rank is not None:
        # An environment's metrics and reward parts are named by what the rank's trajectories did (a tool call):
        # every rank takes the names of all ranks (a count 0, a reward part None where it had none: ``_column``), so
        # all log the same metrics. Only such a kind's names differ (it declares so); otherwise, no collective.
        batch.align_columns(agreed_names(batch.column_names(), per_rank))
    # 4. group-relative advantages, over trajectories: the rows of an agent's session (integrations/agents/) take its
    # own
    batch.advantages = batch.trajectory_values(compute_advantages(batch.per_trajectory(), settings, all_gather))
    # Multi-turn: the policy's tokens only; environment tokens stay context, out of the loss and the KL.
    batch.loss_mask = (batch.completion_mask if batch.action_mask is None else batch.action_mask).clone()
    if settings.mask_truncated_completions:
        batch.loss_mask[batch.truncated] = 0  # DAPO overlong filtering: truncated completions teach nothing

    start = time.perf_counter()  # 5. π_old (unless the sampler's are kept) and π_ref, without gradients
    record_old, from_engine = settings.record_old, settings.old_from_engine
    # The sampler's π_old: the tempered policy's log-probs (lean, transformers give them beside the filtered ones);
    # at a lag with ``behaviour``, μ itself.
    sampler_old = batch.engine_logprobs if settings.rollout_lag > 0 else batch.policy_logprobs
    if record_old and from_engine and sampler_old is None:
        if settings.old_logprobs == "sampler":
            raise ConfigError(
                "data.update.old_logprobs: sampler, but the engine returned no log-probs of the policy (only those of "
                "its filtered sampling distribution); use auto or recompute"
            )
        from_engine = False  # auto: recomputed
    batch.pack_tokens = settings.pack_tokens  # for these passes and the update's
    own_pass = (record_old and not from_engine) or settings.student_pass  # π_old's, or π_S's beside μ
    old, ref = logprobs(batch, old=own_pass, ref=settings.reference)
    student = old if settings.student_pass else None  # else π_S is π_old
    batch.old_logprobs = (sampler_old if from_engine else old) if record_old else None
    batch.ref_logprobs = ref
    batch.policy_logprobs = None  # in π_old now, where needed
    if not settings.behaviour_weight:
        batch.engine_logprobs = None
    distill = None
    if settings.teacher_weight is not None:  # on-policy distillation: the teacher scores the student's tokens
        if teacher is None:
            raise RuntimeError("the round has a teacher weight but no teacher log-prob pass")
        student = batch.old_logprobs if student is None else student
        gap = teacher(batch).to(student.device) - student  # log π_T − log π_S
        distill = distillation_advantages(gap, batch.loss_mask, settings.teacher_weight)
        advantages = batch.advantages if batch.advantages is not None else torch.zeros(len(batch), device=gap.device)
        per_token = advantages if advantages.dim() == 2 else advantages[:, None] * batch.completion_mask
        batch.advantages = per_token.to(distill.dtype) + distill
    timings["logprobs"] = time.perf_counter() - start

    batch.metrics = rollout_metrics(batch, settings, timings)
    if distill is not None:  # the k1 estimate of KL(π_S ‖ π_T) per token, and the advantage it gives
        tokens = batch.loss_mask.bool()
        batch.metrics["distill/reverse_kl_k1"] = -(distill[tokens] / settings.teacher_weight).mean().item()
        batch.metrics["distill/advantage_abs_mean"] = distill[tokens].abs().mean().item()
        batch.metrics["distill/weight"] = settings.teacher_weight  # this round's λ (model.teacher.weight_schedule)
    if settings.dynamic_sampling:  # the kept groups without a signal: the cap's top-up
        batch.metrics["rollout/sampling_rounds"] = float(sampled.draws)
        batch.metrics["rollout/filtered_fraction"] = batch.metrics["rollout/zero_std_group_fraction"]
        batch.metrics["rollout/generated_completions"] = float(sampled.generated)
    return batch


def agreed_names(names: dict[str, list[str]], per_rank: Callable[[Any], list[Any]]) -> dict[str, list[str]]:
    """Each column's names over all ranks (one collective): rank 0's in their order, then each next rank's new
    ones; the same lists on every rank."""
    ranks = per_rank(names)
    return {column: list(dict.fromkeys(n for rank in ranks for n in rank[column])) for column in names}


def informative_groups(batch: RolloutBatch, settings: RoundSettings) -> Tensor:
    """[groups] bool: the group carries a signal, one of its advantages is not 0: the advantages' own answer
    (``compute_advantages``, whatever estimator and aggregation make them: None rewards out of the baseline, GDPO's
    columns normalised each on its own, pass@k's ties, process rewards), on this batch alone, since a batch-wide
    scale or GDPO's batch normalisation never makes a group's advantages 0 or not. The one question of dynamic
    sampling and of ``rollout/zero_std_group_fraction`` / ``rollout/filtered_fraction``."""
    trajectories = batch.per_trajectory()
    groups = len(trajectories) // settings.sampling.group_size
    advantages = compute_advantages(trajectories, settings)
    if advantages is None:  # one sample per prompt: no group to compare with
        return torch.zeros(groups, dtype=torch.bool, device=trajectories.rewards.device)
    return advantages.reshape(groups, -1).ne(0).any(dim=-1)


def refill_informative(
    batch: RolloutBatch, sample: Callable[[], RolloutBatch], settings: RoundSettings, pad_token_id: int
) -> tuple[RolloutBatch, int, int]:
    """DAPO dynamic sampling: keep the groups that carry a signal (``informative_groups``), ``sample()`` more until
    there are enough of them, at most ``settings.max_sampling_rounds`` generations.

    Returns the rollout (informative groups first, topped up with uninformative ones to keep its size), the
    completions generated and the generations it took.
    """
    group_size, max_rounds = settings.sampling.group_size, settings.max_sampling_rounds
    wanted = len(batch.per_trajectory()) // group_size
    kept, spare, generated, rounds = [], [], len(batch), 1
    while True:
        for group, useful in enumerate(informative_groups(batch, settings).tolist()):
            rows = batch.group_rows(group, group_size)
            (kept if useful else spare).append(batch.select(rows))
        if len(kept) >= wanted or rounds >= max_rounds:
            break
        batch = sample()
        generated += len(batch)
        rounds += 1
    return RolloutBatch.concat((kept + spare)[:wanted], pad_token_id), generated, rounds


def compute_advantages(
    batch: RolloutBatch, settings: RoundSettings, all_gather: Callable[[Tensor], Tensor] | None = None
) -> Tensor | None:
    """Outcome advantages ``[N]`` from the registered estimator and aggregation ``data.advantage`` names
    (``advantage_registry``: group-relative, pass@k, GDPO, a user's); per-token ``[N, T]`` when a reward scores steps
    (outcome part added to each). A row no reward column scores (``unscorable``: every column None, or none at all)
    is out of its group's baseline and gets 0, whichever estimator. None with one sample per prompt."""
    config, group_size = settings.advantage, settings.sampling.group_size
    if group_size == 1:  # no group to compare with: the teacher alone teaches (check_before_fit refuses the rest)
        return None
    inputs = AdvantageInputs(
        rewards=batch.rewards,
        group_size=group_size,
        unscorable=batch.unscorable,
        reward_columns=batch.reward_columns,
        weight_of=lambda name: column_weight(batch.reward_weights, name),  # read by GDPO only
        all_gather=all_gather,
    )
    advantages = estimate_advantages(inputs, config.settings)
    if batch.step_rewards is not None:  # process rewards (DeepSeekMath §4.1.3)
        per_token = process_advantages(
            batch.step_rewards, batch.step_ends, batch.completion_mask, group_size, eps=config.eps, std=config.std
        )
        advantages = per_token + advantages[:, None] * batch.completion_mask
    return advantages


def rollout_metrics(batch: RolloutBatch, settings: RoundSettings, timings: dict[str, float]) -> dict[str, float]:
    """Scalar summaries of a round: rewards, advantages, lengths, the share of uninformative groups, timings."""
    trajectories = batch.per_trajectory()  # rewards once per trajectory (an agent's session may make several rows)
    rewards, advantages = trajectories.rewards.float(), batch.advantages.float()
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
        # Groups whose outcome advantages are all 0 (rewards all equal among those scored): they teach nothing.
        "rollout/zero_std_group_fraction": 1.0 - informative_groups(batch, settings).float().mean().item(),
    }
    for name, values in trajectories.reward_columns.items():
        applicable = [v for v in values if v is not None]
        metrics[f"reward/{name}"] = sum(applicable) / len(applicable) if applicable else float("nan")
    if batch.step_rewards is not None:
        metrics["reward/process_step_mean"] = batch.step_rewards.nanmean().item()
    if batch.reward_columns and batch.unscorable is not None and batch.unscorable.any():  # none: the teacher alone
        metrics["rollout/unscorable_fraction"] = batch.unscorable.float().mean().item()
    for name, value in batch.reward_log.items():  # what reward functions logged with ``log_metric``
        metrics[f"reward_log/{name}"] = value
    metrics.update(
        {f"agent/{name}": value for name, value in batch.agent_log.items()}
    )  # integrations/agents/rollout.py
    for phase, seconds in timings.items():
        metrics[f"time/{phase}"] = seconds
    if timings.get("generate"):
        generated = batch.completion_mask if batch.action_mask is None else batch.action_mask  # the policy's
        metrics["time/generated_tokens_per_s"] = generated.sum().item() / timings["generate"]
    for name, values in batch.turn_stats.items():  # multi-turn: turns, tokens, tool calls and errors per trajectory
        metrics[f"rollout/{name}_mean"] = sum(values) / len(values)
        if name == "turns":
            metrics["rollout/turns_max"] = max(values)
    return metrics
