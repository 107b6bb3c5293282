"""What the data side (rollout and evaluation) needs from the LightningModule, and an engine bound to it.

The data side generates; the LightningModule owns the policy. The rollout collector and held-out evaluation read,
through ``trainer.lightning_module``, only what ``PolicySide`` lists: the policy and tokenizer to sample from,
the context a rollout runs in (precision, gathered shards) and the log-prob passes of π_old and π_ref; and it hands
the module each round's record by name (``receive_round``: the update's plan and the rollout's metrics). Everything
else a round needs (rewards, G, μ, advantages, the engine) is the data side's own setting.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from grpo_lightning.modality import Modality
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.update_plan import UpdatePlan


class PolicySide(Protocol):
    """The LightningModule's part in a rollout (``GRPOModule`` and ``SFTModule`` provide it)."""

    policy: nn.Module
    tokenizer: Any
    modality: Modality
    """What the policy's rows add to their token ids (``grpo_lightning/modality.py``): the prompt encoder, every
    pass and engine take the rows' inputs through it."""
    device: torch.device
    global_step: int
    has_reference: bool
    """Whether the loss has a KL term to a reference model (π_ref's log-probs are then computed)."""
    distillation_weight: float | None
    """This round's λ of on-policy distillation (``model.teacher``); None without a teacher, or once its weight
    schedule has reached 0."""

    def rollout_context(self) -> AbstractContextManager[None]:
        """What generation and rollout log-prob passes run in (the Trainer's precision, gathered weights)."""
        ...

    def rollout_logprobs(self, batch: RolloutBatch, *, old: bool, ref: bool) -> tuple[Tensor | None, Tensor | None]:
        """π_old's (``old``) and π_ref's (``ref``) log-probs of the rollout's completion tokens, no gradients."""
        ...

    def teacher_logprobs(self, batch: RolloutBatch) -> Tensor:
        """The teacher's log-probs ``[N, T]`` of the rollout's completion tokens (with ``distillation_weight``)."""
        ...

    def all_gather(self, data: Tensor) -> Tensor:
        """Every rank's ``data``, stacked (``LightningModule.all_gather``: moved to the module's device first)."""
        ...

    def teacher_context_length(self) -> int | None:
        """The longest sequence the teacher reads (``model.teacher``); None without one, or unknown."""
        ...

    def context_length(self) -> int | None:
        """The longest sequence (prompt + completion) the policy supports; None when unknown."""
        ...

    def check_teacher(self, temperature: float, rewards_teach: bool = True) -> None:
        """Refuse (``ConfigError``) a sampling temperature the teacher cannot score at, or a teacher whose weight
        schedule stops it where no reward teaches (``rewards_teach`` false); nothing without one."""
        ...

    def receive_round(self, plan: UpdatePlan, metrics: dict[str, float]) -> None:
        """The round the data side has just prepared: the plan its micro-batches follow (μ passes × mini-batches ×
        micro-batches, ``update_plan.py``) and what its rollout measured (``rollout/``, ``reward/``, ``time/``, ...),
        which the module logs once, with the round's first micro-batch trained. Called by ``RolloutCollector.collect``
        only (held-out evaluation, which ``SFTModule`` takes part in, never calls it)."""
        ...
