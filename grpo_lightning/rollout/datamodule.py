"""``RolloutDataModule``: the prompts, the rollout side of the algorithm, and one fresh rollout per epoch.

One epoch is one rollout round. ``train_dataloader()`` (called at every epoch start, with
``Trainer(reload_dataloaders_every_n_epochs=1)``) returns a loader whose first batch runs the round on this
rank's next ``prompts_per_round`` prompts: ``RolloutCollector.collect`` (``rollout/collector.py``: push the
weights → generate → score → filter → advantages → log-probs → micro-batches); it then serves the rollout for μ
passes in mini-batches (one optimizer step each) of micro-batches (one forward each). The round runs when the
first batch is fetched, after the epoch has started: a loader that Lightning builds and never iterates (as when
it resumes at an epoch boundary) costs nothing and draws no prompt.

This class keeps the prompts (their sources, stream and curriculum, the held-out rows); the collector owns the
engine, the scorer, the environment and the lag schedule. From the LightningModule the data side takes only the
policy side (``rollout/policy_side.py``: the policy, its tokenizer, the log-prob passes of π_old and π_ref).
Callbacks read the latest round as ``last_rollout`` (``latest_rollout(trainer)``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
from datasets import Dataset
from lightning import LightningDataModule, Trainer
from torch import Tensor
from torch.utils.data import DataLoader

from grpo_lightning.collectives import gather_per_rank
from grpo_lightning.config import (
    AdvantageConfig,
    ConfigError,
    EvalConfig,
    SamplingConfig,
    ScheduleConfig,
    UpdateConfig,
)
from grpo_lightning.config_checks import check_partial_rollouts, check_ranges, check_round_settings
from grpo_lightning.engines import RolloutEngine
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.batch import LazyRound, RolloutBatch
from grpo_lightning.rollout.checkpoint_timing import check_checkpoint_timing
from grpo_lightning.rollout.collector import RolloutCollector
from grpo_lightning.rollout.curriculum import CurriculumConfig, CurriculumSampler
from grpo_lightning.rollout.data_sources import PromptData, checked_rows
from grpo_lightning.rollout.kind import RolloutKind, check_rollout_kind
from grpo_lightning.rollout.policy_side import PolicySide
from grpo_lightning.rollout.prompts import load_prompts, prompt_key, prompts_as_keys  # noqa: F401 - load_prompts: kept
from grpo_lightning.rollout.sample_and_score import rollout_kind
from grpo_lightning.rollout.stream import PromptStream

log = logging.getLogger(__name__)


class RolloutDataModule(PromptData, LightningDataModule):
    """Prompts from a built-in task, a local file or the Hub; a generated, scored rollout each epoch."""

    def __init__(
        self,
        dataset: str = "arithmetic",
        subset: str | None = None,
        task_kwargs: dict[str, Any] | None = None,
        train_split: str = "train",
        val_dataset: str | None = None,
        val_split: str | None = "test",
        val_fraction: float | None = None,
        prompt_column: str = "prompt",
        use_chat_template: bool | Literal["auto"] | None = "auto",
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        rewards: list[RewardSpec] | None = None,
        accuracy_reward: str | None = None,
        reward_on_error: Literal["raise", "zero"] = "raise",
        reward_timeout_s: float | None = None,
        engine: str | RolloutEngine = "auto",
        environment: RolloutKind | None = None,
        sampling: SamplingConfig | None = None,
        advantage: AdvantageConfig | None = None,
        update: UpdateConfig | None = None,
        schedule: ScheduleConfig | None = None,
        prompts_per_round: int = 16,
        curriculum: CurriculumConfig | None = None,
        eval: EvalConfig | None = None,
        seed: int = 0,
    ) -> None:
        """
        Args:
            dataset: built-in task name (``arithmetic``), a local ``.jsonl/.json/.parquet/.csv`` file, or a Hub name.
            subset: the Hub dataset's configuration name, if it has several.
            task_kwargs: options of the built-in task.
            train_split: split of ``dataset`` to train on.
            val_dataset: held-out source (same kinds as ``dataset``); defaults to ``dataset``'s ``val_split``, none
                for a local file (``rollout/data_sources.py``).
            val_split: held-out split; ``None`` disables validation.
            val_fraction: hold out this share of the training rows (drawn by ``seed``, never trained on).
            prompt_column: the column holding the prompt: a string, or a list of ``{role, content}`` messages.
            use_chat_template: render prompts with the tokenizer's chat template (a string as a user message);
                ``auto``: when the tokenizer has one.
            system_prompt: a system message put first in every prompt that has none (needs the chat template).
            chat_template_kwargs: further arguments of ``apply_chat_template`` (e.g. ``enable_thinking: false``).
            rewards: reward terms (registered name or import path, weight, kwargs); default ``exact_answer``.
            accuracy_reward: the reward whose value >= 1 counts as correct for ``val/accuracy`` (default: the first).
            reward_on_error: ``raise`` stops the run when a reward function fails; ``zero`` scores 0 instead.
            reward_timeout_s: time limit per reward-function call (a hanging function is reported by name).
            engine: what samples the completions: ``auto`` (= ``lean``), ``lean``, ``transformers``, ``vllm``, or
                ``{class_path, init_args}`` of a ``grpo_lightning.engines.RolloutEngine``.
            environment: multi-turn rollouts against ``{class_path, init_args}`` of a
                ``grpo_lightning.integrations.environments.Environment`` (e.g. ``ToolEnvironment``: tool calls answered
                across turns, ``max_turns`` and per-turn limits among its settings); ``sampling.max_new_tokens`` then
                limits everything after the prompt, turns and observations together. None: one completion each.
                Any ``grpo_lightning.rollout.kind.RolloutKind`` (an agent environment, a user's class) is taken.
            sampling: how a round samples (``SamplingConfig``): group size G, lengths, temperature, top-p, top-k,
                DAPO's dynamic sampling and its cap on generations per round.
            advantage: how rewards become advantages (``AdvantageConfig``: baseline, std scaling, the estimator).
            update: the update half of a round (``UpdateConfig``): μ, the mini- and micro-batch sizes, their
                balance and packing, π_old's source, the truncated completions' mask.
            schedule: when a round is sampled (``ScheduleConfig``): the rollout lag, its off-policy correction, the
                background process's threads and timeout.
            prompts_per_round: prompts per rank per round; the rollout has ``prompts_per_round × G`` completions.
            curriculum: draw prompts by their recent pass rate instead of in shuffled order.
            eval: held-out evaluation (``EvalConfig``): k samples per prompt for pass@k / maj@k (greedy pass@1
                always), the prompts per batch, the first ``limit`` held-out prompts only.
            seed: seed of the prompt order (one shuffle per pass) and of the sampling generator (plus the rank).
        """
        super().__init__()
        check_ranges("data", locals())
        self.init_prompts(locals())  # the sources of the rows, the prompts' chat settings (``PromptData``)
        # Resolved now: an unknown reward, engine or answer function is reported before any model loads.
        self.scorer = Scorer(
            rewards, accuracy_reward=accuracy_reward, on_error=reward_on_error, timeout_s=reward_timeout_s
        )
        self.environment = check_rollout_kind(environment)  # as given (None: single-turn sampling)
        self.rollout_kind = rollout_kind(self.environment)  # what the round and the checks ask
        self.rollout_kind.set_chat_template_kwargs(self.chat_template_kwargs)  # its frames render as the prompts do
        if not self.rollout_kind.takes_process_rewards and self.scorer.process:
            raise ConfigError(
                "data.environment: process rewards (step rewards) do not combine with multi-turn rollouts yet; "
                "use outcome rewards, which score each trajectory's final turn"
            )
        # The settings groups, kept whole: the collector holds these same objects.
        self.sampling, self.advantage = sampling or SamplingConfig(), advantage or AdvantageConfig()
        self.update, self.schedule = update or UpdateConfig(), schedule or ScheduleConfig()
        self.eval = eval or EvalConfig()
        self.collector = RolloutCollector(
            engine=engine,
            scorer=self.scorer,
            environment=self.environment,
            sampling=self.sampling,
            advantage=self.advantage,
            update=self.update,
            schedule=self.schedule,
            prompts_per_round=prompts_per_round,
            seed=seed,
        )
        check_round_settings(
            engine=self.collector.engine,
            update=self.update,
            schedule=self.schedule,
            curriculum=curriculum is not None,
        )
        check_partial_rollouts(
            self.schedule, sampling=self.sampling, engine=self.collector.engine, environment=self.rollout_kind
        )
        self.prompts_per_round, self.seed = prompts_per_round, seed
        self.curriculum = CurriculumSampler(curriculum, seed) if curriculum is not None else None
        self.stream = PromptStream(prompts_per_round, seed, self.curriculum)
        self.train_data: Dataset | None = None
        self.val_data: Dataset | None = None
        self.last_rollout: RolloutBatch | None = None
        """The latest round's rollout (rank's own): what callbacks read (tables, KL control, timing)."""

    # --------------------------------------------------------------------------------- the policy side
    @property
    def policy_side(self) -> PolicySide:
        """The LightningModule, as far as the data side needs it (see ``rollout/policy_side.py``)."""
        return self.trainer.lightning_module

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (the collector's)."""
        return self.collector.engine

    @property
    def rollout_size(self) -> int:
        """Completions per rank per round (fixed, also with dynamic sampling)."""
        return self.collector.plan.rows_per_round

    @property
    def position(self) -> int:
        """This rank's place in the prompt stream (prompts consumed so far, over all ranks)."""
        return self.stream.position

    def next_prompts(self) -> dict[str, list[Any]]:
        """This rank's next ``prompts_per_round`` rows of the training data."""
        return self.stream.next_rows(self.train_data, self.trainer.global_rank, self.trainer.world_size)

    def observe(self, rollout: RolloutBatch, all_gather: Callable[[Tensor], Tensor] | None) -> None:
        """Feed the round's pass rates to the curriculum (adds ``curriculum/`` metrics); nothing without one."""
        if self.curriculum is None:
            return
        with prompts_as_keys(rollout):  # groups are matched to prompts by key: a conversation by its JSON
            self.curriculum.observe(
                rollout.per_trajectory(),  # one row per trajectory (an agent's session may make several)
                lambda i: prompt_key(self.train_data[i]["prompt"]),
                self.sampling.group_size,
                self.scorer.accuracy_reward,
                all_gather=all_gather,
            )

    # ----------------------------------------------------------------------------------------------- data
    def setup(self, stage: str) -> None:
        """Load and check the prompts (before any model is built): columns, prompts, lengths, batch sizes."""
        collector = self.collector
        collector.connect(self.policy_side, self.trainer, prompts=self)
        if stage == "fit":
            collector.check_before_fit()
            if self.train_data is None:
                self.train_data = self._checked(self.sources.training_rows(), self.sources.train_where)
        held_out = self.sources.held_out(self.eval.limit) if self.val_data is None else None
        if held_out is not None:
            self.val_data = self._checked(*held_out)
        if stage == "fit":  # at a lag, only checkpoints at round ends can be resumed from
            check_checkpoint_timing(
                self.trainer,
                lag=self.schedule.rollout_lag,
                round_batches=collector.plan.micro_batches_per_round,
                held_out=self.val_data is not None,
            )

    def _checked(self, data: Dataset, where: str) -> Dataset:
        self.rollout_kind.bind(self.policy_side.tokenizer)  # a chat format it cannot tell, a limit unkept: now
        context, context_name = self.collector.context_limit()
        return checked_rows(
            data,
            where,
            prompt_column=self.prompt_column,
            encoder=self.encoder(),
            scorer=self.scorer,
            environment=self.rollout_kind,
            context_length=context,
            max_new_tokens=self.sampling.max_new_tokens,
            context_name=context_name,
        )

    # ----------------------------------------------------------------------------------------- the round
    def collect_round(self) -> list[dict[str, Any]]:
        """This epoch's round (``RolloutCollector.collect``), cut into the micro-batches of μ passes."""
        self.last_rollout, batches = self.collector.collect(self.trainer.current_epoch)
        return batches

    def teardown(self, stage: str) -> None:
        """The collector lets go of the engine's memory and stops the background process of a lag; the environment
        closes its sessions and any server the run started."""
        self.collector.close()
        self.rollout_kind.close()

    def on_exception(self, exception: BaseException) -> None:
        """A run that fails stops its background rollout process too (Lightning runs no teardown after an error;
        the process would otherwise wait, idle, until this one ends)."""
        if self.collector.background is not None:
            self.collector.background.close()
        self.rollout_kind.close()  # a server the run started stops now, not at the interpreter's exit

    # ----------------------------------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        count = self.collector.plan.micro_batches_per_round  # the round's forwards (``update_plan.py``)
        # The batches are ready-made: no sampler, no worker processes, nothing for Lightning to re-split. A
        # generator of its own: creating an iterator draws a seed, and from the global RNG that draw would differ
        # between a resumed run and an uninterrupted one (Lightning creates one iterator fewer on resume).
        return DataLoader(
            LazyRound(self.collect_round, count), batch_size=None, shuffle=False, generator=torch.Generator()
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_data is None and self.trainer is not None and self.trainer.state.fn == "fit":
            return []  # no held-out data in fit (see setup): Lightning skips an empty loader list
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def _eval_loader(self) -> DataLoader:
        if self.val_data is None:
            raise self.sources.no_held_out_error()
        return self.held_out_loader(self.val_data, self.collector.evaluation_engine, self.rollout_kind)

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every rank's place in the prompt and sampling streams, and at a lag the rounds sampled ahead (a
        collective under data parallelism: Lightning calls it on every rank when it saves a checkpoint). Also the
        settings that made them (a resume that changes one warns) and the curriculum's pass rates."""
        mine = self.collector.rank_state()  # at a lag: after waiting for the round in flight (moves the stream)
        mine["position"] = self.position
        ranks = gather_per_rank(self.trainer, mine)
        state = {
            "position": ranks[0]["position"],  # rank 0's, as checkpoints without ``positions`` have it
            "positions": [r["position"] for r in ranks],
            "sampling_generators": [r["sampling_generator"] for r in ranks],
            "seed": self.seed,
            "dataset": self.source,
            "prompts_per_round": self.prompts_per_round,
            "sampling": dataclasses.asdict(self.sampling),  # what sampled: tools/export_hf.py's generation config
        }
        if self.curriculum is not None:  # the per-prompt pass rates: a key of its own
            state["curriculum"] = self.curriculum.state_dict()
        if self.collector.background is not None:
            state["background"] = [r["background"] for r in ranks]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the prompt and sampling streams (and the rounds sampled ahead) where the checkpoint left them."""
        state, trainer = state_dict, self.trainer
        world = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        self.stream.restore(state.get("positions") or [state.get("position")], rank, world)
        generators = state.get("sampling_generators") or []
        queues = state.get("background") or []
        if queues and len(queues) != world and self.collector.background is not None:
            log.warning(
                "the checkpoint's rounds sampled ahead were made by %d processes, this run has %d: they are sampled "
                "again, from the checkpoint's weights",
                len(queues),
                world,
            )
        elif queues and self.collector.background is None:
            log.warning(
                "the checkpoint holds rounds sampled ahead (data.schedule.rollout_lag > 0): a run at lag 0 drops them"
            )
        self.collector.restore_rank(
            generators[rank] if len(generators) == world else None, queues[rank] if len(queues) == world else None
        )
        changed = [
            f"data.{key}={state[key]!r}"
            for key, value in (
                ("seed", self.seed),
                ("dataset", self.source),
                ("prompts_per_round", self.prompts_per_round),
            )
            if key in state and state[key] != value
        ]
        if changed:
            # Allowed (a new dataset or seed can be intended), but the run then differs from an uninterrupted one.
            log.warning(
                "resuming a prompt stream made with %s; it continues at position %d", ", ".join(changed), self.position
            )
        if self.curriculum is not None and "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])


def latest_rollout(trainer: Trainer) -> RolloutBatch | None:
    """The latest round's rollout of ``trainer``'s ``RolloutDataModule`` (None before the first round, or with
    another DataModule): the interface callbacks read a round through (tables, KL control, timing)."""
    datamodule = trainer.datamodule
    return datamodule.last_rollout if isinstance(datamodule, RolloutDataModule) else None
