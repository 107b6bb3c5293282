"""Evaluation metrics: pass@k (unbiased estimator), maj@k (majority vote), and the sampling they need.

Every metric here is a ``torchmetrics.Metric`` whose states are sums (``dist_reduce_fx="sum"``): under data
parallelism each rank scores its own shard of the held-out prompts and the totals are added before dividing, so the
result equals the single-process one whatever the shard sizes.
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchmetrics import Metric

from grpo_lightning.config import ConfigError
from grpo_lightning.rollout.round import repeat_each

if TYPE_CHECKING:
    from grpo_lightning.module import GRPOModule

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
        fn = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model.eval_answer_fn {spec!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"model.eval_answer_fn {spec!r} is not an importable function (use pkg.module.fn)")
    return fn


def check_eval_settings(num_samples: int, pass_k: Sequence[int] | None, temperature: float) -> list[int]:
    """The k values of pass@k to report; refuses settings that cannot work, naming the setting."""
    if num_samples < 0:
        raise ConfigError(f"model.eval_num_samples must be >= 0 (got {num_samples}); 0 = greedy evaluation only")
    if temperature <= 0:
        raise ConfigError(f"model.eval_temperature must be > 0 (got {temperature})")
    if num_samples == 0:
        if pass_k:
            raise ConfigError("model.eval_pass_k needs model.eval_num_samples > 0 (samples per held-out prompt)")
        return []
    ks = sorted(set(pass_k)) if pass_k else sorted({1, num_samples})
    bad = [k for k in ks if not 1 <= k <= num_samples]
    if bad:
        raise ConfigError(f"model.eval_pass_k values must be in [1, eval_num_samples={num_samples}] (got {bad})")
    return ks


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


# ---------------------------------------------------------------------------------------------- sampling
@dataclass
class SampledEval:
    """k sampled completions per prompt, scored: flat lists of prompts × k, samples of a prompt adjacent."""

    texts: list[str]
    total_rewards: list[float]
    correct: list[bool] | None  # None when no outcome reward decides correctness (``accuracy_reward`` unset)
    lengths: Tensor  # [prompts × k] generated tokens


@contextmanager
def eval_sampling(module: GRPOModule, num_samples: int, temperature: float, seed: int) -> Iterator[None]:
    """Make ``module.generate`` draw ``num_samples`` completions per prompt at ``temperature``, from its own RNG.

    The rollout's sampling settings and generator are restored afterwards: evaluating (even in the middle of
    ``fit``) neither changes nor advances the training run's random stream, and is reproducible for a seed.
    """
    saved_sampling, saved_generator = module.sampling, module.generator
    # copy.copy skips __post_init__, whose group_size >= 2 rule is a training rule (k = 1 is a valid evaluation).
    sampling = copy.copy(saved_sampling)
    sampling.group_size, sampling.temperature, sampling.min_new_tokens = num_samples, temperature, 0
    module.sampling = sampling
    module.generator = torch.Generator(device=module.device).manual_seed(seed)
    try:
        yield
    finally:
        module.sampling, module.generator = saved_sampling, saved_generator


def sample_and_score(
    module: GRPOModule, batch: dict[str, list[Any]], num_samples: int, temperature: float, seed: int
) -> SampledEval:
    """Sample ``num_samples`` completions for each prompt of ``batch`` and score them with the module's rewards."""
    with eval_sampling(module, num_samples, temperature, seed):
        completions = module.generate(batch["prompt"])
    texts = module.decode(completions.completion_ids, completions.completion_mask)
    prompts = repeat_each(batch["prompt"], num_samples)
    columns = {name: repeat_each(values, num_samples) for name, values in batch.items() if name != "prompt"}
    lengths = completions.completion_mask.sum(-1)
    columns["completion_lengths"] = lengths.tolist()
    total, per_function = module.score(prompts, texts, columns)
    correct = None
    if module.accuracy_reward is not None:
        correct = [v is not None and v >= 1.0 for v in per_function[module.accuracy_reward]]
    return SampledEval(texts=texts, total_rewards=list(total), correct=correct, lengths=lengths)
