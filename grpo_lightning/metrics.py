"""Metrics: pass@k (unbiased estimator) and maj@k (majority vote), as estimators and torchmetrics; a round's
rollout metrics merged over ranks (``merge_rank_metrics``).

Every metric here is a ``torchmetrics.Metric`` whose states are sums (``dist_reduce_fx="sum"``): under data
parallelism each rank scores its own shard of the held-out prompts and the totals are added before dividing, so the
result equals the single-process one whatever the shard sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from grpo_lightning.config import ConfigError
from grpo_lightning.plugins import load_plugin

AnswerFn = Callable[[str], "str | None"]


# ------------------------------------------------------------------------------------------------ estimators
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021): 1 − C(n−c, k)/C(n, k).

    Computed as 1 − ∏_{i=n−c+1}^{n} (1 − k/i), which never forms the (huge) binomial coefficients.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n (got n={n}, c={c})")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n (got n={n}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def default_answer(completion: str) -> str:
    """The answer a completion votes for when no extraction function is set: its text without surrounding spaces."""
    return completion.strip()


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Index of the sample that represents the most frequent answer, or ``None`` when every answer is ``None``.

    ``None`` answers (nothing could be extracted) abstain. Ties between equally frequent answers go to the answer
    that was sampled first; the representative is that answer's first sample.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, index)
    if not counts:
        return None
    top = max(counts.values())
    return min(first[answer] for answer, count in counts.items() if count == top)


def resolve_answer_fn(spec: str | None) -> AnswerFn:
    """The answer-extraction function named by an import path (``pkg.module.fn``); ``None`` = stripped text."""
    if spec is None:
        return default_answer
    module_name, _, attr = spec.rpartition(".")
    try:
        fn = load_plugin(f"{module_name}:{attr}") if module_name else None
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"data.eval.answer_fn {spec!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"data.eval.answer_fn {spec!r} is not an importable function (use pkg.module.fn)")
    return fn


# ----------------------------------------------------------------------------------------------- metrics
class PassAtK(Metric):
    """Mean unbiased pass@k over prompts, each with ``n`` samples of which ``c`` are correct."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, k: int, **kwargs: Any) -> None:
        """
        Args:
            k: the k of pass@k; every prompt must have at least k samples.
            kwargs: ``torchmetrics.Metric`` options (``dist_sync_fn``, ...).
        """
        super().__init__(**kwargs)
        self.k = k
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, num_correct: Tensor | Sequence[int], num_samples: int) -> None:
        """Add prompts with ``num_correct[i]`` correct out of ``num_samples`` samples each."""
        num_correct = torch.as_tensor(num_correct, dtype=torch.long).flatten()
        # One value per possible c (0..n), then a lookup: exact per prompt and cheap for large batches.
        table = torch.tensor([pass_at_k(num_samples, c, self.k) for c in range(num_samples + 1)])
        self.total += table[num_correct.cpu()].sum().to(self.total)
        self.count += num_correct.numel()

    def compute(self) -> Tensor:
        """The mean pass@k (NaN before any update)."""
        return self.total / self.count if self.count > 0 else torch.tensor(float("nan"), device=self.total.device)


class MajorityAtK(Metric):
    """maj@k: the share of prompts whose majority-vote answer (see ``majority_vote``) is correct."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs: Any) -> None:
        """
        Args:
            kwargs: ``torchmetrics.Metric`` options (``dist_sync_fn``, ...).
        """
        super().__init__(**kwargs)
        self.add_state("hits", torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]]) -> None:
        """Add prompts: ``answers[i][j]`` and ``correct[i][j]`` describe sample j of prompt i.

        A prompt counts as solved when the sample representing the winning answer is correct; a prompt without
        any answer counts as unsolved.
        """
        hits = 0
        for prompt_answers, prompt_correct in zip(answers, correct, strict=True):
            winner = majority_vote(prompt_answers)
            hits += int(winner is not None and bool(prompt_correct[winner]))
        self.hits += hits
        self.count += len(answers)

    def compute(self) -> Tensor:
        """The maj@k accuracy (NaN before any update)."""
        if self.count == 0:
            return torch.tensor(float("nan"), device=self.hits.device)
        return self.hits.float() / self.count


def merge_rank_metrics(ranks: list[dict[str, float]]) -> dict[str, float]:
    """One set of round metrics from every rank's (in rank order; the same result on every rank).

    A ``*_max`` metric is the maximum over ranks, any other the mean over ranks: every rank's rollout has the same
    size, so a mean over completions (rewards, lengths, turn counts) is then the mean over all of them; a spread, or
    a mean over applicable values only, is the ranks' average. NaN marks a metric with no value on a rank
    (``reward/<name>`` when no completion had an applicable value): that rank is left out of the mean, and the
    metric is left out when no rank has a value. Keys: every rank's, in order of first appearance.
    """
    merged = {}
    for key in dict.fromkeys(k for rank in ranks for k in rank):
        values = [rank[key] for rank in ranks if key in rank and rank[key] == rank[key]]  # NaN != NaN
        if values:
            merged[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    return merged
