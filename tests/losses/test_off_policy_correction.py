"""The correction for stale samples at a rollout lag (``data.schedule.off_policy_correction``,
``model.objective.tis_*``).

Decoupled (AReaL; verl's and NeMo-RL's importance-sampling correction): the clipped ratio is to π_prox, the
policy at the update's start, and each token's surrogate is weighted by π_prox / μ (μ = the stale sampler),
truncated at C or masked outside [1/C, C]. ``behaviour``: the ratio to μ directly, no weight. ``none``: the
ratio to π_prox, no weight. Hand-computed values of the loss and its gradient, then what each option makes the
round record.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.config import AdvantageConfig, ConfigError, ObjectiveConfig, SamplingConfig
from grpo_lightning.importance import truncated_importance_weights
from grpo_lightning.losses import grpo_loss
from grpo_lightning.rollout.round import RoundSettings

# One completion of 3 tokens: the policy now (π_θ), at the update's start (π_prox) and the stale sampler (μ).
THETA = torch.tensor([[0.6, 0.3, 0.5]]).log()
PROX = torch.tensor([[0.5, 0.3, 0.4]]).log()
MU = torch.tensor([[0.2, 0.5, 0.35]]).log()
MASK = torch.ones(1, 3)
A = 2.0


def test_decoupled_loss_and_gradient_by_hand():
    """ρ = π_θ/π_prox = (1.2, 1, 1.25), clipped to (1.2, 1, 1.2) for A > 0 (ε = 0.2); w = min(π_prox/μ, 2) =
    (2, 0.6, 8/7). Per token −w·min(ρA, clip(ρ)A); grpo averages the 3 tokens. The gradient of token t's
    log-prob is −w·ρ·A/3 where the ratio is not clipped, 0 where it is."""
    logprobs = THETA.clone().requires_grad_(True)
    loss, metrics = grpo_loss(
        logprobs, PROX, None, torch.tensor([A]), MASK, engine_logprobs=MU, tis_cap=2.0, tis_mode="truncate"
    )
    w, rho = [2.0, 0.6, 0.4 / 0.35], [1.2, 1.0, 1.25]
    surrogate = [min(r * A, min(max(r, 0.8), 1.2) * A) for r in rho]
    assert loss.item() == pytest.approx(-sum(wt * s for wt, s in zip(w, surrogate)) / 3)
    loss.backward()
    clipped = [False, False, True]
    expected = [0.0 if c else -wt * r * A / 3 for wt, r, c in zip(w, rho, clipped)]
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected]))
    assert metrics["tis_truncated_frac"].item() == pytest.approx(1 / 3)  # 2.5 capped at 2
    assert metrics["mismatch_kl"].item() == pytest.approx(sum(x - math.log(x) - 1 for x in (2.5, 0.6, 0.4 / 0.35)) / 3)


def test_mask_mode_drops_the_tokens_outside_one_over_c_and_c():
    weights, metrics = truncated_importance_weights(PROX, MU, MASK, cap=2.0, mode="mask")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.6, 0.4 / 0.35]]))  # 2.5 > 2: out; 0.6 >= 0.5: kept
    assert metrics["tis_truncated_frac"].item() == pytest.approx(1 / 3)
    low, _ = truncated_importance_weights(PROX, torch.tensor([[0.5, 0.7, 0.4]]).log(), MASK, cap=2.0, mode="mask")
    torch.testing.assert_close(low, torch.tensor([[1.0, 0.0, 1.0]]))  # 0.3/0.7 < 1/2: out
    # Sequence level: the product of the token ratios decides for the whole completion.
    kept, _ = truncated_importance_weights(PROX, MU, MASK, cap=2.0, level="sequence", mode="mask")
    torch.testing.assert_close(kept, torch.full((1, 3), 2.5 * 0.6 * (0.4 / 0.35)))  # 1.71: within [1/2, 2]
    stale = torch.tensor([[0.2, 0.3, 0.35]]).log()  # 2.5 · 1 · 8/7 = 2.86 > 2: the completion leaves
    dropped, metrics = truncated_importance_weights(PROX, stale, MASK, cap=2.0, level="sequence", mode="mask")
    assert torch.equal(dropped, torch.zeros(1, 3)) and metrics["tis_truncated_frac"].item() == 1.0


def test_masked_tokens_get_no_gradient_but_keep_their_kl():
    logprobs = THETA.clone().requires_grad_(True)
    ref = torch.tensor([[0.5, 0.5, 0.5]]).log()
    loss, _ = grpo_loss(
        logprobs, PROX, ref, torch.tensor([A]), MASK, beta=0.1, engine_logprobs=MU, tis_cap=2.0, tis_mode="mask"
    )
    loss.backward()
    d = ref[0, 0] - THETA[0, 0]  # token 0: masked out of the surrogate, its KL term alone: β·(e^d − d − 1)
    assert logprobs.grad[0, 0].item() == pytest.approx(0.1 * (1 - math.exp(d.item())) / 3)


def settings(lag: int, correction: str, steps: int = 2) -> RoundSettings:
    return RoundSettings(
        sampling=SamplingConfig(group_size=2),
        advantage=AdvantageConfig(),
        optimizer_steps=steps,
        rollout_lag=lag,
        correction=correction,
    )


@pytest.mark.parametrize(
    "lag,correction,steps,old_pass,old_from_engine,weight",
    [
        (1, "decoupled", 2, True, False, True),  # π_prox recomputed, μ kept for the weight
        (1, "decoupled", 1, False, False, True),  # one step: π_prox is the policy itself (ratio 1), weight kept
        (1, "behaviour", 1, False, True, False),  # the ratio to μ, even at one step
        (1, "none", 2, True, False, False),
        (0, "decoupled", 2, False, True, False),  # lag 0: the sampler is the policy (lean, float32)
    ],
)
def test_what_each_option_makes_the_round_record(lag, correction, steps, old_pass, old_from_engine, weight):
    s = settings(lag, correction, steps)
    assert (s.record_old and not s.old_from_engine) == old_pass
    assert s.old_from_engine == old_from_engine and s.behaviour_weight == weight
    assert s.engine_logprobs == (old_from_engine or weight)


def test_tis_mode_is_checked():
    with pytest.raises(ConfigError, match="model.objective.tis_mode must be truncate or mask"):
        ObjectiveConfig(tis_mode="clip")
    with pytest.raises(ConfigError, match="tis_cap must be > 1 with tis_mode: mask"):
        ObjectiveConfig(tis_mode="mask", tis_cap=0.5)
