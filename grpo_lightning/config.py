"""Typed settings groups: each one a YAML section (``model.objective``, ``data.sampling``, ``data.advantage``, ...).

They validate themselves when built, so a bad value is refused while the config is parsed, before any model is
loaded, with a one-line message that names the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from grpo_lightning.engines.base import SamplingParams


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

    def params(self, **changes: Any) -> SamplingParams:
        """These settings as an engine's ``SamplingParams`` (with ``changes``: ``group_size``, ``greedy``, ...)."""
        from grpo_lightning.engines.base import SamplingParams  # engines/ imports this module's ConfigError

        values = {
            "group_size": self.group_size,
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "batch_size": self.generation_batch_size,
        }
        return SamplingParams(**{**values, **changes})

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(
                f"data.sampling.group_size must be at least 2 (got {self.group_size}): GRPO compares each "
                "completion with the others of its group"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"data.sampling.max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"data.sampling.min_new_tokens must be between 0 and max_new_tokens={self.max_new_tokens} "
                f"(got {self.min_new_tokens})"
            )
        if self.temperature <= 0:
            raise ConfigError(f"data.sampling.temperature must be > 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"data.sampling.top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ConfigError(f"data.sampling.top_k must be >= 0 (got {self.top_k}); 0 disables it")
        if self.generation_batch_size < 1:
            raise ConfigError(f"data.sampling.generation_batch_size must be >= 1 (got {self.generation_batch_size})")


@dataclass
class ObjectiveConfig:
    """The GRPO loss and its variants (``model.objective``); names match ``grpo_lightning.loss.grpo_loss``'s
    keyword arguments. The rollout side of the algorithm (advantages, μ, π_old's source) is ``data``'s."""

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
    entropy_coef: float = 0.0
    tis_cap: float | None = 2.0
    """C of the truncated importance-sampling correction, used when the engine that sampled is not the trainer
    (vLLM): each token's surrogate is weighted by min(π_old / π_engine, C); null = no correction (the mismatch is
    still logged)."""
    tis_level: Literal["token", "sequence"] = "token"
    """``token``: a weight per token; ``sequence``: min(∏_t π_old / π_engine, C) for every token of a completion."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """``truncate``: min(w, C); ``mask``: w where 1/C <= w <= C, else the token (or completion) leaves the
    surrogate. The same weight is the decoupled correction of ``data.rollout_lag`` (π_old = the proximal policy)."""

    def __post_init__(self) -> None:
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"model.objective.tis_cap must be > 0, or null for no correction (got {self.tis_cap})")
        if self.beta < 0:
            raise ConfigError(f"model.objective.beta must be >= 0 (got {self.beta})")
        if not 0 <= self.epsilon_low < 1:
            raise ConfigError(f"model.objective.epsilon_low must be in [0, 1) (got {self.epsilon_low})")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ConfigError(f"model.objective.epsilon_high must be >= 0 (got {self.epsilon_high})")
        if self.tis_mode not in ("truncate", "mask"):
            raise ConfigError(f"model.objective.tis_mode must be truncate or mask (got {self.tis_mode!r})")
        if self.tis_mode == "mask" and self.tis_cap is not None and self.tis_cap <= 1:
            raise ConfigError(f"model.objective.tis_cap must be > 1 with tis_mode: mask (got {self.tis_cap})")
        if self.delta is not None and self.delta <= 1:
            raise ConfigError(f"model.objective.delta must be > 1 (got {self.delta}); it caps the ratio from above")


@dataclass
class AdvantageConfig:
    """How a group's rewards become advantages (``data.advantage``): ``grpo_lightning.loss.group_advantages``."""

    baseline: Literal["mean", "rloo"] = "mean"
    """``mean`` of the group (GRPO), or ``rloo``: the mean of the other G - 1 completions."""
    scale: Literal["group", "batch", "none"] = "group"
    """Divide by the std of the ``group``, of the whole ``batch`` (all ranks), or ``none`` (Dr. GRPO)."""
    std: Literal["population", "sample"] = "population"
    """The std that scales advantages: ``population`` (variance ÷ G) or ``sample`` (÷ G - 1, Bessel's
    correction, as TRL and verl compute it); at G = 4 the sample std is √(4/3) ≈ 1.155× the population one."""
    eps: float = 1e-4
    """Added to the std."""

    def __post_init__(self) -> None:
        if self.baseline not in ("mean", "rloo"):
            raise ConfigError(f"data.advantage.baseline must be mean or rloo (got {self.baseline!r})")
        if self.scale not in ("group", "batch", "none"):
            raise ConfigError(f"data.advantage.scale must be group, batch or none (got {self.scale!r})")
        if self.std not in ("population", "sample"):
            raise ConfigError(f"data.advantage.std must be population or sample (got {self.std!r})")
        if self.eps <= 0:
            raise ConfigError(f"data.advantage.eps must be > 0 (got {self.eps})")


@dataclass
class EvalConfig:
    """Held-out evaluation (``data.eval``): greedy pass@1 always; with ``num_samples`` = k > 0 also k sampled
    completions per prompt for ``val/pass@k``, ``val/maj@k`` and their mean reward and length."""

    num_samples: int = 0
    temperature: float = 1.0
    """Temperature of the k samples (top-p/top-k as in ``data.sampling``)."""
    pass_k: list[int] | None = None
    """The k values of ``val/pass@k`` (unbiased estimator from the samples); default ``[1, num_samples]``."""
    answer_fn: str | None = None
    """Import path of ``fn(completion) -> answer | None`` that maj@k votes on (``None`` abstains), e.g.
    ``grpo_lightning.rewards.math.extract_answer``; default: the stripped completion. Ties go to the answer
    sampled first."""

    def __post_init__(self) -> None:
        if self.num_samples < 0:
            raise ConfigError(f"data.eval.num_samples must be >= 0 (got {self.num_samples}); 0 = greedy only")
        if self.temperature <= 0:
            raise ConfigError(f"data.eval.temperature must be > 0 (got {self.temperature})")
        if self.num_samples == 0 and self.pass_k:
            raise ConfigError("data.eval.pass_k needs data.eval.num_samples > 0 (samples per held-out prompt)")
        bad = [k for k in self.pass_k or [] if not 1 <= k <= self.num_samples]
        if bad:
            raise ConfigError(f"data.eval.pass_k values must be in [1, num_samples={self.num_samples}] (got {bad})")

    @property
    def ks(self) -> list[int]:
        """The k values of pass@k to report (none without samples)."""
        if self.num_samples == 0:
            return []
        return sorted(set(self.pass_k)) if self.pass_k else sorted({1, self.num_samples})
