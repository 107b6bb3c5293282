"""``RolloutCollector``: one rollout round, from the policy's weights to the micro-batches the update trains on.

It owns what samples and scores a round: the engine, the scorer, the rollout kind (``data.environment``,
``rollout/kind.py``), the round's settings (the groups ``data.sampling``, ``data.advantage``, ``data.update``,
``data.schedule``, as given), this rank's sampling generator and, at ``data.schedule.rollout_lag`` > 0, the
background process and its schedule. Its public surface is small:

- ``connect(policy, trainer, prompts)``: the policy side it samples from (``PolicySide``, the LightningModule)
  and the prompts it draws (``RoundPrompts``, the DataModule);
- ``collect(round_index)``: one round, top to bottom (below);
- ``evaluation_engine()``: the engine on the current weights, for held-out evaluation;
- ``rank_state()`` / ``restore_rank()``: what a checkpoint holds of it (this rank's part);
- ``close()``: the engine lets go of its memory, the background process stops.

The DataModule keeps the prompts (their stream, the curriculum, the held-out rows) and asks it for a round at
every epoch start; the LightningModule only trains on what it serves. Nothing here needs a callback: the weight
push, the release of generation memory and the check of π_old are lines of ``collect``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from datasets import Dataset
from lightning import Trainer
from torch import Tensor

from grpo_lightning.collectives import gather_per_rank
from grpo_lightning.config import AdvantageConfig, ConfigError, SamplingConfig, ScheduleConfig, UpdateConfig
from grpo_lightning.config_checks import check_accumulation, check_weights_can_leave
from grpo_lightning.engines import RolloutEngine, build_engine
from grpo_lightning.lora import is_peft_model
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.kind import RolloutKind
from grpo_lightning.rollout.partial import PartialSettings
from grpo_lightning.rollout.policy_side import PolicySide
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, SampledRound, finish_round, sample_round
from grpo_lightning.rollout.sample_and_score import rollout_kind
from grpo_lightning.rollout.schedule import BackgroundRollouts, policy_state
from grpo_lightning.rollout.stream import PromptStream
from grpo_lightning.rollout.worker import WorkerSpec
from grpo_lightning.update_plan import plan_update


class RoundPrompts(Protocol):
    """What a round draws its prompts from (``RolloutDataModule`` provides it)."""

    stream: PromptStream
    """The resumable prompt order (at a lag the background process draws from a copy of it)."""
    train_data: Dataset | None

    def next_prompts(self) -> dict[str, list[Any]]:
        """This rank's next prompts (a dict of columns)."""
        ...

    def encoder(self, tokenizer: Any = None) -> PromptEncoder:
        """The prompts' encoder (the chat settings) for ``tokenizer`` (default: the policy's)."""
        ...

    def observe(self, rollout: RolloutBatch, all_gather: Callable[[Tensor], Tensor] | None) -> None:
        """The round's pass rates, for a curriculum that picks the next prompts by them."""
        ...


class RolloutCollector:
    """Samples, scores and prepares one round; owns the engine, scorer, rollout kind and lag schedule."""

    def __init__(
        self,
        *,
        engine: str | RolloutEngine,
        scorer: Scorer,
        environment: RolloutKind | None,
        sampling: SamplingConfig,
        advantage: AdvantageConfig,
        update: UpdateConfig,
        schedule: ScheduleConfig,
        prompts_per_round: int,
        seed: int,
    ) -> None:
        """The settings are ``RolloutDataModule``'s of the same names (its docstring says what each does); the
        settings groups are kept as given (not copied): ``data.sampling``, ``data.advantage``, ``data.update``,
        ``data.schedule``."""
        self.engine = build_engine(engine)  # an unknown name is refused now, before any model loads
        self.scorer, self.environment = scorer, rollout_kind(environment)  # None: single-turn sampling
        self.sampling, self.advantage, self.update, self.schedule = sampling, advantage, update, schedule
        advantage.check_round(sampling.group_size, process_rewards=bool(scorer.process))  # k <= G, outcome rewards
        # The update half of every round: μ passes × mini-batches × micro-batches.
        self.plan = plan_update(update, prompts_per_round=prompts_per_round, group_size=sampling.group_size)
        self.seed = seed
        lag = schedule.rollout_lag
        partial = PartialSettings.of(schedule, sampling, prompts_per_round) if schedule.partial_rollouts else None
        self.background = (
            BackgroundRollouts(lag, self.engine, schedule.rollout_threads, schedule.rollout_timeout_s, partial)
            if lag
            else None
        )
        self.generator: torch.Generator | None = None  # this rank's sampling stream (made at first use)
        self._generator_state: Tensor | None = None  # restored from a checkpoint, applied at first use
        self._policy: PolicySide | None = None
        self._trainer: Trainer | None = None
        self._prompts: RoundPrompts | None = None

    # --------------------------------------------------------------------------------------- the wiring
    def connect(self, policy: PolicySide, trainer: Trainer, prompts: RoundPrompts) -> None:
        """Sample from ``policy`` (its weights are read when a round runs: it may not be built yet), on this rank
        of ``trainer`` (its precision, rank and world size), drawing from ``prompts``."""
        self._policy, self._trainer, self._prompts = policy, trainer, prompts

    def check_before_fit(self) -> None:
        """Refuse, in one line and before any prompt or model loads, a run these settings cannot train: weights
        that cannot leave the strategy for the engine, batch sizes the Trainer's accumulation does not fit, a
        temperature the teacher cannot score at, what the policy's modality cannot take (a vision model's images on an
        engine that takes none, ``Modality.check_run``), no learning signal at all."""
        trainer = self._trainer
        check_weights_can_leave(trainer.strategy, self.engine, self.schedule.rollout_lag)
        check_accumulation(trainer.accumulate_grad_batches, self.plan)
        policy = self.policy  # after the strategy's checks, which need no model
        rewards_teach = self.environment.gives_rewards or any(spec.weight for spec in self.scorer.specs)
        policy.check_teacher(self.sampling.temperature, rewards_teach)  # and a weight schedule that stops it
        if self.sampling.group_size == 1 and (rewards_teach or policy.distillation_weight is None):
            raise ConfigError(
                "data.sampling.group_size 1 gives every reward a zero advantage (a group of one has no baseline); "
                "set group_size >= 2, or use it with model.teacher and data.rewards of weight 0"
            )
        if self.sampling.group_size == 1 and self.sampling.dynamic_sampling:
            raise ConfigError(
                "data.sampling.dynamic_sampling drops every group whose rewards tie, and a group of one always ties: "
                "set data.sampling.dynamic_sampling false with data.sampling.group_size 1"
            )
        policy.modality.check_run(self.engine, self.environment)
        if self.schedule.partial_rollouts and policy.modality.has_row_inputs:
            raise ConfigError(
                f"data.schedule.partial_rollouts does not take a {policy.modality.name} model's rows yet: set "
                "partial_rollouts: false"
            )
        if not self.scorer.specs and not self.environment.gives_rewards and policy.distillation_weight is None:
            raise ConfigError(
                "data.rewards is empty and neither model.teacher nor data.environment gives a learning signal: "
                "name a reward (e.g. [{name: exact_answer}]) or set model.teacher"
            )

    @property
    def policy(self) -> PolicySide:
        if self._policy is None:
            raise RuntimeError("the rollout collector is not connected to a policy: call connect() first")
        return self._policy

    def context_limit(self) -> tuple[int | None, str]:
        """The longest prompt + completion a round can take, and what sets it (for the data's check before
        training): the model's context, the engine's (vLLM's ``max_model_len``) or the teacher's."""
        policy = self.policy
        model = policy.context_length()
        limit = self.engine.max_context(model)
        name = "the model's context" if limit == model else self.engine.context_name
        teacher = policy.teacher_context_length()
        if teacher is not None and (limit is None or teacher < limit):
            limit, name = teacher, "model.teacher's context"
        return limit, name

    def round_settings(self) -> RoundSettings:
        """The algorithm's settings of a round (the engine's settings only: it is not set up here)."""
        full_precision = str(self._trainer.precision) in ("32-true", "32", "64-true") if self._trainer else True
        update, sampling = self.update, self.sampling
        return RoundSettings(
            sampling=self.sampling,
            advantage=self.advantage,
            optimizer_steps=self.plan.optimizer_steps,
            old_logprobs=update.old_logprobs,
            engine_logprobs_exact=full_precision and self.engine.logprobs_match_policy(self.policy.policy),
            importance_correction=not self.engine.shares_weights,
            mask_truncated_completions=update.mask_truncated_completions,
            dynamic_sampling=sampling.dynamic_sampling,
            max_sampling_rounds=sampling.max_sampling_rounds,
            environment=self.environment,
            reference=self.policy.has_reference,
            rollout_lag=self.schedule.rollout_lag,
            pack_tokens=update.pack_tokens,
            correction=self.schedule.off_policy_correction,
            teacher_weight=self.policy.distillation_weight,
        )

    # ----------------------------------------------------------------------------------------- a round
    def collect(self, round_index: int) -> tuple[RolloutBatch, list[dict[str, Any]]]:
        """Round ``round_index``: its rollout and the micro-batches of μ passes over it (DeepSeekMath, Alg. 1).

        At a lag (``data.schedule.rollout_lag`` = L) steps 1–4 happened in the background process, L rounds ago: this
        round pushes the current weights to it, launches round k + L and takes round k (``rollout/schedule.py``).
        """
        policy, prompts, settings = self.policy, self._prompts, self.round_settings()
        gather, per_rank = self._collectives()
        self.scorer.trainer_state.update(policy.global_step, round_index)  # TRL's trainer_state: this round's
        push_s = self.push_weights() if self.background is None else None  # 1. π_old ← π_θ: the engine's weights
        with policy.rollout_context():
            if self.background is None:  # 2. generate (π_old), 3. score, 4. filter (DAPO dynamic sampling)
                sampled = sample_round(
                    prompts.next_prompts,
                    engine=self.current_engine(),
                    encoder=prompts.encoder(),
                    scorer=self.scorer,
                    settings=settings,
                    generator=self.sampling_generator(policy.device),
                    device=policy.device,
                )
            else:  # 1–4 at a lag: push to the background process, launch round k + L, take round k
                sampled = self._take_from_background(round_index)
            # 5. group-relative advantages, the loss mask, 6. π_old's and π_ref's log-probs (no gradients); with a
            # teacher, its log-probs and the distillation advantage
            rollout = finish_round(
                sampled,
                logprobs=policy.rollout_logprobs,
                settings=settings,
                all_gather=gather,
                per_rank=per_rank,
                teacher=policy.teacher_logprobs if settings.teacher_weight is not None else None,
            )
        if self.engine.is_setup:  # 7. generation's memory back to the update (vLLM's sleep mode)
            self.engine.offload()
        prompts.observe(rollout, gather)  # the curriculum's pass rates (adds curriculum/ metrics)
        check_old_logprobs(rollout, settings, round_index)
        if push_s is not None:
            rollout.metrics["time/weight_sync"] = push_s
        if self.background is not None:
            rollout.metrics["rollout/lag"] = float(round_index - sampled.version)
            rollout.metrics.update(sampled.metrics)  # partial rollouts: ages, segments, stale groups
        batches = rollout.micro_batches(  # 8. μ shuffled passes × mini-batches (steps) × micro-batches (forwards)
            self.plan,
            generator=torch.Generator().manual_seed(self.seed + prompts.stream.position),
            sum_across_ranks=(lambda t: gather(t).sum(0)) if gather is not None else None,
            balance_tokens=self.update.balance_micro_batches,
        )
        policy.receive_round(self.plan, rollout.metrics)  # 9. the round's record: the module logs it, once
        return rollout, batches

    def _collectives(self) -> tuple[Callable[[Tensor], Tensor] | None, Callable[[Any], list[Any]] | None]:
        """``all_gather`` of a tensor and ``per_rank`` of a small value, under data parallelism (else None)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return None, None
        return self.policy.all_gather, lambda value: gather_per_rank(trainer, value)

    # -------------------------------------------------------------------------------------- the engine
    def current_engine(self) -> RolloutEngine:
        """The engine, set up on the policy (again if the module built a new one, e.g. a second ``fit``)."""
        policy = self.policy
        if self.engine.policy is not policy.policy:
            self.engine.setup(policy.policy, policy.tokenizer, policy.modality)
        return self.engine

    def push_weights(self) -> float | None:
        """Give the engine the policy's current weights if it holds a stale copy (vLLM; ``lean`` and
        ``transformers`` share the policy's): the seconds it took, None when nothing was pushed. Under FSDP2 the
        engine gathers one parameter at a time, on every rank: the whole model is never gathered at once."""
        engine, policy = self.current_engine(), self.policy
        if engine.is_current(policy.global_step):
            return None
        start = time.perf_counter()
        engine.load_weights(policy.policy, policy.global_step)
        return time.perf_counter() - start

    def evaluation_engine(self) -> RolloutEngine:
        """The engine on the current weights, for held-out evaluation. At a lag with servers (shared with the
        background process, which may be sampling a round ahead from the weights it was given), that round is
        finished first: the evaluation's push replaces those weights."""
        if self.background is not None and self.engine.remote:
            self.background.schedule.drain()
        self.push_weights()
        return self.engine

    def sampling_generator(self, device: torch.device) -> torch.Generator:
        """This rank's sampling stream (seeded by ``seed`` + rank; continued from a checkpoint when resumed)."""
        if self.generator is None or self.generator.device != device:
            rank = self._trainer.global_rank if self._trainer is not None else 0
            self.generator = torch.Generator(device=device).manual_seed(self.seed + rank)
            if self._generator_state is not None:
                self.generator.set_state(self._generator_state)
                self._generator_state = None
        return self.generator

    # ----------------------------------------------------------------------------------------- at a lag
    def _take_from_background(self, round_index: int) -> SampledRound:
        sampled = self.background.take(round_index, worker_spec=self._worker_spec, weights=self._weights_for_background)
        if self.background.schedule.position is not None:  # the prompt stream follows the worker's
            self._prompts.stream.position = self.background.schedule.position
        sampled.batch = sampled.batch.to(self.policy.device)  # sent on the CPU; the log-prob passes run here
        return sampled

    def _weights_for_background(self) -> dict[str, Tensor]:
        """What the worker is sent at a round boundary (every worker is idle then): the policy's weights, or, for
        a remote engine (vLLM servers), only the version the servers now hold: this process pushes the weights to
        them itself, on every rank at once (the push waits for all ranks)."""
        if not self.engine.remote:
            return policy_state(self.policy.policy)
        self.push_weights()
        return {"pushed_version": torch.tensor(self.policy.global_step)}

    def _worker_spec(self, position: int | None, threads: int) -> WorkerSpec:
        """What the background process builds its side from: the policy's architecture, the prompts, the scorer,
        the round's settings; the prompt stream at ``position`` (None: where the DataModule's stands)."""
        policy, trainer, prompts = self.policy, self._trainer, self._prompts
        base = policy.policy.get_base_model() if is_peft_model(policy.policy) else policy.policy
        stream = copy.deepcopy(prompts.stream)
        if position is not None:
            stream.position = position
        return WorkerSpec(
            engine=copy.deepcopy(self.background.engine),
            model_config=base.config,
            generation_config=base.generation_config,
            dtype=next(policy.policy.parameters()).dtype,
            tokenizer=policy.tokenizer,
            encoder=prompts.encoder(policy.tokenizer),
            scorer=self.scorer,
            settings=self.round_settings(),
            data=prompts.train_data,
            stream=stream,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            seed=self.seed,
            device=str(policy.device),
            threads=threads,
            autocast={"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(trainer.precision)),
        )

    # ------------------------------------------------------------------------------------- checkpoints
    def rank_state(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: its sampling generator and, at a lag, the rounds sampled ahead (after
        waiting for the one in flight; the prompt stream then stands where the worker left it)."""
        generator = self.generator.get_state() if self.generator is not None else self._generator_state
        state: dict[str, Any] = {"sampling_generator": generator}
        if self.background is not None:
            state["background"] = self.background.state_dict(self._prompts.stream, self.policy.modality)
        return state

    def restore_rank(self, generator_state: Tensor | None, background: dict[str, Any] | None) -> None:
        """Continue this rank's sampling stream (applied at first use) and its rounds sampled ahead (None: none
        saved, the schedule starts afresh from the prompt stream)."""
        self._generator_state, self.generator = generator_state, None
        if self.background is not None:
            self.background.load_state_dict(background)

    def close(self) -> None:
        """The engine lets go of what it holds (vLLM: memory, process group; its next use sets it up again); the
        background process stops (its rounds in flight are dropped: a checkpoint never needs them)."""
        self.engine.close()
        if self.background is not None:
            self.background.close()


def check_old_logprobs(rollout: RolloutBatch, settings: RoundSettings, round_index: int) -> None:
    """A round with more than one optimizer step trains off-policy after its first: without π_old's log-probs its
    ratio would be fixed at 1. Refused (a ``PolicySide.rollout_logprobs`` that returned none)."""
    if settings.record_old and rollout.old_logprobs is None:
        raise RuntimeError(
            f"round {round_index + 1} has {settings.optimizer_steps} optimizer steps but carries no π_old "
            "log-probs: the ratio would be fixed at 1 after its first (rollout_logprobs(old=True) returned None)"
        )
