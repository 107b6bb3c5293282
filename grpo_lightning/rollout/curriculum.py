"""A pass-rate curriculum for the rollout's prompt stream (``data.curriculum``).

Each training prompt's recent pass rate (the share of its G completions that solved it, smoothed over the rounds
it was drawn in) is tracked. Prompts are drawn with probability proportional to a weight set by that rate:
``preferred_weight`` inside the band ``[min_pass_rate, max_pass_rate]`` (sometimes solved, sometimes not: the
groups GRPO learns from), ``other_weight`` outside it (lately always or never solved: zero-advantage groups),
``unseen_weight`` for prompts never drawn. A round's prompts are distinct.

The sampler's state (rates and round counter) is the same on every rank: each round's observations are gathered
from all ranks before the update, and the draw of round r uses a generator seeded by ``(seed, r)``, shared by all
ranks, each taking its own slice of one draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grpo_lightning.config import ConfigError

if TYPE_CHECKING:
    from grpo_lightning.rollout.batch import RolloutBatch

UNSEEN, PREFERRED, TOO_HARD, TOO_EASY = 0, 1, 2, 3
_CATEGORY_NAMES = {UNSEEN: "unseen", PREFERRED: "preferred", TOO_HARD: "too_hard", TOO_EASY: "too_easy"}


@dataclass
class CurriculumConfig:
    """How prompts are preferred by their recent pass rate (``data.curriculum``)."""

    min_pass_rate: float = 0.05
    """Lower bound (inclusive) of the preferred band; below it a prompt counts as never solved."""
    max_pass_rate: float = 0.95
    """Upper bound (inclusive) of the preferred band; above it a prompt counts as always solved."""
    preferred_weight: float = 1.0
    """Draw weight of a prompt whose recent pass rate is inside the band."""
    other_weight: float = 0.1
    """Draw weight of a prompt whose recent pass rate is outside the band."""
    unseen_weight: float = 1.0
    """Draw weight of a prompt not drawn yet (no pass rate)."""
    history: float = 0.5
    """Smoothing: ``rate ← history × rate + (1 − history) × observed``; 0 keeps the last round only."""
    success_threshold: float = 1.0
    """A completion solves its prompt when the accuracy reward (``data.accuracy_reward``; else the total
    reward) is at least this."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_pass_rate <= self.max_pass_rate <= 1:
            raise ConfigError(
                "data.curriculum needs 0 <= min_pass_rate <= max_pass_rate <= 1 "
                f"(got {self.min_pass_rate}, {self.max_pass_rate})"
            )
        for name in ("preferred_weight", "other_weight", "unseen_weight"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"data.curriculum.{name} must be > 0 (got {getattr(self, name)})")
        if not 0 <= self.history < 1:
            raise ConfigError(f"data.curriculum.history must be in [0, 1) (got {self.history})")


class CurriculumSampler:
    """Draws each round's prompt indices by recent pass rate, and updates the rates from the round's rewards."""

    def __init__(self, config: CurriculumConfig, seed: int = 0) -> None:
        """
        Args:
            config: the band, weights and smoothing.
            seed: seed of the draws (combined with the round number).
        """
        self.config, self.seed = config, seed
        self.pass_rates: Tensor | None = None  # [dataset size] float; NaN = never observed
        self.rounds = 0  # rounds observed so far: with the seed, it fixes the next draws
        self._draws_this_round = 0
        self._pending: list[int] = []  # this rank's indices drawn since the last observation
        self._drawn = torch.zeros(len(_CATEGORY_NAMES))  # this round's drawn prompts per category

    # ------------------------------------------------------------------------------------------ rule
    def categories(self) -> Tensor:
        """Per prompt: ``UNSEEN``, ``PREFERRED``, ``TOO_HARD`` (rate < min) or ``TOO_EASY`` (rate > max)."""
        rates, c = self.pass_rates, self.config
        category = torch.full(rates.shape, PREFERRED, dtype=torch.long)
        category[rates < c.min_pass_rate] = TOO_HARD
        category[rates > c.max_pass_rate] = TOO_EASY
        category[rates.isnan()] = UNSEEN
        return category

    def weights(self) -> Tensor:
        """Per prompt: its draw weight under the rule (the probabilities are these, normalised)."""
        c = self.config
        table = torch.tensor([c.unseen_weight, c.preferred_weight, c.other_weight, c.other_weight])
        return table[self.categories()]

    # ------------------------------------------------------------------------------------------ draws
    def draw(self, size: int, count: int, *, rank: int = 0, world_size: int = 1) -> list[int]:
        """``count`` distinct indices in ``[0, size)`` for this rank, drawn in proportion to ``weights()``.

        All ranks take their slice of one draw of ``count × world_size`` (distinct, while the dataset is large
        enough; with replacement otherwise).
        """
        if self.pass_rates is None or len(self.pass_rates) != size:
            self.pass_rates = torch.full((size,), float("nan"))
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.rounds) * 1_009 + self._draws_this_round
        )
        self._draws_this_round += 1
        total = count * world_size
        chosen = torch.multinomial(self.weights(), total, replacement=total > size, generator=generator)
        mine = chosen[rank * count : (rank + 1) * count]
        self._drawn += torch.bincount(self.categories()[mine], minlength=len(_CATEGORY_NAMES)).float()
        self._pending.extend(mine.tolist())
        return mine.tolist()

    # ----------------------------------------------------------------------------------- observations
    def observe(
        self,
        rollout: RolloutBatch,
        prompt_of: Callable[[int], str],
        group_size: int,
        accuracy_reward: str | None,
        all_gather: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """Update the pass rates from a finished rollout and add ``curriculum/`` metrics to ``rollout.metrics``.

        ``prompt_of(index)`` is the prompt text of a dataset index: a rollout's groups are matched to the
        indices drawn for them by their text (dynamic sampling drops and reorders groups). ``all_gather``
        (under data parallelism) collects every rank's groups, so every rank makes the same update.
        """
        indices, rates = self._match(rollout, prompt_of, group_size, accuracy_reward)
        if all_gather is not None:
            device = rollout.rewards.device
            indices = all_gather(indices.to(device)).flatten().cpu()
            rates = all_gather(rates.to(device)).flatten().cpu()
        self.update(indices, rates)
        rollout.metrics.update(self.metrics())
        self._pending, self._draws_this_round = [], 0
        self._drawn.zero_()
        self.rounds += 1

    def _match(
        self, rollout: RolloutBatch, prompt_of: Callable[[int], str], group_size: int, reward_name: str | None
    ) -> tuple[Tensor, Tensor]:
        """Dataset index (−1 when unknown) and pass rate of each group of the rollout: over its trajectories (an
        agent's session may make several rows), among those a reward scored (None, "not applicable", and an
        unscorable trajectory are out of the rate, as out of the advantages' baseline; NaN, no update, where none
        was scored)."""
        trajectories = rollout.per_trajectory()
        values = trajectories.reward_columns.get(reward_name) if reward_name is not None else None
        if values is None:
            unscorable = trajectories.unscorable
            out = unscorable.tolist() if unscorable is not None else [False] * len(trajectories.rewards)
            values = [None if left else value for value, left in zip(trajectories.rewards.tolist(), out)]
        threshold = self.config.success_threshold
        solved = torch.tensor([math.nan if v is None else float(v >= threshold) for v in values])
        rates = solved.view(-1, group_size).nanmean(-1)
        waiting: dict[str, list[int]] = {}
        for index in self._pending:
            waiting.setdefault(prompt_of(index), []).append(index)
        indices = []
        for text in trajectories.prompts[::group_size]:
            candidates = waiting.get(text)
            indices.append(candidates.pop(0) if candidates else -1)
        return torch.tensor(indices, dtype=torch.long), rates

    def update(self, indices: Tensor, rates: Tensor) -> None:
        """Blend observed pass ``rates`` into the prompts at ``indices`` (−1 or a NaN rate: skipped)."""
        history = self.config.history
        for index, rate in zip(indices.tolist(), rates.tolist()):
            if index < 0 or math.isnan(rate):  # unknown, or no completion of its group was scored
                continue
            old = float(self.pass_rates[index])
            self.pass_rates[index] = rate if math.isnan(old) else history * old + (1 - history) * rate

    def metrics(self) -> dict[str, float]:
        """This round's draw by category (fractions of this rank's drawn prompts) and the tracked rates."""
        drawn = self._drawn.sum().clamp(min=1)
        metrics = {f"curriculum/{name}_fraction": float(self._drawn[c] / drawn) for c, name in _CATEGORY_NAMES.items()}
        tracked = self.pass_rates[~self.pass_rates.isnan()]
        metrics["curriculum/tracked_prompts"] = float(len(tracked))
        in_band = (self.categories() == PREFERRED).sum().item()
        metrics["curriculum/tracked_in_band_fraction"] = in_band / len(tracked) if len(tracked) else float("nan")
        metrics["curriculum/mean_pass_rate"] = tracked.mean().item() if len(tracked) else float("nan")
        return metrics

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"pass_rates": self.pass_rates, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pass_rates = state["pass_rates"]
        self.rounds = int(state["rounds"])
