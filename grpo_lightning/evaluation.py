"""Held-out evaluation: greedy pass@1, and pass@k / maj@k over k sampled completions per prompt.

``HeldOutEvaluator`` owns the torchmetrics metrics (their states reduce across ranks) and logs through the
``LightningModule`` it evaluates, so ``validation_step`` and ``test_step`` stay one line each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchmetrics import MeanMetric

from grpo_lightning.metrics import MajorityAtK, PassAtK, check_eval_settings, resolve_answer_fn, sample_and_score

if TYPE_CHECKING:
    from grpo_lightning.module import GRPOModule


class HeldOutEvaluator(torch.nn.Module):
    """Accuracy, reward and length of greedy completions; with ``num_samples`` = k > 0, pass@k and maj@k too."""

    def __init__(self, num_samples: int, temperature: float, pass_k: list[int] | None, answer_fn: str | None) -> None:
        super().__init__()
        # Checked now, so a bad setting fails before any model loads.
        self.num_samples, self.temperature = num_samples, temperature
        self.ks = check_eval_settings(num_samples, pass_k, temperature)
        self.answer_fn = resolve_answer_fn(answer_fn)
        self.accuracy, self.reward, self.length = MeanMetric(), MeanMetric(), MeanMetric()
        self.sample_reward, self.sample_length = MeanMetric(), MeanMetric()
        self.pass_at = torch.nn.ModuleDict({str(k): PassAtK(k) for k in self.ks})
        self.majority = MajorityAtK()

    def evaluate(self, module: GRPOModule, batch: dict[str, list[Any]], stage: str, batch_idx: int) -> None:
        """Score ``batch``'s held-out prompts and log ``{stage}/...`` metrics through ``module``."""
        completions = module.generate(batch["prompt"], greedy=True)
        texts = module.decode(completions.completion_ids, completions.completion_mask)
        lengths = completions.completion_mask.sum(-1)
        columns = {name: values for name, values in batch.items() if name != "prompt"}
        columns["completion_lengths"] = lengths.tolist()
        total, per_function = module.score(batch["prompt"], texts, columns)
        log = {"on_step": False, "on_epoch": True, "batch_size": len(texts)}
        if module.accuracy_reward is not None:  # None: only process rewards, nothing decides "correct"
            correct = [float(v is not None and v >= 1.0) for v in per_function[module.accuracy_reward]]
            self.accuracy.update(torch.tensor(correct, device=module.device))
            module.log(f"{stage}/accuracy", self.accuracy, prog_bar=True, **log)
        self.reward.update(torch.tensor(total, device=module.device))
        self.length.update(lengths.float())
        module.log(f"{stage}/reward_mean", self.reward, **log)
        module.log(f"{stage}/completion_length_mean", self.length, **log)
        k = self.num_samples
        if k == 0:
            return
        # A stream of its own per rank and batch: reproducible, and the rollout's generator is left untouched.
        seed = module.hparams.seed + 1_000_003 * (module.global_rank + 1) + batch_idx
        samples = sample_and_score(module, batch, k, self.temperature, seed)
        self.sample_reward.update(torch.tensor(samples.total_rewards, device=module.device))
        self.sample_length.update(samples.lengths.float())
        module.log(f"{stage}/sample_reward_mean", self.sample_reward, **log)
        module.log(f"{stage}/sample_completion_length_mean", self.sample_length, **log)
        if samples.correct is None:
            return
        per_prompt = range(0, len(samples.texts), k)
        self.majority.update(
            [[self.answer_fn(t) for t in samples.texts[i : i + k]] for i in per_prompt],
            [samples.correct[i : i + k] for i in per_prompt],
        )
        module.log(f"{stage}/maj@{k}", self.majority, **log)
        num_correct = torch.tensor(samples.correct).view(-1, k).sum(-1)
        for name, metric in self.pass_at.items():
            metric.update(num_correct, k)
            module.log(f"{stage}/pass@{name}", metric, **log)
