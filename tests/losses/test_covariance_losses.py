"""verl's Clip-Cov and KL-Cov (``grpo_lightning/losses/covariance.py``) on five hand-computed tokens.

Two completions, A = +1 (3 tokens) and A = −1 (2 tokens, then padding holding NaN); the log-probs and the log-ratios
δ = log π_θ − log π_old are chosen so that each rule of verl's definitions (``verl/trainer/ppo/core_algos.py``,
``compute_policy_loss_clip_cov`` and ``compute_policy_loss_kl_cov``) decides something:

    token        (0,0)   (0,1)   (0,2)   (1,0)   (1,1)
    A             1       1       1      −1      −1          mean A = (3 − 2)/5 = 0.2
    log π_θ     −0.1    −1.0    −2.0    −2.5    −3.0         mean = −8.6/5 = −1.72
    Cov_t        1.296   0.576  −0.224   0.936   1.536       (A − 0.2)(log π_θ + 1.72)
    δ            0.25   −0.2     0.05    0.1    −0.3
    ρ = e^δ      1.284   0.819   1.051   1.105   0.741
    PPO clip     high    –       –       –       low         ε = 0.2: ρ > 1.2 with A > 0, ρ < 0.8 with A < 0
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lightning.config import ConfigError, ObjectiveConfig
from grpo_lightning.losses import LossInputs, get_policy_loss, grpo_loss
from grpo_lightning.losses.covariance import clip_cov, kl_cov, selection_size, token_covariance

NAN = math.nan
MASK = torch.tensor([[True, True, True], [True, True, False]])
LOGP = torch.tensor([[-0.1, -1.0, -2.0], [-2.5, -3.0, NAN]], dtype=torch.float64)
DELTA = torch.tensor([[0.25, -0.2, 0.05], [0.1, -0.3, NAN]], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
COV = [[1.296, 0.576, -0.224], [0.936, 1.536]]


def inputs(on_policy: bool = False, generator: torch.Generator | None = None) -> LossInputs:
    logp = LOGP.clone().requires_grad_(True)
    old = LOGP if on_policy else LOGP - DELTA
    return LossInputs(logp, old, ADV[:, None].expand(2, 3), MASK, generator=generator)


def close(actual, expected):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    )


def token_mean_and_grad(per_token: torch.Tensor, leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss = torch.where(MASK, per_token, 0).sum() / 5
    loss.backward()
    return loss.detach(), torch.where(MASK, leaf.grad, 0)


def test_the_covariance_is_the_centred_product():
    cov = token_covariance(inputs())
    close(cov[MASK], [c for row in COV for c in row])


def test_the_selection_size_is_verls_max_int_ratio_n_1():
    assert selection_size(MASK, 2e-4) == 1 and selection_size(MASK, 0.4) == 2 and selection_size(MASK, 0.39) == 1
    assert selection_size(torch.ones(3, 100, dtype=torch.bool), 0.29) == int(0.29 * 300)  # 86: Python's rounding


# ------------------------------------------------------------------------------------------------ Clip-Cov


def test_clip_cov_leaves_out_the_unclipped_tokens_between_the_bounds():
    """lb 0.5 < Cov < ub 1.4 and left alone by the ratio's clip: (0,1) and (1,0); (0,0) is clipped, (1,1) clipped
    and above ub, (0,2) below lb. Ratio 0.4 of 5 tokens = 2 to leave out: both candidates, no draw to depend on."""
    x = inputs()
    per_token, metrics = clip_cov(x, clip_cov_ratio=0.4, clip_cov_lb=0.5, clip_cov_ub=1.4)
    loss, grad = token_mean_and_grad(per_token, x.logprobs)
    # (0,0): −A·(1 + ε) = −1.2, clipped; (0,2): −e^0.05; (1,1): −A·(1 − ε) = 0.8, clipped; (0,1), (1,0): 0
    close(per_token[MASK], [-1.2, 0.0, -math.exp(0.05), 0.0, 0.8])
    close(loss, (-1.2 - math.exp(0.05) + 0.8) / 5)
    close(grad, [[0.0, 0.0, -math.exp(0.05) / 5], [0.0, 0.0, 0.0]])  # only (0,2) trains: −A·ρ / 5
    close(metrics["cov_selected_frac"], 2 / 5)
    close(metrics["clip_frac_high"], 1 / 5)
    close(metrics["clip_frac_low"], 1 / 5)


def test_clip_cov_draws_its_tokens_with_the_generator_it_is_given():
    """One token to leave out (ratio 0.2 of 5) among the two candidates: the seed decides which, alike each time,
    and over many seeds each is drawn about half of the time; no other token ever is."""
    drawn = []
    for seed in range(200):
        per_token, metrics = clip_cov(
            inputs(generator=torch.Generator().manual_seed(seed)), clip_cov_ratio=0.2, clip_cov_lb=0.5, clip_cov_ub=1.4
        )
        again, _ = clip_cov(
            inputs(generator=torch.Generator().manual_seed(seed)), clip_cov_ratio=0.2, clip_cov_lb=0.5, clip_cov_ub=1.4
        )
        assert torch.equal(torch.where(MASK, per_token, 0), torch.where(MASK, again, 0))
        left_out = {tuple(i) for i in torch.nonzero(MASK & (per_token == 0)).tolist()}
        assert len(left_out) == 1 and left_out <= {(0, 1), (1, 0)}
        close(metrics["cov_selected_frac"], 1 / 5)
        drawn.append(left_out.pop())
    assert 70 < drawn.count((0, 1)) < 130


def test_clip_cov_with_no_candidate_is_ppo():
    """Bounds no covariance falls between: PPO's clipped surrogate, as the grpo loss with token_mean gives it."""
    x = inputs()
    per_token, metrics = clip_cov(x, clip_cov_lb=2.0, clip_cov_ub=3.0)
    loss, grad = token_mean_and_grad(per_token, x.logprobs)
    leaf = LOGP.clone().requires_grad_(True)
    ppo, _ = grpo_loss(leaf, LOGP - DELTA, None, ADV, MASK, loss_type="dapo")
    ppo.backward()
    expected = (-1.2 - math.exp(-0.2) - math.exp(0.05) + math.exp(0.1) + 0.8) / 5
    close(loss, expected)
    close(ppo, expected)
    close(grad, torch.where(MASK, leaf.grad, 0))
    assert metrics["cov_selected_frac"] == 0 and grad.abs().sum() > 0


def test_clip_cov_through_grpo_loss_and_the_config():
    objective = ObjectiveConfig(loss_type="clip_cov", loss_kwargs={"clip_cov_ratio": 0.4, "clip_cov_lb": 0.5,
                                                                   "clip_cov_ub": 1.4})  # fmt: skip
    assert objective.aggregation_in_use == "token_mean"
    leaf = LOGP.clone().requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    loss, metrics = grpo_loss(leaf, LOGP - DELTA, None, ADV, MASK, loss_type=objective.loss_type,
                              loss_kwargs=objective.loss_kwargs, generator=generator)  # fmt: skip
    close(loss, (-1.2 - math.exp(0.05) + 0.8) / 5)
    close(metrics["clip_frac"], 2 / 5)  # the ratio's clip, low and high
    with pytest.raises(ConfigError, match=r"clip_cov_lb = 2.0 must be below clip_cov_ub = 1.5"):
        ObjectiveConfig(loss_type="clip_cov", loss_kwargs={"clip_cov_lb": 2.0, "clip_cov_ub": 1.5})
    with pytest.raises(ConfigError, match=r"clip_cov_lb = 6.0 must be below clip_cov_ub = 5.0"):
        ObjectiveConfig(loss_type="clip_cov", loss_kwargs={"clip_cov_lb": 6.0})  # against the default ub
    ObjectiveConfig(loss_type="clip_cov", loss_kwargs={"clip_cov_ub": math.inf})  # no upper bound


# ------------------------------------------------------------------------------------------------- KL-Cov


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    """Ratio 0.4 of 5 tokens: the 2 of largest covariance, (1,1) 1.536 and (0,0) 1.296, get 0.5·|δ| added, the
    others keep −A·ρ, unclipped (KL-Cov has no clip: (0,0)'s ρ 1.284 trains in full)."""
    x = inputs()
    per_token, metrics = kl_cov(x, kl_cov_ratio=0.4, ppo_kl_coef=0.5)
    loss, grad = token_mean_and_grad(per_token, x.logprobs)
    e = math.exp
    expected = [-e(0.25) + 0.5 * 0.25, -e(-0.2), -e(0.05), e(0.1), e(-0.3) + 0.5 * 0.3]
    close(per_token[MASK], expected)
    close(loss, sum(expected) / 5)
    # d/dlog π_θ: −A·ρ, and 0.5·sign(δ) on the penalised tokens
    close(grad, [[(-e(0.25) + 0.5) / 5, -e(-0.2) / 5, -e(0.05) / 5], [e(0.1) / 5, (e(-0.3) - 0.5) / 5, 0.0]])
    close(metrics["cov_selected_frac"], 2 / 5)
    close(metrics["abs_log_ratio"], (0.25 + 0.2 + 0.05 + 0.1 + 0.3) / 5)
    # verl's default ratio, 2e-4: one token, the largest covariance's
    per_token, _ = kl_cov(inputs(), ppo_kl_coef=0.5)
    close(per_token[MASK], [-e(0.25), -e(-0.2), -e(0.05), e(0.1), e(-0.3) + 0.5 * 0.3])


def test_kl_cov_is_the_policy_gradient_at_ratio_one():
    """On-policy (a round's first step) |log ρ| = 0 with gradient 0: the plain policy gradient −A per token."""
    x = inputs(on_policy=True)
    per_token, metrics = kl_cov(x, kl_cov_ratio=1.0, ppo_kl_coef=10.0)
    loss, grad = token_mean_and_grad(per_token, x.logprobs)
    close(loss, (-3 + 2) / 5)
    close(grad, [[-0.2, -0.2, -0.2], [0.2, 0.2, 0.0]])
    close(metrics["cov_selected_frac"], 1.0)


# ------------------------------------------------------------------------------------- both: micro-batches


@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
def test_the_selection_is_of_the_micro_batch_as_in_verl(loss_type):
    """The covariance's means and the number of tokens are the call's: split into one row per micro-batch, the
    step differs from the whole batch's (the registry says so; the invariance test of test_losses.py skips them)."""
    assert get_policy_loss(loss_type).micro_batch_statistics
    settings = {"clip_cov": {"clip_cov_ratio": 0.4, "clip_cov_lb": 0.5, "clip_cov_ub": 1.4},
                "kl_cov": {"kl_cov_ratio": 0.4, "ppo_kl_coef": 0.5}}[loss_type]  # fmt: skip
    grads = []
    for rows in (2, 1):
        leaf = LOGP.clone().requires_grad_(True)
        total = sum(
            grpo_loss(leaf[s : s + rows], (LOGP - DELTA)[s : s + rows], None, ADV[s : s + rows], MASK[s : s + rows],
                      loss_type=loss_type, loss_kwargs=settings, num_items=5,
                      generator=torch.Generator().manual_seed(0))[0]
            for s in range(0, 2, rows)
        )  # fmt: skip
        total.backward()
        grads.append(torch.where(MASK, leaf.grad, 0))
    assert float((grads[0] - grads[1]).abs().max()) > 1e-3


def test_kl_cov_takes_no_clip_setting():
    with pytest.raises(ConfigError, match="epsilon_low is not a setting of loss_type 'kl_cov'"):
        ObjectiveConfig(loss_type="kl_cov", epsilon_low=0.2)
    assert ObjectiveConfig(loss_type="kl_cov", loss_kwargs={"kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0})
