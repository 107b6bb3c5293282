"""``RolloutBatch``: one round's completions with everything the loss needs, and its split into micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """The tensors of one rollout round (N = prompts × G rows) and the texts behind them."""

    prompt_ids: Tensor  # [N, P]
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T]
    completion_mask: Tensor  # [N, T] tokens that count in the loss
    advantages: Tensor  # [N] (or [N, T] for process rewards)
    rewards: Tensor  # [N]
    old_logprobs: Tensor | None = None  # [N, T], only when μ > 1
    ref_logprobs: Tensor | None = None  # [N, T], only when β > 0
    prompts: list[str] = field(default_factory=list)  # [N] texts, for logging
    completions: list[str] = field(default_factory=list)
    reward_columns: dict[str, list[float | None]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.completion_ids.size(0)

    def tensors(self, rows: Tensor) -> dict[str, Tensor]:
        """The loss inputs of ``rows``, trimmed to their longest completion."""
        mask = self.completion_mask[rows]
        keep = int(mask.sum(0).nonzero().max()) + 1 if bool(mask.any()) else 1
        batch = {
            "prompt_ids": self.prompt_ids[rows],
            "prompt_mask": self.prompt_mask[rows],
            "completion_ids": self.completion_ids[rows, :keep],
            "completion_mask": mask[:, :keep],
            "advantages": self.advantages[rows] if self.advantages.dim() == 1 else self.advantages[rows, :keep],
        }
        if self.old_logprobs is not None:
            batch["old_logprobs"] = self.old_logprobs[rows, :keep]
        if self.ref_logprobs is not None:
            batch["ref_logprobs"] = self.ref_logprobs[rows, :keep]
        return batch

    def micro_batches(
        self,
        *,
        micro_batch_size: int,
        mini_batch_size: int,
        num_iterations: int,
        generator: torch.Generator,
        sum_across_ranks: Callable[[Tensor], Tensor] | None = None,
    ) -> list[dict[str, Tensor]]:
        """μ shuffled passes over the rollout, cut into mini-batches (one optimizer step each) of micro-batches.

        Each micro-batch carries ``num_items``: the completion tokens of its whole mini-batch, summed over
        ranks by ``sum_across_ranks`` under data parallelism, so a token-level loss (``dapo``) is the same
        whatever the micro-batch size or the number of ranks.
        """
        n = len(self)
        minis = [
            order[start : start + mini_batch_size]
            for order in (torch.randperm(n, generator=generator) for _ in range(num_iterations))
            for start in range(0, n, mini_batch_size)
        ]
        tokens = torch.stack([self.completion_mask[mini].sum() for mini in minis]).float()
        if sum_across_ranks is not None:
            tokens = sum_across_ranks(tokens)
        out = []
        for mini, num_items in zip(minis, tokens.cpu()):
            for start in range(0, len(mini), micro_batch_size):
                batch = self.tensors(mini[start : start + micro_batch_size])
                batch["num_items"] = num_items
                out.append(batch)
        return out
