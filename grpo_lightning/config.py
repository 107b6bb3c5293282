"""Typed settings groups: each one a YAML section (``model.objective``, ``data.sampling``, ``data.advantage``, ...).

They validate themselves when built, so a bad value is refused while the config is parsed, before any model is
loaded, with a one-line message that names the setting.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from grpo_lightning.advantage_registry import AdvantageEntry, check_advantage_settings
from grpo_lightning.errors import ConfigError as ConfigError  # re-exported: its home before errors.py
from grpo_lightning.losses import GENERIC_SETTINGS, PolicyLoss, SettingOutOfRange, check_policy_loss
from grpo_lightning.losses.entropy import EntropyControl, entropy_settings_problem

Aggregation = Literal["sequence_mean", "token_mean", "micro_batch_token_mean", "constant", "sequence_sum"]


@dataclass
class SamplingConfig:
    """How completions are sampled from the policy at rollout time."""

    group_size: int = 8
    """G: completions sampled per prompt; advantages compare completions within a group. 1 only for on-policy
    distillation alone (``model.teacher``, no reward of weight > 0): its signal is per sample, a group's is 0."""
    max_new_tokens: int = 64
    """Completion length limit in tokens; longer completions are truncated (and flagged as such)."""
    min_new_tokens: int = 0
    """EOS is forbidden before this many tokens (benchmarks use min = max for fixed-length completions)."""
    temperature: float = 1.0
    """The logits are divided by it before sampling (1: the policy's own distribution; the loss's log-probs are
    taken at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probabilities reach ``top_p`` is kept (1: all)."""
    top_k: int = 0
    """Only the ``top_k`` most likely tokens are kept; 0 disables top-k filtering."""
    generation_batch_size: int = 256
    """Completions decoded at once; bounds generation memory independently of the optimisation batch."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose (outcome) rewards are all equal and draw more prompts until the
    rollout is full of informative groups (how a round samples; an engine's parameters ignore it)."""
    max_sampling_rounds: int = 4
    """Cap on generations per round with dynamic sampling (then the rollout is topped up with uninformative
    groups, so its size never changes)."""

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ConfigError(
                f"data.sampling.group_size must be at least 1 (got {self.group_size}); 2 or more for the rewards: "
                "GRPO compares each completion with the others of its group"
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
class UpdateConfig:
    """The update half of a round (``data.update``): μ passes over the rollout in mini-batches (optimizer steps) of
    micro-batches (forwards), how they are laid out, and where π_old's log-probs come from (``update_plan.py``)."""

    num_iterations: int = 1
    """μ, optimisation passes over each rollout (DeepSeekMath Alg. 1)."""
    mini_batch_size: int | None = None
    """Completions per optimizer step (default: the whole rollout, one step per pass)."""
    micro_batch_size: int | None = None
    """Completions per forward/backward; ``mini / micro`` micro-batches make an optimizer step:
    ``trainer.accumulate_grad_batches`` must equal it (the CLI derives it when left unset)."""
    balance_micro_batches: bool = True
    """The micro-batches of a step hold equal shares of its completion tokens (rows assigned longest first), not
    equal row counts: peak memory stays flat when lengths vary. Their number stays ``mini / micro`` (the trainer's
    gradient accumulation); the step is the same either way."""
    pack_tokens: int | Literal["auto"] | None = "auto"
    """Padding-free log-prob passes (``models/packing.py``): each micro-batch's sequences laid end to end in bins of
    this many tokens; ``auto``: bins as long as its longest sequence, when they spare a quarter of the padded tokens
    or more; null: padded rows."""
    old_logprobs: Literal["auto", "sampler", "recompute"] = "auto"
    """Where π_old's log-probs come from when a round has several optimizer steps: ``sampler`` (the engine's, no
    extra pass), ``recompute`` (a forward pass over the rollout), ``auto`` (the engine's where they equal the
    trainer's: the policy's own weights in float32; an engine that gives only its filtered sampling distribution's
    log-probs, under top-k, top-p or a minimum length, is recomputed)."""
    mask_truncated_completions: bool = False
    """Leave completions cut by ``max_new_tokens`` out of the loss (DAPO)."""

    def __post_init__(self) -> None:
        # The numeric ranges are ``config_checks.SETTING_RANGES``' (the CLI checks them before anything is built).
        pack = self.pack_tokens
        if pack != "auto" and pack is not None and (type(pack) is not int or pack < 1):
            raise ConfigError(f"data.update.pack_tokens must be a number of tokens >= 1, auto or null (got {pack!r})")


@dataclass
class ScheduleConfig:
    """When a round is sampled (``data.schedule``): at a lag, by a background process (``rollout/schedule.py``)."""

    rollout_lag: int = 0
    """L, asynchronous rollouts: round k trains on a rollout sampled by the policy as it was L rounds earlier,
    while a background process samples the next rounds; 0 = sample, then update, in this process."""
    off_policy_correction: Literal["decoupled", "behaviour", "none"] = "decoupled"
    """At a lag, the loss's ratio for the stale sampler μ: ``decoupled`` (to the policy at the update's start, times
    π_prox / μ truncated or masked as ``model.objective.tis_*`` say), ``behaviour`` (to μ directly) or ``none`` (to
    the update's start, no weight)."""
    rollout_threads: int | None = None
    """CPU threads of the background process (default half of this process's; the update keeps the rest)."""
    rollout_timeout_s: float = 1800.0
    """The longest wait for the background process (its start, or one round)."""
    partial_rollouts: bool = False
    """Partial rollouts (``rollout/partial.py``, with ``rollout_lag`` 1): after each weight push the background
    process decodes every unfinished sequence ``tokens_per_push`` tokens further under the new weights, so no round
    waits for its slowest sequence; each token keeps the version and the behaviour log-prob it was drawn with, and a
    group reaches the trainer as soon as its G sequences have ended. With ``interrupt: tokens``, deterministic: a
    function of (seed, settings). See docs/partial_rollouts.md."""
    max_staleness: int = 4
    """η, with ``partial_rollouts``: round k admits a group only if its oldest token was drawn by the weights of
    round k − η or later (AReaL's ``max_head_offpolicyness``); older ones are handled as ``stale_groups`` says.
    At least ⌈max_new_tokens / tokens_per_push⌉ (the pushes a longest sequence spans), so none is always dropped."""
    tokens_per_push: int | None = None
    """With ``partial_rollouts``: the most tokens a sequence decodes under one weights version (one segment); null:
    ⌈data.sampling.max_new_tokens / 4⌉."""
    stale_groups: Literal["drop", "resample"] = "drop"
    """With ``partial_rollouts``, a group older than ``max_staleness``: ``drop`` (counted in ``rollout/stale_groups``)
    or ``resample`` (its prompt is sampled afresh, first in the next segment)."""
    interrupt: Literal["tokens", "clock"] = "tokens"
    """With ``partial_rollouts``, what ends the decoding under one weights version: ``tokens`` (one segment of
    ``tokens_per_push`` per push: deterministic) or ``clock`` (segments back to back until the next push arrives:
    more tokens per push when the update is slower than a segment, and a run that depends on timing, not
    reproducible)."""

    def __post_init__(self) -> None:
        # The numeric ranges are ``config_checks.SETTING_RANGES``' (the CLI checks them before anything is built).
        if self.off_policy_correction not in ("decoupled", "behaviour", "none"):
            raise ConfigError(
                "data.schedule.off_policy_correction must be decoupled, behaviour or none "
                f"(got {self.off_policy_correction!r})"
            )
        if self.interrupt not in ("tokens", "clock"):
            raise ConfigError(f"data.schedule.interrupt must be tokens or clock (got {self.interrupt!r})")
        if self.stale_groups not in ("drop", "resample"):
            raise ConfigError(f"data.schedule.stale_groups must be drop or resample (got {self.stale_groups!r})")

    def segment_tokens(self, max_new_tokens: int) -> int:
        """The tokens a sequence decodes per push with ``partial_rollouts``: ``tokens_per_push``, or
        ⌈max_new_tokens / 4⌉ where null."""
        return self.tokens_per_push if self.tokens_per_push is not None else max(1, -(-max_new_tokens // 4))


def pushes_per_sequence(max_new_tokens: int, tokens_per_push: int) -> int:
    """The weight pushes a longest sequence spans with partial rollouts: ⌈max_new_tokens / tokens_per_push⌉ (the pool's
    size in rounds, and the least ``max_staleness`` that admits it)."""
    return -(-max_new_tokens // tokens_per_push)


@dataclass
class ObjectiveConfig:
    """The GRPO loss and its variants (``model.objective``); names match ``grpo_lightning.losses.grpo_loss``'s
    keyword arguments. The rollout side of the algorithm (advantages, μ, π_old's source) is ``data``'s."""

    beta: float = 0.04
    """KL weight against the reference model. 0 skips the reference model entirely (not even built)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token estimator of KL(π_θ ‖ π_ref), with d = log π_ref − log π_θ: ``k1`` = −d, ``k2`` = d²/2,
    ``k3`` = exp(d) − d − 1 (DeepSeekMath's; Schulman's "Approximating KL divergence")."""
    kl_importance_weighted: bool = False
    """Multiply each token's KL estimate by π_θ/μ, μ the sampler that drew it: π_θ/π_old times the behaviour weight
    π_old/μ the policy term gets from another engine or at a rollout lag (truncated or masked as ``tis_*`` say).
    Unbiased for k1 and k3 when the trainer sampled at lag 0 or no weight is truncated; truncated weights count the
    tokens μ under-samples less, and ``tis_cap: null`` (no behaviour weight) leaves π_θ/π_old, π_θ's KL reweighted
    by μ/π_old (``grpo_lightning.losses.kl``). DeepSeek-V3.2's bias-corrected KL, TRL's ``use_bias_correction_kl``
    (on by default in TRL 1.16; off here, as before this setting existed)."""
    loss_type: str = "grpo"
    """The policy loss: ``grpo``, ``dapo``, ``dr_grpo``, ``bnpo`` (the clipped surrogate with each paper's
    aggregation), ``luspo``, ``cispo``, ``sapo``, ``gmpo``, ``vespo``, or a function's import path
    ``package.module:function`` (``grpo_lightning.losses.registry`` has the contract)."""
    aggregation: Aggregation | None = None
    """How per-token losses become the loss (``grpo_lightning.losses.aggregation``); null: the loss's own. A loss
    whose paper fixes it (grpo, dapo, dr_grpo, bnpo, luspo, gmpo) refuses another."""
    epsilon_low: float | None = None
    """Clip range below (ρ ≥ 1 − ε_low); null: the loss's default (0.2 for the clipped ones; see docs/losses.md)."""
    epsilon_high: float | None = None
    """Clip range above (DAPO clip-higher); null: the loss's default (epsilon_low for the clipped ones)."""
    delta: float | None = None
    """Upper cap on the ratio before the min (two-sided clipping, INTELLECT-2)."""
    clip_ratio_c: float | None = None
    """Dual clip: for A < 0 the clipped loss is bounded by c·|A| (verl's ``clip_ratio_c``, 3.0 there)."""
    importance_sampling_level: Literal["token", "sequence"] | None = None
    """``token`` ratio, or ``sequence``: GSPO's length-normalised s_i; null: the loss's default (token)."""
    loss_kwargs: dict[str, Any] | None = None
    """The loss's own settings, e.g. ``{tau_pos: 1.0, tau_neg: 1.05}`` for sapo; unknown keys are refused."""
    off_policy_mask: float | None = None
    """δ of DeepSeek-V3.2's off-policy sequence mask: a completion with A < 0 whose mean log π_sampler − log π_θ
    exceeds δ leaves the policy loss (TRL suggests 0.5); null: off."""
    entropy_coef: float = 0.0
    """c of the entropy bonus −c·H_t on each loss token, aggregated like the loss; with ``use_adaptive_entropy``
    its starting value."""
    top_entropy_quantile: float = 1.0
    """ρ in (0, 1]: only the loss tokens whose entropy is in the top ρ of the micro-batch's (all ranks') keep
    their policy term, and the entropy bonus (the KL term stays): "Beyond the 80/20 Rule" (ρ 0.2), TRL's
    ``top_entropy_quantile`` (``grpo_lightning.losses.entropy``); 1 keeps every token."""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive ``entropy_coef``, TRL's: after each optimizer step it moves by
    ``entropy_coef_delta`` within [``entropy_coef_min``, ``entropy_coef_max``], up when the step's mean entropy
    (of the tokens ``top_entropy_quantile`` keeps) is at or below ``entropy_target``, else down; the bonus acts
    only while the last step's entropy was at or below the target. Logged as ``train/entropy_coef``, kept in
    checkpoints."""
    entropy_coef_min: float = 0.0
    """With ``use_adaptive_entropy``: the lowest value the coefficient moves to."""
    entropy_coef_max: float = 1.0
    """With ``use_adaptive_entropy``: the highest value the coefficient moves to."""
    entropy_coef_delta: float = 0.005
    """With ``use_adaptive_entropy``: how far the coefficient moves after each optimizer step."""
    entropy_target: float = 0.2
    """Nats per token; TRL's default. A model's tokens start far above it (2–10 nats): set it near the entropy
    of the run's first steps (``train/entropy``) for the bonus to act before the entropy collapses."""
    tis_cap: float | None = 2.0
    """C of the truncated importance-sampling correction, used when the engine that sampled is not the trainer
    (vLLM): each token's surrogate is weighted by min(π_old / π_engine, C); null = no correction (the mismatch is
    still logged)."""
    tis_level: Literal["token", "sequence"] = "token"
    """``token``: a weight per token; ``sequence``: min(∏_t π_old / π_engine, C) for every token of a completion."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """``truncate``: min(w, C); ``mask``: w where 1/C <= w <= C, else the token (or completion) leaves the
    surrogate. The same weight is the decoupled correction of ``data.schedule.rollout_lag`` (π_old = the proximal
    policy)."""

    def __post_init__(self) -> None:
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"model.objective.tis_cap must be > 0, or null for no correction (got {self.tis_cap})")
        if self.beta < 0:
            raise ConfigError(f"model.objective.beta must be >= 0 (got {self.beta})")
        if self.tis_mode not in ("truncate", "mask"):
            raise ConfigError(f"model.objective.tis_mode must be truncate or mask (got {self.tis_mode!r})")
        if self.tis_mode == "mask" and self.tis_cap is not None and self.tis_cap <= 1:
            raise ConfigError(f"model.objective.tis_cap must be > 1 with tis_mode: mask (got {self.tis_cap})")
        if self.off_policy_mask is not None and self.off_policy_mask < 0:
            raise ConfigError(f"model.objective.off_policy_mask must be >= 0 (got {self.off_policy_mask})")
        if (problem := entropy_settings_problem(self)) is not None:  # top_entropy_quantile, the adaptive c's
            raise ConfigError(f"model.objective.{problem}")
        if self.loss_kwargs is not None and not isinstance(self.loss_kwargs, dict):
            raise ConfigError(f"model.objective.loss_kwargs must be a mapping (got {self.loss_kwargs!r})")
        # Imports a user's function now, before any model loads, and checks every loss setting against the ranges
        # its loss declares (epsilon_low, epsilon_high, delta, clip_ratio_c, loss_kwargs: ``losses/ranges.py``).
        policy = self.policy_loss
        if policy.corrects_sampler and self.tis_level != "token":
            raise ConfigError(
                f"model.objective.tis_level must be token with loss_type {self.loss_type} (it folds each token's "
                "sampler weight into its sequence weight)"
            )

    @property
    def generic_settings(self) -> dict[str, Any]:
        """The settings any loss may read by name (``grpo_lightning.losses.GENERIC_SETTINGS``)."""
        return {name: getattr(self, name) for name in GENERIC_SETTINGS}

    @property
    def policy_loss(self) -> PolicyLoss:
        """The ``PolicyLoss`` of ``loss_type``, checked against the settings (``ConfigError`` in one line)."""
        try:
            return check_policy_loss(self.loss_type, self.generic_settings, self.loss_kwargs, self.aggregation)
        except SettingOutOfRange as err:  # names its setting: model.objective.epsilon_low = 1.2 is outside ...
            raise ConfigError(f"model.objective.{err}") from None
        except ValueError as err:
            raise ConfigError(f"model.objective: {err}") from None

    def entropy_control(self) -> EntropyControl:
        """The entropy terms as a run starts: the quantile mask, the bonus's coefficient (``losses/entropy.py``)."""
        return EntropyControl.from_settings(self)

    @property
    def aggregation_in_use(self) -> str:
        """``aggregation``, or the loss's own when unset."""
        return self.aggregation or self.policy_loss.aggregation

    def resolved(self) -> dict[str, Any]:
        """The settings in use: the unset generic ones and the aggregation filled in with the loss's defaults (so
        that a config leaving ``epsilon_low`` unset compares equal to one that wrote the default out)."""
        values = asdict(self)
        parameters = self.policy_loss.parameters
        for name in GENERIC_SETTINGS:
            default = parameters[name].default if name in parameters else None
            if values[name] is None and default is not inspect.Parameter.empty:
                values[name] = default
        values["aggregation"] = self.aggregation_in_use
        return values

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Settings pickled in a checkpoint written before a field existed get its default.
        self.__dict__.update({**{f.name: f.default for f in fields(self)}, **state})


@dataclass
class AdvantageConfig:
    """How a group's rewards become advantages (``data.advantage``): the estimator and the aggregation of several
    rewards named here are entries of ``grpo_lightning.advantage_registry`` (built in: ``grpo``, ``passk``;
    ``sum_then_normalize``, GDPO's ``normalize_then_sum``), whose formulas are ``grpo_lightning.advantages``."""

    baseline: Literal["mean", "rloo"] = "mean"
    """``mean`` of the group (GRPO), or ``rloo``: the mean of the other G - 1 completions."""
    scale: Literal["group", "batch", "none"] = "group"
    """Divide by the std of the ``group``, of the whole ``batch`` (all ranks), or ``none`` (Dr. GRPO)."""
    std: Literal["population", "sample"] = "population"
    """The std that scales advantages: ``population`` (variance ÷ G) or ``sample`` (÷ G - 1, Bessel's
    correction, as TRL and verl compute it); at G = 4 the sample std is √(4/3) ≈ 1.155× the population one."""
    eps: float = 1e-4
    """Added to the std."""
    estimator: str = "grpo"
    """``grpo``: the group-relative advantage ``baseline`` and ``scale`` describe; ``passk``: verl's ``grpo_passk``
    (Tang et al. 2025), which trains for the best of ``k`` attempts: in every k-subset of a group only the best
    completion gains, by how much it beats the best of the others (``scale`` and ``std`` then divide as above); or
    one registered with ``register_advantage_estimator``, or an import path ``package.module:function``. A plain
    ``str`` (not a ``Literal``): a registered name is checked against the registry here, not refused by the parser."""
    k: int | None = None
    """The attempts of ``estimator: passk``, 2 ≤ k ≤ ``data.sampling.group_size``; null: the group size (verl's)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """With several rewards (TRL 1.16's setting): ``sum_then_normalize`` normalises their weighted sum (GRPO);
    ``normalize_then_sum`` normalises each reward within its group, sums them with their weights and normalises the
    sum over the whole batch (GDPO, Liu et al. 2026), with ``std`` and ``eps`` at both steps."""

    def __post_init__(self) -> None:
        if self.baseline not in ("mean", "rloo"):
            raise ConfigError(f"data.advantage.baseline must be mean or rloo (got {self.baseline!r})")
        if self.scale not in ("group", "batch", "none"):
            raise ConfigError(f"data.advantage.scale must be group, batch or none (got {self.scale!r})")
        if self.std not in ("population", "sample"):
            raise ConfigError(f"data.advantage.std must be population or sample (got {self.std!r})")
        if self.eps <= 0:
            raise ConfigError(f"data.advantage.eps must be > 0 (got {self.eps})")
        self._check_entries(None)

    @property
    def settings(self) -> dict[str, Any]:
        """Every field, as the registry's entries read them (``advantage_registry.estimate_advantages``)."""
        return asdict(self)

    def _check_entries(self, group_size: int | None) -> tuple[AdvantageEntry, AdvantageEntry]:
        """The estimator and the aggregation, looked up and checked against the settings (one-line ``ConfigError``:
        an unknown name, with the registered ones; a setting neither reads; their own rules)."""
        defaults = {f.name: f.default for f in fields(self)}
        try:
            return check_advantage_settings(self.settings, defaults, group_size)
        except ValueError as err:
            raise ConfigError(f"data.advantage.{err}") from None

    def check_round(self, group_size: int, process_rewards: bool) -> None:
        """Refuse, before training, what needs the group size or the rewards to see (``RolloutCollector`` asks)."""
        estimator, aggregation = self._check_entries(group_size)
        if process_rewards:
            for entry in (aggregation, estimator):
                if not entry.process_rewards:
                    raise ConfigError(
                        f"data.advantage.{entry.field}: {entry.name} takes outcome rewards only, and data.rewards has "
                        "a process (step) reward; use the defaults (estimator: grpo, sum_then_normalize) with process "
                        "rewards"
                    )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Settings pickled in a checkpoint written before a field existed get its default.
        self.__dict__.update({**{f.name: f.default for f in fields(self)}, **state})


@dataclass
class EvalConfig:
    """Held-out evaluation (``data.eval``): greedy pass@1 always; with ``num_samples`` = k > 0 also k sampled
    completions per prompt for ``val/pass@k``, ``val/maj@k`` and their mean reward and length."""

    num_samples: int = 0
    """k, sampled completions per held-out prompt for ``val/pass@k`` and ``val/maj@k``; 0: greedy pass@1 only."""
    temperature: float = 1.0
    """Temperature of the k samples (top-p/top-k as in ``data.sampling``)."""
    pass_k: list[int] | None = None
    """The k values of ``val/pass@k`` (unbiased estimator from the samples); default ``[1, num_samples]``."""
    answer_fn: str | None = None
    """Import path of ``fn(completion) -> answer | None`` that maj@k votes on (``None`` abstains), e.g.
    ``grpo_lightning.rewards.math.extract_answer``; default: the stripped completion. Ties go to the answer
    sampled first."""
    batch_size: int = 128
    """Prompts per evaluation batch."""
    limit: int | None = None
    """Evaluate on the first ``limit`` held-out prompts only."""

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
