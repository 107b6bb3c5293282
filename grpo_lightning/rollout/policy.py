"""What the data side (rollout and evaluation) needs from the LightningModule, and the engine bound to it.

The DataModule generates; the LightningModule owns the policy. The DataModule reads, through
``trainer.lightning_module``, only what ``PolicySide`` lists: the policy and tokenizer to sample from, the
context a rollout runs in (precision, gathered shards) and the log-prob passes of π_old and π_ref. Everything
else a round needs (rewards, G, μ, advantages, the engine) is the DataModule's own setting.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from grpo_lightning.engines import RolloutEngine, build_engine
from grpo_lightning.rollout.batch import RolloutBatch


class PolicySide(Protocol):
    """The LightningModule's part in a rollout (``GRPOModule`` and ``SFTModule`` provide it)."""

    policy: nn.Module
    tokenizer: Any
    device: torch.device
    global_step: int

    def rollout_context(self) -> AbstractContextManager[None]:
        """What generation and rollout log-prob passes run in (the Trainer's precision, gathered weights)."""
        ...

    def rollout_logprobs(self, batch: RolloutBatch, *, old: bool, ref: bool) -> tuple[Tensor | None, Tensor | None]:
        """π_old's (``old``) and π_ref's (``ref``) log-probs of the rollout's completion tokens, no gradients."""
        ...

    def context_length(self) -> int | None:
        """The longest sequence (prompt + completion) the policy supports; None when unknown."""
        ...


class EngineHandle:
    """The rollout engine of ``data.engine``, set up on the module's policy at first use (and again if the
    module builds a new policy, e.g. a second ``fit`` in the same process)."""

    def __init__(self, spec: str | RolloutEngine) -> None:
        self.engine = build_engine(spec)  # an unknown name is refused now, before any model loads

    def get(self, module: PolicySide) -> RolloutEngine:
        """The engine, sampling from ``module.policy``."""
        if getattr(self.engine, "policy", None) is not module.policy:
            self.engine.setup(module.policy, module.tokenizer)
        return self.engine
