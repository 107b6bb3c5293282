"""``Scorer``: the configured reward functions, ready to score a batch of completions.

Outcome rewards give one number per completion (their weighted total is the completion's reward); process
rewards give one number per step. Both kinds get the same failure handling: a function that raises, returns
something unusable or runs past ``timeout_s`` stops the run with its name, or scores 0 with ``on_error: zero``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from grpo_lightning.config import ConfigError
from grpo_lightning.rewards.combine import (
    RewardSpec,
    check_required_columns,
    is_process_reward,
    score,
    score_steps,
    step_separator,
)


@dataclass
class Scores:
    """What a ``Scorer`` gave a batch of N completions."""

    total: list[float]  # [N] weighted total of the outcome rewards
    per_function: dict[str, list[float | None]]  # each outcome reward's values (None: not applicable)
    steps: list[list[float]] | None = None  # [N][steps] weighted process rewards; None without process rewards
    correct: list[bool] | None = None  # the accuracy reward >= 1; None when no outcome reward decides it


class Scorer:
    """Scores completions with every reward of ``data.rewards``; resolved (imported, checked) when built."""

    def __init__(
        self,
        specs: Sequence[RewardSpec] | None = None,
        *,
        accuracy_reward: str | None = None,
        on_error: Literal["raise", "zero"] = "raise",
        timeout_s: float | None = None,
        setting: str = "data.rewards",
    ) -> None:
        """
        Args:
            specs: the reward terms; default ``exact_answer``.
            accuracy_reward: the outcome reward whose value >= 1 counts as correct (default: the first).
            on_error: ``raise`` stops the run when a reward function fails; ``zero`` scores 0 instead.
            timeout_s: time limit per reward-function call on a batch.
            setting: the config key ``specs`` came from, for error messages.
        """
        self.specs = list(specs) if specs else [RewardSpec("exact_answer")]
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"{setting} lists a reward twice: {names}")
        fns = [spec.build() for spec in self.specs]  # an unknown name or a failing import is reported now
        self.outcome = [(s, f) for s, f in zip(self.specs, fns) if not is_process_reward(f)]
        self.process = [(s, f) for s, f in zip(self.specs, fns) if is_process_reward(f)]
        separators = {step_separator(f) for _, f in self.process}
        if len(separators) > 1:
            raise ConfigError(f"{setting}: all process rewards must split steps with the same step_separator")
        self.step_separator = separators.pop() if separators else None
        outcome_names = [spec.name for spec, _ in self.outcome]
        self.accuracy_reward = accuracy_reward or (outcome_names[0] if outcome_names else None)
        if self.accuracy_reward is not None and self.accuracy_reward not in outcome_names:
            raise ConfigError(
                f"{setting.rpartition('.')[0] or 'data'}.accuracy_reward {accuracy_reward!r} is not an outcome "
                f"reward of {setting}: {outcome_names}"
            )
        self.on_error, self.timeout_s = on_error, timeout_s

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def check_columns(self, columns: Sequence[str], where: str) -> None:
        """Refuse data that lacks a column a reward function needs (one line naming both)."""
        check_required_columns(self.specs, columns, where)

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> Scores:
        """Score ``completions`` (one prompt and one value of each column per completion)."""
        options = {"on_error": self.on_error, "timeout_s": self.timeout_s}
        total, per_function = score(
            [s for s, _ in self.outcome], [f for _, f in self.outcome], prompts, completions, columns, **options
        )
        steps = None
        if self.process:
            steps = score_steps(
                [s for s, _ in self.process], [f for _, f in self.process], prompts, completions, columns, **options
            )
        correct = None
        if self.accuracy_reward is not None:
            correct = [v is not None and v >= 1.0 for v in per_function[self.accuracy_reward]]
        return Scores(total=total, per_function=per_function, steps=steps, correct=correct)
