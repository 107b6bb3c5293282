"""``Scorer``: the configured reward functions, ready to score a batch of completions.

Outcome rewards give one number per completion (their weighted total is the completion's reward); process
rewards give one number per step. Both kinds get the same failure handling: a function that raises, returns
something unusable or runs past ``timeout_s`` stops the run with its name, or scores 0 with ``on_error: zero``.
Functions are called as TRL's ``GRPOTrainer`` calls them (``rewards/inputs.py``); ``async def`` ones run together.

Every other source of reward joins the same call as columns of its own (``parts``: an environment's reward parts,
an agent's return value), so that one rule (``combine.combine_columns``) makes every total and says which completion
no reward applies to, and each column keeps its weight (``Scores.weights``) for the advantage estimators.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_lightning.config import ConfigError
from grpo_lightning.rewards.combine import (
    RewardSpec,
    check_required_columns,
    column_weight,
    combine_columns,
    is_process_reward,
    score,
    score_steps,
    step_separator,
)
from grpo_lightning.rewards.inputs import RewardLog, TrainerState, prompt_text

log = logging.getLogger(__name__)


@dataclass
class Scores:
    """What a ``Scorer`` gave a batch of N completions."""

    total: list[float]  # [N] weighted total of every column
    # each column's values (None: not applicable): the outcome rewards', then the other sources' (``parts``)
    per_function: dict[str, list[float | None]]
    steps: list[list[float]] | None = None  # [N][steps] weighted process rewards; None without process rewards
    correct: list[bool] | None = None  # the accuracy reward >= 1; None when no outcome reward decides it
    # [N] no reward column gives it a value (total 0): its outcome advantage is 0, out of its group's baseline (a
    # process reward, which always scores, still gives its steps theirs)
    unscorable: list[bool] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)  # each weighed column's weight (``column_weight``)
    metrics: dict[str, float] = field(default_factory=dict)  # what the functions logged with ``log_metric``
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)  # ... and with ``log_extra``


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
            specs: the reward terms; None: ``exact_answer``; empty: none (a teacher or an environment's rewards
                teach alone: ``check_something_teaches``).
            accuracy_reward: the outcome reward whose value >= 1 counts as correct (default: the first).
            on_error: ``raise`` stops the run when a reward function fails; ``zero`` scores 0 instead.
            timeout_s: time limit per reward-function call on a batch.
            setting: the config key ``specs`` came from, for error messages.
        """
        self.specs = list(specs) if specs is not None else [RewardSpec("exact_answer")]
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"{setting} lists a reward twice: {names}")
        # An unknown name, a failing import or a kwargs key the function does not take is reported now.
        fns = [spec.build(f"{setting}[{i}]") for i, spec in enumerate(self.specs)]
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
        self.on_error, self.timeout_s, self.setting = on_error, timeout_s, setting
        self.trainer_state = TrainerState()  # ``trainer_state`` of every call; the rollout's driver updates it

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def check_columns(self, columns: Sequence[str], where: str) -> None:
        """Refuse data that lacks a column a reward function needs, or has a column named like a reward's kwargs
        key (the column, passed at every call, would silently replace the setting); one line naming both."""
        check_required_columns(self.specs, columns, where)
        for i, spec in enumerate(self.specs):
            for key in spec.kwargs:
                if key in columns:
                    raise ConfigError(
                        f"{self.setting}[{i}] ({spec.name}): kwargs key {key!r} is also a column of {where}, which "
                        "every call passes and which would replace the setting; rename one of them"
                    )

    def __call__(
        self,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        *,
        parts: Mapping[str, Sequence[float | None]] | None = None,
        part_weights: Mapping[str, float] | None = None,
        left_out: Sequence[bool] | None = None,
        warn_unscorable: bool = True,
    ) -> Scores:
        """Score ``completions`` (texts; one prompt and one value of each column per completion).

        ``prompts`` are texts or conversations (lists of messages). ``parts`` are the other sources' reward columns
        (an environment's ``env_<name>``, an agent's ``agent_<name>``; None where one gives a completion nothing),
        weighed by ``part_weights`` (1 where not named); they join the functions' columns under the same rule.
        ``left_out``: completions no reward may score (an agent session that failed): None in every column.
        ``warn_unscorable=False`` leaves out the warning for completions no reward applies to.
        """
        logged = RewardLog()
        context = {
            "trainer_state": self.trainer_state,
            "log_extra": logged.log_extra,
            "log_metric": logged.log_metric,
        }
        options = {"on_error": self.on_error, "timeout_s": self.timeout_s, "context": context}
        _, per_function = score(
            [s for s, _ in self.outcome], [f for _, f in self.outcome], prompts, completions, columns, **options
        )
        steps = None
        if self.process:
            steps = score_steps(
                [s for s, _ in self.process], [f for _, f in self.process], prompts, completions, columns, **options
            )
        weights = {spec.name: spec.weight for spec, _ in self.outcome}
        for name, values in (parts or {}).items():
            if name in per_function:
                raise ValueError(f"the reward part {name!r} has the name of a reward function of {self.setting}")
            per_function[name] = list(values)
            weights[name] = column_weight(part_weights or {}, name)
        if left_out is not None:
            per_function = {name: [None if out else v for v, out in zip(values, left_out, strict=True)]
                            for name, values in per_function.items()}  # fmt: skip
        total, unscorable = combine_columns(per_function, weights, len(completions))
        correct = None
        if self.accuracy_reward is not None:
            correct = [v is not None and v >= 1.0 for v in per_function[self.accuracy_reward]]
        # Worth a warning: a completion that some column could have scored (there is one), that was not left out and
        # that no process reward scores either.
        expected = [bool(out) for out in left_out] if left_out is not None else [False] * len(completions)
        scored_steps = steps is not None
        surprising = [u and not out and bool(per_function) and not scored_steps for u, out in zip(unscorable, expected)]
        if warn_unscorable and any(surprising):
            first = surprising.index(True)
            log.warning(
                "%d of %d completions have no applicable reward (every reward function of %s%s returned None), "
                "so they score 0 and get advantage 0, out of their group's baseline; the first: prompt %r, "
                "completion %r",
                sum(surprising),
                len(surprising),
                self.setting,
                " and every other reward part" if parts else "",
                prompt_text(prompts[first])[-80:],
                completions[first][:80],
            )
        return Scores(
            total=total,
            per_function=per_function,
            steps=steps,
            correct=correct,
            unscorable=unscorable,
            weights=weights,
            metrics=logged.metric_means(),
            extra_columns=logged.columns,
        )
