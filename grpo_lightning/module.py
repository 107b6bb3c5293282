"""``GRPOModule``: the policy, the frozen reference model, the log-probs the loss needs, and the GRPO update.

The rollout (sampling, rewards, advantages) is the data side's (``rollout/collector.py``); this module gives it the
policy side (``rollout/policy_side.py: PolicySide``: the policy and tokenizer, the rollout context, π_old's and
π_ref's log-probs) and trains on what it serves: ``training_step`` → ``grpo_lightning.losses.grpo_loss``, micro-batch
by micro-batch of the round's ``UpdatePlan`` (``update_plan.py``), which arrives with the round's metrics through
``receive_round`` (logged once per round). β and
π_ref can change during a run through ``set_beta`` and ``update_reference`` (``callbacks/kl.py``), an adaptive
entropy coefficient at each optimizer step (``entropy_control``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning import LightningModule
from torch import Tensor
from torchmetrics import Metric
from transformers import PreTrainedModel

from grpo_lightning.collectives import gather_per_rank
from grpo_lightning.config import ConfigError, ObjectiveConfig
from grpo_lightning.config_checks import check_checkpoint_fits, check_ranges
from grpo_lightning.distillation import TeacherConfig, build_teacher, check_teacher_run
from grpo_lightning.evaluation import HeldOutMetrics
from grpo_lightning.guard import NonFiniteGuard, nonfinite_inputs, nonfinite_terms
from grpo_lightning.lora import LoraConfig, is_peft_model
from grpo_lightning.losses import STEP_NORMALISED, grpo_loss
from grpo_lightning.metrics import merge_rank_metrics
from grpo_lightning.models.build import load_tokenizer, model_modality
from grpo_lightning.models.logprobs import DEFAULT_LOGPROB_CHUNK, completion_logprobs
from grpo_lightning.models.policy_and_reference import attached_trainer, build_policy, context_length, sampling_context
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.optimizer import adamw_with_warmup
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.update_plan import Place, UpdatePlan

# Lightning loads checkpoints with ``torch.load(weights_only=True)``: the settings objects saved with the
# hyperparameters must be allowed explicitly, or every resume fails to unpickle them.
torch.serialization.add_safe_globals([TinyModelConfig, ObjectiveConfig, LoraConfig, TeacherConfig])

_LOSS_OPTIONS = (
    "loss_type",
    "aggregation",
    "epsilon_low",
    "epsilon_high",
    "delta",
    "clip_ratio_c",
    "importance_sampling_level",
    "loss_kwargs",
    "kl_estimator",
    "kl_importance_weighted",
    "off_policy_mask",
    "tis_cap",
    "tis_level",
    "tis_mode",
)


class GRPOModule(LightningModule):
    """Group Relative Policy Optimization of a causal language model: policy, reference, loss, optimizer."""

    def __init__(
        self,
        model_name_or_path: str | None = None,
        tiny_model: TinyModelConfig | None = None,
        objective: ObjectiveConfig | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lora: LoraConfig | None = None,
        gradient_checkpointing: bool = False,
        disable_dropout: bool = True,
        lean_forward: bool = True,
        logprob_batch_size: int = 64,
        logprob_chunk_size: int | None = DEFAULT_LOGPROB_CHUNK,
        log_entropy: bool = True,
        max_nonfinite_skips: int = 3,
        teacher: TeacherConfig | None = None,
        freeze_vision_tower: bool = True,
    ) -> None:
        """
        Args:
            model_name_or_path: a Hugging Face causal LM (Hub name or local folder). When unset, a tiny Llama is
                built from ``tiny_model`` with the built-in character tokenizer.
            tiny_model: size of the built-in tiny Llama.
            objective: the loss and its variants (β, clipping, aggregation, GSPO, entropy bonus).
            lr: AdamW learning rate.
            weight_decay: AdamW weight decay.
            warmup_steps: linear learning-rate warm-up, in optimizer steps.
            lora: train LoRA adapters only (needs PEFT); the reference model is then the policy with its adapter
                disabled, not a second copy of the weights.
            gradient_checkpointing: recompute each decoder layer's activations in the backward pass instead of
                keeping them (less memory, about a third more compute for the update).
            disable_dropout: set every dropout probability of the policy and the reference to 0 (as TRL does):
                the completions are sampled without dropout, so an update with dropout on would compare a noisy
                π_θ with π_old and the ratio would be off 1 from the first step. ``false`` keeps the model's own.
            lean_forward: run log-prob passes on ``grpo_lightning.models.lean_forward`` (Llama, Qwen2, Qwen3 and
                Mistral, unsharded, without LoRA): the same arithmetic as the model's forward with less Python,
                and each group's prompt computed once. Other models always use their own forward.
            logprob_batch_size: rows per forward pass when computing old/reference log-probs at rollout time.
            logprob_chunk_size: completion tokens whose full-vocabulary logits exist at once when computing
                log-probs (rollout and update); ``None`` computes the whole micro-batch's logits at once.
            log_entropy: compute and log the policy's per-token entropy (computed anyway when the loss needs it).
            max_nonfinite_skips: an optimizer step whose loss or gradients hold a NaN/Inf is skipped (weights
                unchanged, culprit logged); this many skips in a row stop the run.
            teacher: on-policy distillation (``integrations/distillation/teacher.py``): a frozen model whose
                log-prob of each token the student samples, minus the student's, is that token's advantage (weighted
                by ``teacher.weight``).
            freeze_vision_tower: a vision-language model's vision encoder does not train
                (``integrations/vision/models.py``).
        """
        super().__init__()
        self.save_hyperparameters()
        check_ranges("model", self.hparams)  # the CLI checks these too; the same one-line errors from Python
        self.objective = objective or ObjectiveConfig()
        self.tiny_model = tiny_model or TinyModelConfig()
        self.lora = lora
        if logprob_chunk_size is not None and logprob_chunk_size < 1:
            raise ConfigError(f"model.logprob_chunk_size must be >= 1 or null (got {logprob_chunk_size})")
        if max_nonfinite_skips < 1:
            raise ConfigError(f"model.max_nonfinite_skips must be >= 1 (got {max_nonfinite_skips})")
        self.nonfinite = NonFiniteGuard(max_nonfinite_skips)
        self.teacher = (
            build_teacher(teacher) if teacher is not None else None
        )  # the plug-in: integrations/distillation/teacher.py
        self.modality = model_modality(model_name_or_path)  # what rows add to their ids (grpo_lightning/modality.py)
        self.tokenizer = load_tokenizer(model_name_or_path, modality=self.modality)
        self.policy: PreTrainedModel | None = None
        self.ref: PreTrainedModel | None = None
        self.beta = self.objective.beta  # the KL weight now: KLController may adapt it (``set_beta``)
        self.entropy_control = self.objective.entropy_control()  # the entropy bonus's c now (may adapt)
        self.reference_moved = False  # π_ref differs from the starting model (``update_reference``): saved then
        self.evaluator = HeldOutMetrics()
        self.plan: UpdatePlan | None = None  # the rounds' update plan, handed over with each round (receive_round)
        self.place: Place | None = None  # where the micro-batch in training stands in it
        self._round_metrics: dict[str, float] | None = None  # the latest round's rollout metrics, until logged

    # ----------------------------------------------------------------------------------------- models
    def configure_model(self) -> None:
        """Build the policy and, when β > 0, its reference (``models/policy_and_reference.py: build_policy``).

        The reference is a frozen copy of the starting policy, or, with LoRA, the policy itself with the adapter
        disabled (``reference_model``). Under ``ModelParallelStrategy`` both are sharded with FSDP2.
        """
        if self.policy is not None:
            return
        self.policy, self.ref = build_policy(
            self.hparams.model_name_or_path,
            self.tiny_model,
            self.tokenizer,
            trainer=attached_trainer(self),
            mesh=self.device_mesh,
            reference=self.has_reference,
            no_dropout=self.hparams.disable_dropout,
            gradient_checkpointing=self.hparams.gradient_checkpointing,
            lora=self.lora,
            freeze_vision_tower=self.hparams.freeze_vision_tower,
            modality=self.modality,
        )
        if self.teacher is not None:  # not a child module: its own device, never in checkpoints
            self.teacher.build(self.policy, self.tokenizer, self.modality)

    @property
    def distillation_weight(self) -> float | None:
        """This round's λ of on-policy distillation (``TeacherConfig.round_weight``); None without a teacher."""
        return self.teacher.config.round_weight(self.current_epoch) if self.teacher is not None else None

    def teacher_temperature(self, sampling_temperature: float) -> float:
        """τ_T, the temperature of the teacher's pass: ``model.teacher.temperature``, else the sampling one."""
        chosen = self.teacher.config.temperature if self.teacher is not None else None
        return sampling_temperature if chosen is None else chosen

    def teacher_logprobs(self, batch: RolloutBatch) -> Tensor:
        """The teacher's log-probs of the rollout's completion tokens, at τ_T (``teacher_temperature``)."""
        args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        chunk, rows = self.hparams.logprob_chunk_size, self.hparams.logprob_batch_size
        temperature = self.teacher_temperature(batch.temperature)
        options = {"temperature": temperature, "micro_batch_size": rows, "chunk_size": chunk}
        options.update(lean=self.hparams.lean_forward, pack_tokens=batch.pack_tokens)
        # The student's rows' inputs (a vision-language student's images), given as its modality gives them.
        return self.teacher.logprobs(*args, **options, vision=batch.vision or None, modality=self.modality)

    def teacher_context_length(self) -> int | None:
        return self.teacher.context_length() if self.teacher is not None else None

    def check_teacher(self, temperature: float, rewards_teach: bool = True) -> None:
        """Refuse, before training, a teacher temperature (τ_T, from the sampling ``temperature``) the teacher cannot
        score at (a served one: 1 only), a teacher that cannot see a vision-language student's images, or a weight
        schedule that stops it where no reward teaches."""
        if self.teacher is not None:
            check_teacher_run(self.teacher, self.teacher_temperature(temperature), rewards_teach, self.modality)

    @property
    def has_reference(self) -> bool:
        """Whether the loss has a KL term to a reference model (β > 0 when the run started)."""
        return self.objective.beta > 0

    @contextmanager
    def reference_model(self) -> Iterator[PreTrainedModel | None]:
        """π_ref for the duration of the block: the frozen copy; with LoRA, the policy with its adapter disabled
        (in eval mode); None when β = 0."""
        if self.ref is not None or not self.has_reference or not is_peft_model(self.policy):
            yield self.ref
            return
        was_training = self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                yield self.policy
        finally:
            self.policy.train(was_training)

    def context_length(self) -> int | None:
        """The longest sequence (prompt + completion) the policy supports, from its config; None when unknown."""
        return context_length(self.hparams.model_name_or_path, self.tiny_model)

    def on_fit_start(self) -> None:
        # A validate() run before fit() in the same process leaves metric states created under inference mode,
        # which fit's own evaluation could not update: start from fresh states.
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()

    # -------------------------------------------------------------------------- the rollout's policy side
    def rollout_context(self) -> AbstractContextManager[None]:
        """What a rollout runs in: the Trainer's precision and the policy's full weights, gathered once."""
        return sampling_context(attached_trainer(self), self.policy)

    @torch.no_grad()
    def rollout_logprobs(self, batch: RolloutBatch, *, old: bool, ref: bool) -> tuple[Tensor | None, Tensor | None]:
        """π_old's log-probs (``old``: a forward pass of the policy as it is now, i.e. as it sampled) and π_ref's
        (``ref``, when there is a reference model), at the temperature the rollout was sampled with."""
        args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        kwargs = {
            "temperature": batch.temperature,
            "micro_batch_size": self.hparams.logprob_batch_size,
            "chunk_size": self.hparams.logprob_chunk_size,
            "lean": self.hparams.lean_forward,
            "pack_tokens": batch.pack_tokens,
            "vision": batch.vision or None,  # each row's inputs beyond its ids (a vision-language model's images)
            "modality": self.modality,
        }
        old_logprobs = ref_logprobs = None
        if old:
            was_training = self.policy.training
            self.policy.eval()
            old_logprobs = completion_logprobs(self.policy, *args, **kwargs)[0]
            self.policy.train(was_training)
        if ref:
            with self.reference_model() as reference:  # with LoRA: the policy, adapter disabled
                if reference is not None:
                    ref_logprobs = completion_logprobs(reference, *args, **kwargs)[0]
        return old_logprobs, ref_logprobs

    # ------------------------------------------------------------------------- β and π_ref during a run
    def set_beta(self, beta: float) -> None:
        """Change the KL weight from the next micro-batch on (the adaptive KL controller's hook)."""
        if beta < 0:
            raise ValueError(f"β must be >= 0 (got {beta})")
        self.beta = float(beta)

    @torch.no_grad()
    def update_reference(self, alpha: float) -> None:
        """π_ref ← α·π_θ + (1 − α)·π_ref (TR-DPO); π_ref is then kept in checkpoints."""
        if self.ref is None:
            raise ConfigError("a reference update needs a reference model: set model.objective.beta > 0 (no LoRA)")
        for ref_param, param in zip(self.ref.parameters(), self.policy.parameters()):
            ref_param.lerp_(param.detach().to(ref_param.dtype), alpha)
        self.reference_moved = True

    # ------------------------------------------------------------------------------------------ update
    def receive_round(self, plan: UpdatePlan, metrics: dict[str, float]) -> None:
        """The round the data side has just prepared (``PolicySide.receive_round``): the plan its micro-batches
        follow, and what its rollout measured, logged with the first of them trained (``training_step``)."""
        self.plan, self._round_metrics = plan, metrics

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """Micro-batch ``batch_idx`` of the round's plan (``update_plan.py``): in pass ``place.iteration`` of μ,
        mini-batch ``place.mini_batch`` (one optimizer step), micro-batch ``place.micro_batch`` of its
        accumulation. Its gradients add to its mini-batch's; after the mini-batch's last (``place.ends_step``)
        Lightning steps the optimizer (``accumulate_grad_batches`` is the plan's ``micro_batches_per_step``,
        checked before training), through ``on_before_optimizer_step``."""
        if self.plan is None:
            raise RuntimeError("GRPOModule trains on a RolloutDataModule's rounds: no round was received")
        self.place = self.plan.place(batch_idx)
        objective, control, mask = self.objective, self.entropy_control, batch["loss_mask"]
        with_entropy = self.hparams.log_entropy or control.needs_entropy
        logprobs, entropy = completion_logprobs(
            self.policy,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            temperature=batch["temperature"],
            with_entropy=with_entropy,
            chunk_size=self.hparams.logprob_chunk_size,
            lean=self.hparams.lean_forward,
            # Precomputed at rollout time (RolloutBatch.tensors): the lean forward then makes no device sync.
            positions=batch["layout"].positions,
            groups=batch["layout"].groups,
            pack_tokens=batch.get("pack_tokens"),
            vision=batch.get("vision"),
            modality=self.modality,
        )
        loss, metrics = grpo_loss(
            logprobs,
            batch.get("old_logprobs"),
            batch.get("ref_logprobs"),
            batch["advantages"],
            mask,
            max_completion_length=batch["max_completion_length"],
            num_items=batch["num_items"],
            num_rows=batch.get("num_rows"),
            beta=self.beta if self.has_reference else 0.0,
            **control.loss_settings(entropy, mask, self.all_gather if self.trainer.world_size > 1 else None),
            engine_logprobs=batch.get("engine_logprobs"),
            **{name: getattr(objective, name) for name in _LOSS_OPTIONS},
        )
        control.accumulate(entropy, mask, metrics.get("top_entropy_threshold"))  # the adaptive c's measurement
        # Checked with the gradients before the optimizer step (one device sync per step, none per micro-batch);
        # if the loss was not finite, these name the culprit.
        terms = {"policy log-probs": logprobs.detach(), "entropy": None if entropy is None else entropy.detach()}
        self.nonfinite.check_later(
            loss,
            lambda: (
                nonfinite_inputs(batch),
                nonfinite_terms(terms, mask),
                nonfinite_terms(metrics),
                ["loss"],
            ),
        )
        aggregation = objective.aggregation_in_use
        if aggregation in STEP_NORMALISED and (aggregation == "token_mean" or batch.get("num_rows") is not None):
            # The loss is divided by the whole mini-batch's rows or tokens on every rank (num_rows, num_items):
            # undo the averaging that gradient accumulation (over the plan's micro-batches per step) and DDP apply
            # on top, so that the step sees sum(losses) / (its rows or tokens) however its rows were grouped.
            # Logged the same way: each micro-batch's estimate of the step's loss.
            scale = self.plan.micro_batches_per_step * self.trainer.world_size
            loss, metrics["pg_loss"] = loss * scale, metrics["pg_loss"] * scale
        self.log("train/loss", loss.detach(), prog_bar=False)
        self.log_dict({f"train/{name}": value for name, value in metrics.items()})
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        if self._round_metrics is not None:  # the round's first micro-batch trained: what its rollout measured
            self._log_rollout_metrics(self._round_metrics)
            self._round_metrics = None
        return loss

    def _log_rollout_metrics(self, rollout_metrics: dict[str, float]) -> None:
        """The round's rollout summaries (``rollout/``, ``reward/``, ``time/``), once per round, over all ranks."""
        # Under data parallelism each rank has its own rollout: one collective brings every rank's metrics, and
        # every rank merges them alike (NaN-aware means, maxima maximised): the same keys, order and values on
        # all ranks, whatever keys or NaNs each rank's round had. A key logged by some ranks only would give the
        # ranks different collectives to run (a hang, or one metric reduced with another).
        metrics = merge_rank_metrics(gather_per_rank(attached_trainer(self), rollout_metrics))
        # One value per round, logged at the epoch level: written at every round's end, whatever
        # trainer.log_every_n_steps is (step-level values would be dropped between its multiples). Reduced
        # already, so Lightning must not reduce again: ``rank_zero_only`` turns its reduction off, and
        # ``sync_dist=True`` tells it the value is synchronised (with False it warns, for each key, that an
        # epoch-level value is not). Every rank logs: callbacks monitoring these keys see them everywhere.
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1, sync_dist=True, rank_zero_only=True)
        # The progress bar's postfix only: the logs hold these under their namespaced names already.
        bar = {"reward": metrics["rollout/reward_mean"]} if "rollout/reward_mean" in metrics else {}
        if "time/generated_tokens_per_s" in metrics:
            bar["gen_tok/s"] = float(round(metrics["time/generated_tokens_per_s"]))  # a short postfix
        self.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the parameters that train (the adapters only, with LoRA), with linear warm-up
        (``optimizer.py``: fused where Lightning can clip)."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        hp = self.hparams
        return adamw_with_warmup(
            params, attached_trainer(self), lr=hp.lr, weight_decay=hp.weight_decay, warmup_steps=hp.warmup_steps
        )

    def on_train_epoch_start(self) -> None:
        # A fit stopped inside an accumulation window leaves that window's queued losses: not this round's.
        self.nonfinite.clear_pending()
        self.entropy_control.clear_window()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A mini-batch's gradients are complete: the non-finite guard (a step with a NaN/Inf leaves the weights as
        they are); the entropy coefficient's step."""
        if self.place is not None and not self.place.ends_step:  # the Trainer's accumulation is checked to agree
            raise RuntimeError(f"the optimizer stepped inside a mini-batch of the round's plan ({self.place})")
        self.nonfinite.before_step(self, optimizer)
        self.entropy_control.step(self.trainer.strategy.reduce, skipped=self.nonfinite.last_skipped, log=self.log)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step the schedule, except after a step that the non-finite guard skipped."""
        if not self.nonfinite.last_skipped:
            super().lr_scheduler_step(scheduler, metric)

    # -------------------------------------------------------------------------------------- evaluation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """``batch``: held-out completions generated and scored by the DataModule (``HeldOutSampler``)."""
        self.evaluator.update_and_log(self, batch, "val", "evaluator")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluator.update_and_log(self, batch, "test", "evaluator")

    # ------------------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Adds the non-finite guard's counts and the entropy coefficient; leaves out π_ref unless it moved."""
        checkpoint["nonfinite_guard"] = self.nonfinite.state_dict()
        checkpoint["reference_moved"] = self.reference_moved
        checkpoint["entropy_coef"] = self.entropy_control.state_dict()
        # The reference is the starting model, re-created on load, unless it moved: checkpoints then stay the
        # size of one model.
        if not self.reference_moved:
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("ref.")}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuses another model's checkpoint; restores π_ref (saved or the starting one), the guard, entropy c."""
        trainer = attached_trainer(self)
        source = repr(str(getattr(trainer, "ckpt_path", None) or "")) if trainer is not None else "''"
        check_checkpoint_fits(
            checkpoint,
            hparams=self.hparams,
            expected_state=self.state_dict(),
            has_reference=self.ref is not None,
            source=source,
        )
        if self.ref is not None and "state_dict" in checkpoint:
            state = checkpoint["state_dict"]
            for key, value in self.ref.state_dict().items():
                state.setdefault(f"ref.{key}", value)
        self.reference_moved = bool(checkpoint.get("reference_moved", False))
        self.nonfinite.load_state_dict(checkpoint.get("nonfinite_guard", {}))
        self.entropy_control.load_state_dict(checkpoint.get("entropy_coef", {}))
