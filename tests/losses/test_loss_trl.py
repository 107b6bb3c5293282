"""Our ``grpo_loss`` against TRL 1.16's ``GRPOTrainer._compute_loss`` on the same log-probs, advantages and masks.

TRL's method is run as it is, on a stand-in for the trainer that holds only the settings the loss reads, copied
from a ``GRPOConfig``'s defaults the way ``GRPOTrainer.__init__`` copies them (``trl_loss``); its forward
(``_get_per_token_logps_and_entropies``) returns the log-probs given here. Loss values and the gradients with
respect to the current log-probs must agree to 1e-6 (float64 inputs, so that the tolerance measures the formulas,
not rounding), for every loss TRL has. TRL's ``GRPOConfig`` names on the left, ours (``grpo_loss``) on the right:

- grpo, bnpo, dr_grpo, dapo: ``epsilon`` / ``epsilon_high`` = ``epsilon_low`` / ``epsilon_high``; ``delta``
  (INTELLECT-2), ``beta`` (k3 KL), ``importance_sampling_level`` (GSPO at ``"sequence"``) and
  ``max_completion_length`` as they are; DAPO's ``num_items`` is TRL's ``num_items_in_batch`` (one process, no
  accumulation).
- cispo: TRL caps the weight absolutely, ``epsilon_high=C`` is clamp(ρ, max=C); ours clips relatively as the
  MiniMax-M1 paper writes it, so TRL's C is ours ``epsilon_low=1.0, epsilon_high=C − 1``. The defaults differ on
  purpose: TRL's leaves ``epsilon_high = epsilon = 0.2`` (every weight capped at 0.2), ours is ScaleRL's cap 5.0,
  which is TRL's ``epsilon_high=5.0``.
- sapo: ``sapo_temperature_pos`` / ``sapo_temperature_neg`` = ``loss_kwargs`` ``tau_pos`` / ``tau_neg`` (same
  defaults, 1.0 / 1.05).
- luspo: TRL's ``loss_type="luspo", importance_sampling_level="sequence"`` = ours ``loss_type="luspo"`` (always
  at sequence level: it takes no ``importance_sampling_level``).
- vespo: ``vespo_k_pos`` / ``vespo_lambda_pos`` / ``vespo_k_neg`` / ``vespo_lambda_neg`` = ``loss_kwargs``
  ``k_pos`` / ``lambda_pos`` / ``k_neg`` / ``lambda_neg`` (same defaults). The sampler's token weights, TRL's
  ``inputs["importance_sampling_ratio"]`` (min(π_old / π_sampler, C), 1 on padding), are ours computed from
  ``engine_logprobs`` with ``tis_cap=C``; both fold them into the sequence weight and not onto the loss.
- the sampler correction of the other losses: TRL's ``use_vllm`` with ``vllm_importance_sampling_correction``
  (the ``importance_sampling_ratio`` above) = ours ``engine_logprobs`` with ``tis_cap=C``.
- the off-policy sequence mask (DeepSeek-V3.2): ``off_policy_mask_threshold=δ`` with
  ``inputs["sampling_per_token_logps"]`` = ours ``off_policy_mask=δ`` with ``engine_logprobs`` and
  ``tis_cap=None`` (no correction weight on either side); without sampler log-probs both measure from π_old.
- gmpo: TRL's ``trl.experimental.gmpo.GMPOTrainer`` (same log-space clip, ``epsilon`` / ``epsilon_high`` = ours
  ``epsilon_low`` / ``epsilon_high``). One difference, on purpose: TRL gives an empty completion (no token counts)
  the loss −A (its geometric mean of nothing is 1), a constant without gradient; ours counts it as 0, as every
  aggregation of ours does (the same step for any micro-batch split). Gradients are equal either way.
- the bias-corrected KL: ``use_bias_correction_kl=True`` = ours ``kl_importance_weighted=True``. TRL's default is
  True and ours False, so the stand-in sets TRL's to False unless a test asks for it.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.losses import grpo_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl (a dev dependency) is not installed")

B, T = 6, 7


def trl_loss_inputs(mask, advantages, old, ref):
    """What TRL's ``_compute_loss`` reads of a batch of ``B`` completions of ``T`` tokens (the prompts unused)."""
    return {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().to(torch.float64),
    }


LENGTHS = [T, 3, 1, 0, 5, T]  # uneven, one row empty
TOL = dict(atol=1e-6, rtol=0)

TRL_CONFIG = {f.name: f.default for f in dataclasses.fields(trl_grpo.GRPOConfig)}
STAND_IN_CONFIG = {"max_completion_length": T, "steps_per_generation": 1, "use_bias_correction_kl": False}
"""Where the stand-in departs from ``GRPOConfig``'s defaults: this batch's length, one generation step per
optimizer step (what ``__post_init__`` derives from no accumulation), and our default KL (module docstring)."""


class OneProcess:
    """Accelerate's collectives on one process: identities."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(
    logprobs,
    old,
    ref,
    advantages,
    mask,
    *,
    sampling_per_token_logps=None,
    importance_sampling_ratio=None,
    trainer=trl_grpo.GRPOTrainer,
    **config,
):
    """TRL's loss and its gradient with respect to ``logprobs``.

    ``config``: ``GRPOConfig`` fields by TRL's names (``loss_type``, ``epsilon``, ``sapo_temperature_pos``, ...);
    the others keep the config's defaults (``STAND_IN_CONFIG`` aside). The two keyword tensors become the inputs
    of the same names, as TRL's generation step would leave them.
    """
    unknown = set(config) - set(TRL_CONFIG)
    assert not unknown, f"not GRPOConfig fields: {unknown}"
    args = SimpleNamespace(**{**TRL_CONFIG, **STAND_IN_CONFIG, **config})
    current = logprobs.detach().clone().requires_grad_(True)
    stand_in = SimpleNamespace(  # what GRPOTrainer.__init__ copies from args, and the methods the loss calls
        loss_type=args.loss_type,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        beta=args.beta,
        importance_sampling_level=args.importance_sampling_level,
        max_completion_length=args.max_completion_length,
        top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold,
        use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        accelerator=OneProcess(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=args,
        get_off_policy_mask=trl_grpo.GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=trl_grpo.GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (current, torch.zeros_like(current), None),
    )
    inputs = trl_loss_inputs(mask, advantages, old, ref)
    if sampling_per_token_logps is not None:
        inputs["sampling_per_token_logps"] = sampling_per_token_logps
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    loss = trainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), current.grad


def our_loss(logprobs, old, ref, advantages, mask, **settings):
    """Our loss, its gradient with respect to ``logprobs`` and its metrics; ``settings``: ``grpo_loss``'s."""
    current = logprobs.clone().requires_grad_(True)
    settings = {"max_completion_length": T, "num_items": int(mask.sum()), **settings}
    loss, metrics = grpo_loss(current, old, ref, advantages, mask, **settings)
    loss.backward()
    return loss.detach(), current.grad, metrics


def assert_same(ours, trls):
    """Loss and gradient equal to 1e-6, and the gradient not all zero (the case trains something)."""
    (loss, grad, _), (expected, expected_grad) = ours, trls
    torch.testing.assert_close(loss, expected, **TOL)
    torch.testing.assert_close(grad, expected_grad, **TOL)
    assert expected_grad.abs().sum() > 0


def differs(a, b):
    """Two (loss, gradient, ...) results that are not equal within the tolerance."""
    return abs(float(a[0] - b[0])) > 1e-5 or float((a[1] - b[1]).abs().max()) > 1e-5


def batch(seed: int, *, spread: float = 0.4, tilt: float = 0.0):
    """Log-probs with ratios well inside and outside the clip range, mixed-sign advantages, uneven lengths (one
    row empty). ``spread``: the noise of log π_θ − log π_old per token; ``tilt``: a row offset on it, from −tilt
    (row 0) to +tilt (last row), for sequence ratios far from 1 on both sides."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    offset = tilt * torch.linspace(-1, 1, B, dtype=torch.float64)[:, None]
    old = logprobs + torch.randn(B, T, generator=g, dtype=torch.float64) * spread - offset
    ref = logprobs + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    return logprobs, old, ref, advantages, mask


def sampler_logprobs(old: torch.Tensor, seed: int, spread: float = 1.0) -> torch.Tensor:
    """An engine's log-probs of the same tokens, off π_old by noise."""
    g = torch.Generator().manual_seed(seed)
    return old + torch.randn(old.shape, generator=g, dtype=torch.float64) * spread


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


# grpo, bnpo, dr_grpo, dapo (GSPO at sequence level), clip-higher, delta, k3 KL


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    "eps_low, eps_high, delta, beta",
    [(0.2, 0.2, None, 0.0), (0.2, 0.28, None, 0.04), (0.2, 0.28, 1.5, 0.1)],
    ids=["grpo", "clip-higher+kl", "delta+kl"],
)
def test_loss_and_gradient_equal_trls(loss_type, level, eps_low, eps_high, delta, beta):
    data = batch(seed=zlib.crc32(f"{loss_type}{level}{delta}{beta}".encode()))
    if level == "sequence":  # GSPO's ratios sit close to 1: a clip range its paper uses
        eps_low, eps_high = 3e-4, 4e-4
    expected = trl_loss(
        *data, loss_type=loss_type, epsilon=eps_low, epsilon_high=eps_high, delta=delta, beta=beta,
        importance_sampling_level=level,
    )  # fmt: skip
    ours = our_loss(
        *data, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, delta=delta, beta=beta,
        importance_sampling_level=level,
    )  # fmt: skip
    assert_same(ours, expected)


def test_the_cross_check_catches_a_different_formula():
    """The stand-in really runs TRL's formula: a different clip range gives a different loss."""
    data = batch(seed=1)
    narrow, _ = trl_loss(*data, loss_type="grpo", epsilon=0.2, epsilon_high=0.2)
    wide, _ = trl_loss(*data, loss_type="grpo", epsilon=0.2, epsilon_high=10.0)
    assert abs(float(narrow - wide)) > 1e-3


# cispo


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [5.0, 1.5], ids=["scalerl-cap5", "cap1.5"])
def test_cispo_equals_trls_absolute_cap(cap, level):
    """TRL's clamp(ρ, max=C) is ours clip(ρ, 1 − 1.0, 1 + (C − 1))."""
    data = batch(seed=seed_of("cispo", cap, level), tilt=2.0)
    expected = trl_loss(*data, loss_type="cispo", epsilon_high=cap, importance_sampling_level=level)
    ours = our_loss(*data, loss_type="cispo", epsilon_low=1.0, epsilon_high=cap - 1, importance_sampling_level=level)
    assert_same(ours, expected)
    metrics = ours[2]
    assert 0 < metrics["clip_frac_high"] < 1  # some weights capped, some not
    assert metrics["clip_frac_low"] == 0  # no lower bound


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_defaults_differ_from_trls_on_purpose(level):
    """TRL's default cispo caps every weight at epsilon = 0.2; ours is ScaleRL's cap 5.0, TRL's epsilon_high=5.0."""
    data = batch(seed=seed_of("cispo-defaults", level), tilt=2.0)
    trl_default = trl_loss(*data, loss_type="cispo", importance_sampling_level=level)
    trl_cap5 = trl_loss(*data, loss_type="cispo", epsilon_high=5.0, importance_sampling_level=level)
    ours = our_loss(*data, loss_type="cispo", importance_sampling_level=level)
    assert ours[2]["clip_frac_high"] > 0  # the cap 5 binds on this batch
    assert differs(ours, trl_default)
    assert_same(ours, trl_cap5)


# sapo


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("temperatures", [None, (0.5, 2.0)], ids=["defaults", "tau0.5-2.0"])
def test_sapo_equals_trls(temperatures, level):
    """``None``: each library at its own defaults (both 1.0 / 1.05)."""
    data = batch(seed=seed_of("sapo", temperatures, level), tilt=0.5)
    trl_temps, loss_kwargs = {}, None
    if temperatures is not None:
        trl_temps = dict(sapo_temperature_pos=temperatures[0], sapo_temperature_neg=temperatures[1])
        loss_kwargs = {"tau_pos": temperatures[0], "tau_neg": temperatures[1]}
    expected = trl_loss(*data, loss_type="sapo", importance_sampling_level=level, **trl_temps)
    ours = our_loss(*data, loss_type="sapo", importance_sampling_level=level, loss_kwargs=loss_kwargs)
    assert_same(ours, expected)
    # both temperatures act on this batch: swapping them changes TRL's result
    pos, neg = temperatures or (TRL_CONFIG["sapo_temperature_pos"], TRL_CONFIG["sapo_temperature_neg"])
    swapped = trl_loss(
        *data, loss_type="sapo", importance_sampling_level=level, sapo_temperature_pos=neg, sapo_temperature_neg=pos
    )
    assert differs(expected, swapped)


# luspo


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
@pytest.mark.parametrize("eps_low, eps_high", [(2e-3, 2.5e-3), (0.2, 0.28)], ids=["paper", "wide"])
def test_luspo_equals_trls_at_sequence_level(eps_low, eps_high, beta):
    data = batch(seed=seed_of("luspo", eps_low, eps_high, beta), tilt=1.0)
    expected = trl_loss(
        *data, loss_type="luspo", importance_sampling_level="sequence", epsilon=eps_low, epsilon_high=eps_high,
        beta=beta,
    )  # fmt: skip
    ours = our_loss(*data, loss_type="luspo", epsilon_low=eps_low, epsilon_high=eps_high, beta=beta)
    assert_same(ours, expected)
    assert 0 < ours[2]["clip_frac"] < 1  # some sequences clipped, some not


# vespo


VESPO_OTHER = {"k_pos": 1.0, "lambda_pos": 1.5, "k_neg": 4.0, "lambda_neg": 2.5}


def vespo_config(shape: dict | None) -> dict:
    return {} if shape is None else {f"vespo_{k}": v for k, v in shape.items()}


@pytest.mark.parametrize("shape", [None, VESPO_OTHER], ids=["defaults", "other"])
def test_vespo_equals_trls(shape):
    """``None``: each library at its own defaults (both k 2 / λ 3 for A ≥ 0, k 3 / λ 2 for A < 0)."""
    data = batch(seed=seed_of("vespo", shape))
    advantages, mask = data[3], data[4]
    expected = trl_loss(*data, loss_type="vespo", **vespo_config(shape))
    ours = our_loss(*data, loss_type="vespo", loss_kwargs=shape)
    assert_same(ours, expected)
    rows = mask.any(dim=1)
    assert (advantages[rows] >= 0).any() and (advantages[rows] < 0).any()  # both shapes act
    assert abs(float(ours[2]["vespo_weight_mean"]) - 1) > 1e-2  # the weights are not all φ(1) = 1


@pytest.mark.parametrize("use_vllm", [True, False], ids=["trl-vllm-correction", "trl-no-vllm"])
@pytest.mark.parametrize("shape", [None, VESPO_OTHER], ids=["defaults", "other"])
def test_vespo_with_a_sampler_equals_trls(shape, use_vllm):
    """The sampler's truncated token weights join VESPO's sequence weight; TRL never multiplies vespo's loss by
    them, with or without its vLLM correction on."""
    cap = 2.0
    logprobs, old, ref, advantages, mask = data = batch(seed=seed_of("vespo-sampler", shape))
    engine = sampler_logprobs(old, seed=seed_of("engine", shape))
    ratio = torch.where(mask, torch.clamp(torch.exp(old - engine), max=cap), torch.ones_like(old))
    expected = trl_loss(
        *data, loss_type="vespo", use_vllm=use_vllm, vllm_importance_sampling_correction=True,
        importance_sampling_ratio=ratio, **vespo_config(shape),
    )  # fmt: skip
    ours = our_loss(*data, loss_type="vespo", loss_kwargs=shape, engine_logprobs=engine, tis_cap=cap)
    assert_same(ours, expected)
    assert 0 < ours[2]["tis_truncated_frac"] < 1  # some weights capped
    assert differs(ours, our_loss(*data, loss_type="vespo", loss_kwargs=shape))  # the sampler changed the loss


# the sampler correction (TRL's vLLM importance sampling, token_truncate) on the other losses


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_sampler_correction_equals_trls(loss_type):
    cap = 2.0
    logprobs, old, ref, advantages, mask = data = batch(seed=seed_of("tis", loss_type))
    engine = sampler_logprobs(old, seed=seed_of("engine", loss_type))
    ratio = torch.where(mask, torch.clamp(torch.exp(old - engine), max=cap), torch.ones_like(old))
    expected = trl_loss(
        *data, loss_type=loss_type, use_vllm=True, vllm_importance_sampling_correction=True,
        importance_sampling_ratio=ratio, epsilon_high=5.0 if loss_type == "cispo" else None,
    )  # fmt: skip
    ours = our_loss(*data, loss_type=loss_type, engine_logprobs=engine, tis_cap=cap)
    assert_same(ours, expected)
    assert 0 < ours[2]["tis_truncated_frac"] < 1
    assert differs(ours, our_loss(*data, loss_type=loss_type))


# the off-policy sequence mask (DeepSeek-V3.2)


@pytest.mark.parametrize("sampler", ["engine", "old"], ids=["sampler-logprobs", "from-old"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_off_policy_mask_equals_trls(loss_type, level, sampler):
    logprobs, old, ref, advantages, mask = data = batch(seed=seed_of("opsm", loss_type, level, sampler))
    engine = sampler_logprobs(old, seed=seed_of("engine", loss_type, level)) if sampler == "engine" else None
    drift_from = old if engine is None else engine
    # δ between the two smallest drifts of the non-empty rows with A < 0: one such row kept, the others dropped
    drift = torch.where(mask, drift_from - logprobs, 0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    negative = (advantages < 0) & mask.any(dim=1)
    lowest = drift[negative].sort().values
    assert len(lowest) >= 2
    threshold = float(lowest[:2].mean())
    dropped = negative & (drift > threshold)
    assert dropped.any() and (negative & ~dropped).any()

    eps = {"token": 0.2, "sequence": 3e-4}[level]
    expected = trl_loss(
        *data, loss_type=loss_type, importance_sampling_level=level, epsilon=eps, off_policy_mask_threshold=threshold,
        sampling_per_token_logps=engine,
    )  # fmt: skip
    settings = dict(loss_type=loss_type, importance_sampling_level=level, epsilon_low=eps)
    ours = our_loss(*data, off_policy_mask=threshold, engine_logprobs=engine, tis_cap=None, **settings)
    assert_same(ours, expected)
    assert 0 < ours[2]["off_policy_masked_frac"] < 1
    assert differs(ours, our_loss(*data, **settings))


# the bias-corrected ("importance-weighted") KL


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_bias_corrected_kl_equals_trls(loss_type, level):
    data = batch(seed=seed_of("kl", loss_type, level))
    settings = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1)
    expected = trl_loss(*data, use_bias_correction_kl=True, **settings)
    ours = our_loss(*data, kl_importance_weighted=True, **settings)
    assert_same(ours, expected)
    assert differs(ours, our_loss(*data, **settings))  # the weighting changes the loss or its gradient


# GMPO (TRL's experimental GMPOTrainer)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_equals_trls_experimental_trainer(beta, eps):
    gmpo = pytest.importorskip("trl.experimental.gmpo.gmpo_trainer")
    logprobs, old, ref, advantages, mask = batch(seed_of("gmpo", beta, eps), spread=0.5)
    empty = ~mask.any(dim=1)
    expected = trl_loss(logprobs, old, ref, advantages, mask, trainer=gmpo.GMPOTrainer, loss_type="grpo",
                        epsilon=eps[0], epsilon_high=eps[1], beta=beta)  # fmt: skip
    ours = our_loss(logprobs, old, ref if beta else None, advantages, mask, loss_type="gmpo", epsilon_low=eps[0],
                    epsilon_high=eps[1], beta=beta)  # fmt: skip
    assert 0 < float(ours[2]["clip_frac"]) < 1  # the log-space clip binds on some tokens
    # TRL's empty row adds -A / B to the value (no gradient); ours counts it as 0 (module docstring).
    trl_value = expected[0] + (advantages[empty]).sum() / B
    assert empty.any() and abs(float(expected[0] - ours[0])) > 1e-3
    assert_same(ours, (trl_value, expected[1]))
    full = torch.ones_like(mask)  # with no empty row the values agree as they are
    assert_same(
        our_loss(logprobs, old, ref if beta else None, advantages, full, loss_type="gmpo", epsilon_low=eps[0],
                 epsilon_high=eps[1], beta=beta),
        trl_loss(logprobs, old, ref, advantages, full, trainer=gmpo.GMPOTrainer, loss_type="grpo", epsilon=eps[0],
                 epsilon_high=eps[1], beta=beta),
    )  # fmt: skip
