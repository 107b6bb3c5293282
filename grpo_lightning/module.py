"""``GRPOModule``: the policy, the frozen reference model and the GRPO update, as a ``LightningModule``.

The rollout round itself (generate → score → advantages → log-probs) lives in ``rollout/round.py`` and is run by
the DataModule at each epoch start; this module provides the pieces it calls (``generate``, ``score``,
``rollout_logprobs``) and the update (``training_step`` → ``grpo_lightning.loss.grpo_loss``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning import LightningModule
from torch import Tensor
from torchmetrics import Metric
from transformers import PreTrainedModel

from grpo_lightning import rewards as reward_registry
from grpo_lightning.callbacks.checkpointing import module_checkpoint_state, restore_module_checkpoint
from grpo_lightning.callbacks.guard import NonFiniteGuard, nonfinite_inputs, nonfinite_terms
from grpo_lightning.config import ConfigError, ObjectiveConfig, SamplingConfig
from grpo_lightning.evaluation import HeldOutEvaluator
from grpo_lightning.lora import LoraConfig, apply_lora, is_peft_model
from grpo_lightning.loss import grpo_loss
from grpo_lightning.models.build import disable_dropout, enable_activation_checkpointing, load_model, load_tokenizer
from grpo_lightning.models.lean import PromptGroups
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rewards.combine import is_process_reward, score_steps, step_separator
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.generation import (
    DEFAULT_LOGPROB_CHUNK,
    Completions,
    completion_logprobs,
    concat_completions,
    sample_completions,
)
from grpo_lightning.rollout.steps import step_token_ends
from grpo_lightning.strategies import broadcast_module, gathered, shard_model
from grpo_lightning.validation import check_ranges

_LOSS_OPTIONS = ("epsilon_low", "epsilon_high", "delta", "beta", "kl_estimator", "importance_sampling_level")


class GRPOModule(LightningModule):
    """Group Relative Policy Optimization of a causal language model."""

    def __init__(
        self,
        model_name_or_path: str | None = None,
        tiny_model: TinyModelConfig | None = None,
        rewards: list[RewardSpec] | None = None,
        accuracy_reward: str | None = None,
        reward_on_error: Literal["raise", "zero"] = "raise",
        reward_timeout_s: float | None = None,
        sampling: SamplingConfig | None = None,
        objective: ObjectiveConfig | None = None,
        use_chat_template: bool = False,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        logprob_batch_size: int = 64,
        log_entropy: bool = True,
        seed: int = 0,
        eval_num_samples: int = 0,
        eval_temperature: float = 1.0,
        eval_pass_k: list[int] | None = None,
        eval_answer_fn: str | None = None,
        lora: LoraConfig | None = None,
        gradient_checkpointing: bool = False,
        logprob_chunk_size: int | None = DEFAULT_LOGPROB_CHUNK,
        max_nonfinite_skips: int = 3,
        lean_forward: bool = True,
        disable_dropout: bool = True,
    ) -> None:
        """
        Args:
            model_name_or_path: a Hugging Face causal LM (Hub name or local folder). When unset, a tiny Llama is
                built from ``tiny_model`` with the built-in character tokenizer.
            tiny_model: size of the built-in tiny Llama.
            rewards: reward terms (registered name or import path, weight, kwargs); default ``exact_answer``.
            accuracy_reward: the reward whose value ≥ 1 counts as correct for ``val/accuracy`` (default: the first).
            reward_on_error: ``raise`` stops the run when a reward function fails; ``zero`` scores 0 instead.
            reward_timeout_s: time limit per reward-function call (a hanging function is reported by name).
            sampling: rollout sampling settings (group size G, lengths, temperature, top-p, top-k).
            objective: loss and advantage settings (β, clipping, loss aggregation, μ, ...).
            use_chat_template: wrap each prompt in the tokenizer's chat template as a user message.
            lr: AdamW learning rate.
            weight_decay: AdamW weight decay.
            warmup_steps: linear learning-rate warm-up, in optimizer steps.
            logprob_batch_size: rows per forward pass when computing old/reference log-probs at rollout time.
            log_entropy: compute and log the policy's per-token entropy (needed when ``entropy_coef`` ≠ 0).
            seed: seed of the sampling generator (offset by the rank under data parallelism).
            eval_num_samples: k, completions sampled per held-out prompt by ``validate``/``test`` (and validation
                during ``fit``, every ``trainer.check_val_every_n_epoch`` rounds) for ``val/pass@k``, ``val/maj@k``,
                ``val/sample_reward_mean`` and ``val/sample_completion_length_mean``; 0 = greedy only.
                ``val/accuracy`` is always the greedy pass@1.
            eval_temperature: sampling temperature of those k completions (top-p/top-k as in ``sampling``).
            eval_pass_k: the k values of ``val/pass@k`` (unbiased estimator from the k samples); default
                ``[1, eval_num_samples]``.
            eval_answer_fn: import path of ``fn(completion) -> answer | None`` that maj@k votes on (``None``
                abstains), e.g. ``grpo_lightning.rewards.math.extract_answer``; default: the stripped completion.
                Ties go to the answer sampled first.
            lora: train LoRA adapters only (needs PEFT); the reference model is then the policy with its adapter
                disabled, not a second copy of the weights.
            gradient_checkpointing: recompute each decoder layer's activations in the backward pass instead of
                keeping them (less memory, about a third more compute for the update).
            logprob_chunk_size: completion tokens whose full-vocabulary logits exist at once when computing
                log-probs (rollout and update); ``None`` computes the whole micro-batch's logits at once.
            max_nonfinite_skips: an optimizer step whose loss or gradients hold a NaN/Inf is skipped (weights
                unchanged, culprit logged); this many skips in a row stop the run.
            lean_forward: run sampling and log-prob passes on ``grpo_lightning.models.lean`` (Llama, Qwen2,
                Qwen3 and Mistral, unsharded, without LoRA): same arithmetic as the model's forward with less
                Python, and each group's prompt computed once. Other models always use their own forward.
            disable_dropout: set every dropout probability of the policy and the reference to 0 (as TRL does):
                the completions are sampled without dropout, so an update with dropout on would compare a noisy
                π_θ with π_old and the ratio would be off 1 from the first step. ``false`` keeps the model's own.
        """
        super().__init__()
        self.save_hyperparameters()
        check_ranges("model", self.hparams)  # the CLI checks these too; the same one-line errors from Python
        self.sampling = sampling or SamplingConfig()
        self.objective = objective or ObjectiveConfig()
        self.tiny_model = tiny_model or TinyModelConfig()
        self.lora = lora
        if logprob_chunk_size is not None and logprob_chunk_size < 1:
            raise ConfigError(f"model.logprob_chunk_size must be >= 1 or null (got {logprob_chunk_size})")
        if max_nonfinite_skips < 1:
            raise ConfigError(f"model.max_nonfinite_skips must be >= 1 (got {max_nonfinite_skips})")
        self.nonfinite = NonFiniteGuard(max_nonfinite_skips)
        self.reward_specs = rewards or [RewardSpec("exact_answer")]
        # Resolve reward functions now: an unknown name or a failing import is reported before any model loads.
        fns = [spec.build() for spec in self.reward_specs]
        self.outcome_rewards = [(s, f) for s, f in zip(self.reward_specs, fns) if not is_process_reward(f)]
        self.process_rewards = [(s, f) for s, f in zip(self.reward_specs, fns) if is_process_reward(f)]
        if len({step_separator(f) for _, f in self.process_rewards}) > 1:
            raise ConfigError("model.rewards: all process rewards must split steps with the same step_separator")
        names = [spec.name for spec, _ in self.outcome_rewards]
        all_names = [spec.name for spec in self.reward_specs]
        if len(set(all_names)) != len(all_names):
            raise ConfigError(f"model.rewards lists a reward twice: {all_names}")
        self.accuracy_reward = accuracy_reward or (names[0] if names else None)
        if self.accuracy_reward is not None and self.accuracy_reward not in names:
            raise ConfigError(
                f"model.accuracy_reward {accuracy_reward!r} is not an outcome reward of model.rewards: {names}"
            )
        self.tokenizer = load_tokenizer(self.hparams.model_name_or_path)
        self.policy: PreTrainedModel | None = None
        self.ref: PreTrainedModel | None = None
        self.generator: torch.Generator | None = None
        self.ref_changes = False  # set by ReferenceSync: π_ref then has to be saved in checkpoints
        self._generator_state: Tensor | None = None
        self.evaluator = HeldOutEvaluator(eval_num_samples, eval_temperature, eval_pass_k, eval_answer_fn)

    # ----------------------------------------------------------------------------------------- models
    def configure_model(self) -> None:
        """Build the policy and its reference model, then apply gradient checkpointing, LoRA and sharding.

        The reference is a frozen copy of the starting policy when β > 0, or, with LoRA, the policy itself with
        the adapter disabled (``reference_model``). Under ``ModelParallelStrategy`` (``self.device_mesh`` set),
        policy and reference are sharded with FSDP2 the same way: each decoder layer, then the root.
        """
        if self.policy is not None:
            return
        trainer, mesh = self._trainer, self.device_mesh
        zero3 = bool(getattr(trainer.strategy, "zero_stage_3", False)) if trainer is not None else False
        self.policy = load_model(self.hparams.model_name_or_path, self.tiny_model, self.tokenizer)
        if self.hparams.disable_dropout:
            disable_dropout(self.policy)  # before the reference is copied from it: both without dropout
        if mesh is not None and self.hparams.model_name_or_path is None:
            broadcast_module(self.policy)  # random weights: every rank must shard the same model
        if self.objective.beta > 0 and self.lora is None:
            # Under ZeRO-3 the weights are partitioned as they are created, and a partitioned model cannot be
            # deep-copied: the reference is loaded a second time instead.
            if zero3 and self.hparams.model_name_or_path is None:
                raise ConfigError("DeepSpeed ZeRO-3 with model.objective.beta > 0 needs model.model_name_or_path")
            self.ref = (
                load_model(self.hparams.model_name_or_path, self.tiny_model, self.tokenizer)
                if zero3
                else copy.deepcopy(self.policy)
            )
            if self.hparams.disable_dropout:
                disable_dropout(self.ref)  # loaded a second time under ZeRO-3 (a copy already has none)
            self.ref.eval().requires_grad_(False)
        if self.hparams.gradient_checkpointing:
            enable_activation_checkpointing(self.policy)
        if self.lora is not None:
            self.policy = apply_lora(self.policy, self.lora)
            if mesh is not None:
                broadcast_module(self.policy, trainable_only=True)  # adapters start random on every rank
        self.policy.train()  # from_pretrained returns eval mode; the update runs in train mode
        if mesh is not None:
            mp_policy = None
            if trainer is not None and trainer.precision == "bf16-mixed":
                from torch.distributed.fsdp import MixedPrecisionPolicy

                # Compute (and all-gather) in bf16 as autocast would, reduce gradients in float32.
                mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            shard_model(self.policy, mesh, mp_policy=mp_policy)
            if self.ref is not None:
                shard_model(self.ref, mesh, mp_policy=mp_policy)

    @contextmanager
    def reference_model(self) -> Iterator[PreTrainedModel | None]:
        """π_ref for the duration of the block: the frozen copy; with LoRA, the policy with its adapter disabled
        (in eval mode); None when β = 0."""
        if self.ref is not None or self.objective.beta <= 0 or not is_peft_model(self.policy):
            yield self.ref
            return
        was_training = self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                yield self.policy
        finally:
            self.policy.train(was_training)

    def on_fit_start(self) -> None:
        # A validate() run before fit() in the same process leaves metric states created under inference mode,
        # which fit's own evaluation could not update: start from fresh states.
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()

    # -------------------------------------------------------------------- the pieces of a rollout round
    def _sampling_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.hparams.seed + self.global_rank)
            if self._generator_state is not None:
                self.generator.set_state(self._generator_state)
                self._generator_state = None
        return self.generator

    def encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        if self.hparams.use_chat_template:
            prompts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts
            ]
        encoded = self.tokenizer(
            prompts, padding=True, return_tensors="pt", add_special_tokens=not self.hparams.use_chat_template
        )
        return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)

    def old_logprobs_from_sampler(self, record_old: bool) -> bool:
        """Whether π_old's log-probs are taken from the sampler rather than from a forward pass over the rollout.

        ``record_old``: whether the round needs π_old at all, i.e. has more than one optimizer step (μ passes ×
        mini-batches per pass): after the first step the policy is no longer the one that sampled.
        """
        choice = self.objective.old_logprobs
        if not record_old or choice == "recompute":
            return False
        if choice == "sampler":
            return True
        autocast = self._trainer is not None and self._trainer.precision not in ("32-true", "32", 32, "64-true")
        dtype = next(self.policy.parameters()).dtype
        return dtype == torch.float32 and not autocast

    @torch.no_grad()
    def generate(self, prompts: list[str], *, greedy: bool = False, return_logprobs: bool = False) -> Completions:
        """Sample G completions per prompt (one, greedily, when ``greedy``), ``generation_batch_size`` at a time.

        With ``return_logprobs``, ``Completions.logprobs`` holds the sampled tokens' log-probs (π_old).
        """
        s = self.sampling
        group_size = 1 if greedy else s.group_size
        prompts_per_chunk = max(1, s.generation_batch_size // group_size)
        was_training = self.policy.training
        self.policy.eval()  # dropout off while sampling; restored below for the update
        try:
            # FSDP2: the full weights are gathered once for all chunks, not at every decoding step.
            with gathered(self.policy):
                chunks = []
                for start in range(0, len(prompts), prompts_per_chunk):
                    prompt_ids, prompt_mask = self.encode_prompts(prompts[start : start + prompts_per_chunk])
                    chunks.append(
                        sample_completions(
                            self.policy,
                            prompt_ids,
                            prompt_mask,
                            group_size=group_size,
                            max_new_tokens=s.max_new_tokens,
                            min_new_tokens=0 if greedy else s.min_new_tokens,
                            eos_token_id=self.tokenizer.eos_token_id,
                            pad_token_id=self.tokenizer.pad_token_id,
                            temperature=s.temperature,
                            top_k=s.top_k,
                            top_p=s.top_p,
                            greedy=greedy,
                            generator=self._sampling_generator(prompt_ids.device),
                            return_logprobs=return_logprobs,
                            lean=self.hparams.lean_forward,
                        )
                    )
        finally:
            self.policy.train(was_training)
        return concat_completions(chunks, self.tokenizer.pad_token_id)

    def decode(self, completion_ids: Tensor, completion_mask: Tensor) -> list[str]:
        ids = completion_ids.masked_fill(completion_mask == 0, self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
    ) -> tuple[list[float], dict[str, list[float | None]]]:
        """Weighted total of the outcome rewards per completion, and each outcome reward function's values."""
        return reward_registry.score(
            [spec for spec, _ in self.outcome_rewards],
            [fn for _, fn in self.outcome_rewards],
            prompts,
            completions,
            columns,
            on_error=self.hparams.reward_on_error,
            timeout_s=self.hparams.reward_timeout_s,
        )

    def score_steps(
        self,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list[Any]],
        completion_ids: Tensor,
        completion_mask: Tensor,
    ) -> tuple[Tensor, Tensor] | None:
        """Process rewards, if any are configured: ``[N, S]`` step rewards (NaN pads) and step end positions."""
        if not self.process_rewards:
            return None
        specs, fns = zip(*self.process_rewards)
        steps = score_steps(specs, fns, prompts, completions, columns)
        ends = step_token_ends(completions, completion_ids, completion_mask, self.tokenizer, step_separator(fns[0]))
        rewards = torch.full(ends.shape, float("nan"))
        for row, values in enumerate(steps):
            rewards[row, : len(values)] = torch.tensor(values)
        return rewards.to(completion_ids.device), ends.to(completion_ids.device)

    @torch.no_grad()
    def rollout_logprobs(
        self, completions: Completions | RolloutBatch, *, record_old: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """Old-policy log-probs (when ``record_old``: the round has more than one optimizer step; the sampler's are
        kept when the batch has them) and reference log-probs (when β > 0).

        A round of exactly one optimizer step needs no π_old: every micro-batch's forward then runs on the
        weights that sampled, so the ratio against the detached current log-probs is exactly π_θ / π_old.
        """
        args = (
            completions.prompt_ids,
            completions.prompt_mask,
            completions.completion_ids,
            completions.completion_mask,
        )
        kwargs = {
            "temperature": self.sampling.temperature,
            "micro_batch_size": self.hparams.logprob_batch_size,
            "chunk_size": self.hparams.logprob_chunk_size,
            "lean": self.hparams.lean_forward,
        }
        old, ref = getattr(completions, "old_logprobs", None), None
        if not record_old:
            old = None
        elif old is None:
            was_training = self.policy.training
            self.policy.eval()
            old = completion_logprobs(self.policy, *args, **kwargs)[0]
            self.policy.train(was_training)
        with self.reference_model() as reference:  # with LoRA: the policy, adapter disabled
            if reference is not None:
                ref = completion_logprobs(reference, *args, **kwargs)[0]
        return old, ref

    # ------------------------------------------------------------------------------------------ update
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        objective = self.objective
        with_entropy = self.hparams.log_entropy or objective.entropy_coef != 0
        logprobs, entropy = completion_logprobs(
            self.policy,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            temperature=self.sampling.temperature,
            with_entropy=with_entropy,
            chunk_size=self.hparams.logprob_chunk_size,
            lean=self.hparams.lean_forward,
            # Precomputed at rollout time (RolloutBatch.tensors): the lean forward then makes no device sync.
            positions=batch.get("token_positions"),
            groups=(
                PromptGroups(batch["prompt_first"], batch["prompt_inverse"], batch["prompts_padded"])
                if "prompt_first" in batch
                else None
            ),
        )
        loss, metrics = grpo_loss(
            logprobs,
            batch.get("old_logprobs"),
            batch.get("ref_logprobs"),
            batch["advantages"],
            batch["loss_mask"],
            loss_type=objective.loss_type,
            max_completion_length=self.sampling.max_new_tokens,
            num_items=batch["num_items"],
            entropy=entropy.detach() if entropy is not None and objective.entropy_coef == 0 else entropy,
            entropy_coef=objective.entropy_coef,
            **{name: getattr(objective, name) for name in _LOSS_OPTIONS},
        )
        # Checked with the gradients before the optimizer step (one device sync per step, none per micro-batch);
        # if the loss was not finite, these name the culprit.
        terms = {"policy log-probs": logprobs.detach(), "entropy": None if entropy is None else entropy.detach()}
        self.nonfinite.check_later(
            loss,
            lambda: (
                nonfinite_inputs(batch),
                nonfinite_terms(terms, batch["loss_mask"]),
                nonfinite_terms(metrics),
                ["loss"],
            ),
        )
        self.log("train/loss", loss.detach(), prog_bar=False)
        self.log_dict({f"train/{name}": value for name, value in metrics.items()})
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        if batch_idx == 0:
            self._log_rollout_metrics()
        if objective.loss_type == "dapo":
            # num_items already counts the tokens of the whole mini-batch on every rank; undo the averaging
            # that gradient accumulation and DDP apply on top, so the step sees sum(token losses) / num_items.
            loss = loss * self.trainer.accumulate_grad_batches * self.trainer.world_size
        return loss

    def _log_rollout_metrics(self) -> None:
        """The round's rollout summaries (``rollout/``, ``reward/``, ``time/``), once per round."""
        rollout = getattr(self.trainer.datamodule, "last_rollout", None)
        if rollout is None:
            return
        metrics = {k: v for k, v in rollout.metrics.items() if v == v}  # NaN = no applicable value this round
        # One value per round, logged at the epoch level: written at every round's end, whatever
        # trainer.log_every_n_steps is (step-level values would be dropped between its multiples).
        # Under data parallelism each rank has its own rollout: averaged across ranks, the maxima maximised.
        maxima = {k: v for k, v in metrics.items() if k.endswith("_max")}
        means = {k: v for k, v in metrics.items() if k not in maxima}
        self.log_dict(means, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
        self.log_dict(maxima, on_step=False, on_epoch=True, batch_size=1, sync_dist=True, reduce_fx="max")
        # The progress bar's postfix only: the logs hold these under their namespaced names already.
        bar = {"reward": rollout.metrics["rollout/reward_mean"]}
        if "time/generated_tokens_per_s" in rollout.metrics:
            bar["gen_tok/s"] = float(round(rollout.metrics["time/generated_tokens_per_s"]))  # a short postfix
        self.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the parameters that train (the adapters only, with LoRA), with linear warm-up.

        Under FSDP2 these are the rank's shards (DTensors), so the optimizer state is sharded too. Plain CPU and
        CUDA tensors get the fused implementation (one kernel for all parameters, as TRL's default ``optim``)
        wherever Lightning can clip its gradients. Lightning's AMP plugin (``16-mixed``, ``bf16-mixed``) refuses
        to clip for an optimizer that unscales gradients inside its step, as the fused one does, whatever the
        device: with ``trainer.gradient_clip_val`` set under AMP, torch's default implementation is used instead
        (``foreach`` on CUDA, the same arithmetic; the optimizer step is a small part of a round).
        """
        from lightning.pytorch.plugins.precision import MixedPrecision

        params = [p for p in self.policy.parameters() if p.requires_grad]
        trainer = self._trainer
        deepspeed = hasattr(trainer.strategy, "zero_stage_3") if trainer is not None else False
        amp_clipping = (
            trainer is not None
            and bool(trainer.gradient_clip_val)
            and isinstance(trainer.precision_plugin, MixedPrecision)
        )
        fused = (
            not deepspeed
            and not amp_clipping
            and all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
        )
        optimizer = torch.optim.AdamW(
            params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, fused=fused or None
        )
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -------------------------------------------------------------------------------------- evaluation
    def validation_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self.evaluator.evaluate(self, batch, "val", batch_idx)

    def test_step(self, batch: dict[str, list[Any]], batch_idx: int) -> None:
        self.evaluator.evaluate(self, batch, "test", batch_idx)

    def on_train_epoch_start(self) -> None:
        # A fit stopped inside an accumulation window leaves that window's queued losses: not this round's.
        self.nonfinite.clear_pending()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Non-finite guard: a step whose loss or gradients hold a NaN/Inf leaves the weights as they are."""
        self.nonfinite.before_step(self, optimizer)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step the schedule, except after a step that the non-finite guard skipped."""
        if not self.nonfinite.last_skipped:
            super().lr_scheduler_step(scheduler, metric)

    # ------------------------------------------------------------------------------------- checkpoints
    def sampling_generator_state(self) -> Tensor | None:
        """The rollout sampling generator's state (also when restored but not used yet); None before any use."""
        return self.generator.get_state() if self.generator is not None else self._generator_state

    def set_sampling_generator_state(self, state: Tensor | None) -> None:
        """Continue sampling from ``state`` (None: afresh from the seed); applied at the next generation."""
        self._generator_state, self.generator = state, None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adds every rank's RNG states and sampling generator; leaves out π_ref unless it changes."""
        checkpoint.update(module_checkpoint_state(self))
        # Unless ReferenceSync moves it, the reference is the starting model, re-created on load: checkpoints then
        # stay the size of one model.
        if not self.ref_changes:
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("ref.")}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuses another model's checkpoint; restores π_ref (saved or the starting one), RNGs and the guard."""
        if self.ref is not None and "state_dict" in checkpoint:
            state = checkpoint["state_dict"]
            for key, value in self.ref.state_dict().items():
                state.setdefault(f"ref.{key}", value)
        restore_module_checkpoint(self, checkpoint)
