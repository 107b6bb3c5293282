"""``PromptStream``: the resumable order in which a rank draws its training prompts.

The stream walks the dataset in a fresh seeded shuffle per pass over it, so the prompt at a position is a pure
function of (seed, position). Under data parallelism each window of ``prompts_per_round × world`` positions is
split by rank (rank r takes the r-th slot), so ranks never draw the same prompt. Each rank keeps its own
position: with dynamic sampling a rank that refills more often advances further, and a checkpoint stores every
rank's position.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from datasets import Dataset

from grpo_lightning.config import ConfigError
from grpo_lightning.rollout.curriculum import CurriculumSampler
from grpo_lightning.rollout.prompts import collate_rows

log = logging.getLogger(__name__)


class PromptStream:
    """Draws ``prompts_per_round`` rows per call for one rank (or lets a curriculum pick them)."""

    def __init__(self, prompts_per_round: int, seed: int, curriculum: CurriculumSampler | None = None) -> None:
        self.prompts_per_round, self.seed, self.curriculum = prompts_per_round, seed, curriculum
        self.position = 0  # prompts consumed so far, over all ranks (from this rank's point of view)
        self._order: tuple[int, torch.Tensor] | None = None  # (pass over the dataset, its shuffled order)

    def next_rows(self, data: Dataset, rank: int = 0, world_size: int = 1) -> dict[str, list[Any]]:
        """This rank's next ``prompts_per_round`` rows; the position advances for all ranks at once."""
        start = self.position + rank * self.prompts_per_round
        if self.curriculum is not None:  # the curriculum picks the prompts; the position still counts them
            indices = self.curriculum.draw(len(data), self.prompts_per_round, rank=rank, world_size=world_size)
        else:
            indices = [self._index(start + i, len(data)) for i in range(self.prompts_per_round)]
        self.position += self.prompts_per_round * world_size
        return collate_rows([data[i] for i in indices])

    def _index(self, position: int, size: int) -> int:
        epoch = position // size
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(size, generator=generator))
        return int(self._order[1][position % size])

    def restore(self, positions: list[int], rank: int, world_size: int) -> None:
        """Continue at this rank's saved position (``positions``: one per rank of the run that saved them)."""
        if not positions or not all(isinstance(p, int) and p >= 0 for p in positions):
            raise ConfigError(f"the checkpoint's prompt stream position is {positions!r}, not a count of prompts")
        if len(positions) == world_size:
            self.position = positions[rank]
            return
        # Another number of processes: continue after the furthest rank, so no prompt is drawn twice.
        self.position = max(positions)
        if len(positions) > 1 or world_size > 1:
            log.warning(
                "the checkpoint's prompt stream was drawn by %d processes, this run has %d: continuing at %d",
                len(positions),
                world_size,
                self.position,
            )
