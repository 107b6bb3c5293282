"""Held-out evaluation, the module side: greedy pass@1, pass@k and maj@k as torchmetrics (``HeldOutMetrics``).

Split like training: the data side generates and scores (``rollout/held_out.py: HeldOutSampler``), the module side
keeps the metrics. ``HeldOutMetrics`` (an attribute of the LightningModule) holds torchmetrics metrics whose states
reduce across ranks, updated and logged by ``validation_step`` / ``test_step`` from those scores.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning import LightningModule
from torchmetrics import MeanMetric

from grpo_lightning.metrics import MajorityAtK, PassAtK


class HeldOutMetrics(torch.nn.Module):
    """Accuracy, reward and length of greedy completions; pass@k, maj@k and sample reward/length with samples."""

    def __init__(self) -> None:
        super().__init__()
        self.accuracy, self.reward, self.length = MeanMetric(), MeanMetric(), MeanMetric()
        self.sample_reward, self.sample_length = MeanMetric(), MeanMetric()
        self.majority = MajorityAtK()
        self.pass_at = torch.nn.ModuleDict()  # one PassAtK per k, made when a batch first asks for it

    def update_and_log(self, module: LightningModule, batch: dict[str, Any], stage: str, prefix: str) -> None:
        """Update from a ``HeldOutSampler`` batch and log ``{stage}/...`` through ``module``.

        ``prefix``: this object's attribute name in ``module`` (metrics are logged with their attribute path).
        """
        size = len(batch["reward"])
        log = {"on_step": False, "on_epoch": True, "batch_size": size}

        def put(name: str, metric: Any, attribute: str, **extra: Any) -> None:
            module.log(f"{stage}/{name}", metric, metric_attribute=f"{prefix}.{attribute}", **log, **extra)

        if "correct" in batch:
            self.accuracy.update(batch["correct"])
            put("accuracy", self.accuracy, "accuracy", prog_bar=True)
        self.reward.update(batch["reward"])
        self.length.update(batch["length"])
        put("reward_mean", self.reward, "reward")
        put("completion_length_mean", self.length, "length")
        if "sample_reward" not in batch:
            return
        self.sample_reward.update(batch["sample_reward"])
        self.sample_length.update(batch["sample_length"])
        put("sample_reward_mean", self.sample_reward, "sample_reward")
        put("sample_completion_length_mean", self.sample_length, "sample_length")
        if "sample_correct" not in batch:
            return
        correct = batch["sample_correct"]
        k = correct.size(1)
        self.majority.update(batch["sample_answers"], correct.tolist())
        put(f"maj@{k}", self.majority, "majority")
        for value in batch["pass_k"]:
            name = str(int(value))
            if name not in self.pass_at:
                self.pass_at[name] = PassAtK(int(value)).to(correct.device)
            self.pass_at[name].update(correct.sum(-1), k)
            put(f"pass@{name}", self.pass_at[name], f"pass_at.{name}")
