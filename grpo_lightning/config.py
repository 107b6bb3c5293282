"""Typed settings groups of ``GRPOModule``: each one a YAML section (``model.sampling``, ``model.objective``).

They validate themselves when built, so a bad value is refused while the config is parsed, before any model is
loaded, with a one-line message that names the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class ConfigError(ValueError):
    """A setting has a value that cannot work. The message names the setting and the fix."""


@dataclass
class SamplingConfig:
    """How completions are sampled from the policy at rollout time."""

    group_size: int = 8
    """G: completions sampled per prompt; advantages compare completions within a group."""
    max_new_tokens: int = 64
    """Completion length limit in tokens; longer completions are truncated (and flagged as such)."""
    min_new_tokens: int = 0
    """EOS is forbidden before this many tokens (benchmarks use min = max for fixed-length completions)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k filtering."""
    generation_batch_size: int = 256
    """Completions decoded at once; bounds generation memory independently of the optimisation batch."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(
                f"model.sampling.group_size must be at least 2 (got {self.group_size}): GRPO compares each "
                "completion with the others of its group"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"model.sampling.max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"model.sampling.min_new_tokens must be between 0 and max_new_tokens={self.max_new_tokens} "
                f"(got {self.min_new_tokens})"
            )
        if self.temperature <= 0:
            raise ConfigError(f"model.sampling.temperature must be > 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"model.sampling.top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ConfigError(f"model.sampling.top_k must be >= 0 (got {self.top_k}); 0 disables it")
        if self.generation_batch_size < 1:
            raise ConfigError(f"model.sampling.generation_batch_size must be >= 1 (got {self.generation_batch_size})")


@dataclass
class ObjectiveConfig:
    """The GRPO objective and its variants; the names match ``grpo_lightning.loss``'s keyword arguments."""

    beta: float = 0.04
    """KL weight against the reference model. 0 skips the reference model entirely (not even built)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    """Upper clip range (DAPO clip-higher); defaults to epsilon_low."""
    delta: float | None = None
    """Upper cap on the ratio before the min (two-sided clipping, INTELLECT-2)."""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "grpo"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    num_iterations: int = 1
    """μ: optimisation passes over each rollout. Each pass takes ``rollout / data.mini_batch_size`` optimizer
    steps; π_old's log-probs are recorded whenever a round has more than one step in all."""
    old_logprobs: Literal["auto", "sampler", "recompute"] = "auto"
    """Where π_old's log-probs come from when a round has several optimizer steps: ``sampler`` keeps those the
    sampling loop computed anyway (no extra forward pass); ``recompute`` runs a forward pass over the rollout.
    ``auto``: ``sampler`` when the policy computes in float32, where the two agree to ~1e-6, and ``recompute`` in
    lower precision, where a decoding step and a full-sequence pass round differently."""
    advantage_baseline: Literal["mean", "rloo"] = "mean"
    advantage_scale: Literal["group", "batch", "none"] = "group"
    advantage_eps: float = 1e-4
    advantage_std: Literal["population", "sample"] = "population"
    """The std that scales advantages: ``population`` (variance ÷ G) or ``sample`` (÷ G - 1, Bessel's
    correction, as TRL and verl compute it); at G = 4 the sample std is √(4/3) ≈ 1.155× the population one."""
    entropy_coef: float = 0.0
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_new_tokens from the loss (DAPO's overlong filtering)."""

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ConfigError(f"model.objective.beta must be >= 0 (got {self.beta})")
        if not 0 <= self.epsilon_low < 1:
            raise ConfigError(f"model.objective.epsilon_low must be in [0, 1) (got {self.epsilon_low})")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ConfigError(f"model.objective.epsilon_high must be >= 0 (got {self.epsilon_high})")
        if self.delta is not None and self.delta <= 1:
            raise ConfigError(f"model.objective.delta must be > 1 (got {self.delta}); it caps the ratio from above")
        if self.num_iterations < 1:
            raise ConfigError(f"model.objective.num_iterations must be >= 1 (got {self.num_iterations})")
        if self.old_logprobs not in ("auto", "sampler", "recompute"):
            raise ConfigError(
                f"model.objective.old_logprobs must be auto, sampler or recompute (got {self.old_logprobs!r})"
            )
        if self.advantage_std not in ("population", "sample"):
            raise ConfigError(
                f"model.objective.advantage_std must be population or sample (got {self.advantage_std!r})"
            )
        if self.advantage_eps <= 0:
            raise ConfigError(f"model.objective.advantage_eps must be > 0 (got {self.advantage_eps})")
