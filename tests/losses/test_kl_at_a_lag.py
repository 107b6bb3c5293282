"""The importance-weighted KL term against the exact KL, on tokens a sampler μ drew (issue 39, point 3).

Known categorical distributions over a five-token vocabulary stand in for μ (the sampler: an older policy at a
rollout lag, or vLLM's kernels), π_old, π_θ and π_ref. Many tokens are drawn from μ with a fixed seed and fed to
``grpo_loss`` with zero advantages (the policy term vanishes), so the loss is β times the mean of the KL term's
per-token values. Their mean, and the gradient of the mean with respect to π_θ's logits, are compared with the exact
KL(π_θ ‖ π_ref) and its gradient within five standard errors (over 20 independent chunks of draws): at lag 0 and at
a lag, token and sequence level, and the expectations ``losses/kl.py`` states for truncated, masked and unweighted
behaviour weights. The weighting by π_θ/π_old alone (what ``kl_importance_weighted`` did before) misses the KL at a
lag by far more than that tolerance.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.losses import grpo_loss

D = torch.float64
MU = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08], dtype=D)  # the sampler at a lag: π_old / μ from 0.375 to 3.125
OLD = torch.tensor([0.15, 0.20, 0.25, 0.15, 0.25], dtype=D)
THETA = torch.tensor([0.10, 0.20, 0.25, 0.15, 0.30], dtype=D)
REF = torch.tensor([0.40, 0.25, 0.15, 0.15, 0.05], dtype=D)
BETA = 0.5
CHUNKS, TOKENS = 20, 100_000  # 2M draws; a chunk's mean is one sample of the estimator's mean
NO_TRUNCATION = 1e6  # a cap no weight reaches: the weights π_old / μ as they are


def k_of(estimator: str, theta: torch.Tensor) -> torch.Tensor:
    """Each token's estimator value k(y) at π_θ = ``theta`` (d = log π_ref − log π_θ)."""
    d = REF.log() - theta.log()
    return {"k1": -d, "k2": d.pow(2) / 2, "k3": d.exp() - d - 1}[estimator]


def exact_kl(theta: torch.Tensor) -> torch.Tensor:
    return (theta * (theta.log() - REF.log())).sum()


def draws(sampler: torch.Tensor, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.multinomial(sampler, TOKENS, replacement=True, generator=g) for _ in range(CHUNKS)]


def kl_term(sampler: torch.Tensor, *, seed: int = 0, width: int = 4, engine: bool = True, **settings):
    """Per chunk of draws from ``sampler``: the KL term's mean value and its gradient with respect to π_θ's
    logits (``[CHUNKS]``, ``[CHUNKS, V]``). ``engine``: the sampler's log-probs go in as ``engine_logprobs`` (else
    the trainer is taken to have sampled, as before this fix at a lag); ``width``: tokens per completion."""
    settings = {"loss_type": "dapo", "kl_estimator": "k3", "tis_cap": NO_TRUNCATION, **settings}
    values, grads = [], []
    for tokens in draws(sampler, seed):
        logits = THETA.log().clone().requires_grad_(True)
        logp = torch.log_softmax(logits, dim=0)[tokens].view(-1, width)
        rows = logp.shape[0]
        loss, _ = grpo_loss(
            logp,
            OLD.log()[tokens].view(-1, width),
            REF.log()[tokens].view(-1, width),
            torch.zeros(rows, dtype=D),  # A = 0: no policy term
            torch.ones(rows, width, dtype=torch.bool),
            beta=BETA,
            kl_importance_weighted=True,
            engine_logprobs=sampler.log()[tokens].view(-1, width) if engine else None,
            **settings,
        )
        loss.backward()
        values.append(loss.detach() / BETA)
        grads.append(logits.grad / BETA)
    return torch.stack(values), torch.stack(grads)


def tolerance_of(samples: torch.Tensor) -> float:
    """5 standard errors of the chunks' mean (the largest over the components)."""
    return float(5 * samples.std(dim=0).max() / CHUNKS**0.5)


def assert_mean(samples: torch.Tensor, expected: torch.Tensor) -> None:
    """The chunks' mean equals ``expected`` within 5 standard errors, a tolerance of 2% of it at most (the draws
    are enough to tell apart what the tests claim)."""
    tolerance = tolerance_of(samples)
    assert tolerance < 0.02 * float(expected.abs().max()), (tolerance, expected)
    torch.testing.assert_close(samples.mean(dim=0), expected, atol=tolerance, rtol=0)


def assert_misses(samples: torch.Tensor, expected: torch.Tensor) -> None:
    """The chunks' mean is off ``expected`` by more than 10 times the tolerance ``assert_mean`` allows."""
    miss = float((samples.mean(dim=0) - expected).abs().max())
    assert miss > 10 * tolerance_of(samples), (miss, tolerance_of(samples))


def exact_gradient(expectation) -> torch.Tensor:
    """d/d logits of ``expectation(π_θ)``, π_θ = softmax(logits), at the test's π_θ."""
    logits = THETA.log().clone().requires_grad_(True)
    expectation(torch.softmax(logits, dim=0)).backward()
    return logits.grad


def expected_weighted(weight: torch.Tensor):
    """π_θ ↦ Σ_y μ(y) · π_θ(y)/π_old(y) · weight(y) · k3(y): the expectation of ρ·w·k3 under μ, w held fixed."""
    return lambda theta: (MU * theta / OLD * weight * k_of("k3", theta)).sum()


# ------------------------------------------------------------------------------------------------ lag 0
@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("engine", [False, True], ids=["trainer-sampled", "engine-logprobs-of-pi-old"])
def test_at_lag_0_the_weighted_kl_estimates_the_kl_and_its_gradient(estimator, engine):
    values, grads = kl_term(OLD, seed=1, engine=engine, kl_estimator=estimator)
    assert_mean(values, exact_kl(THETA))
    assert_mean(grads, exact_gradient(exact_kl))


# ------------------------------------------------------------------------------------------------ a lag
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_at_a_lag_the_weight_from_the_sampler_estimates_the_kl_and_pi_old_alone_misses_it(estimator):
    values, grads = kl_term(MU, seed=2, kl_estimator=estimator)
    assert_mean(values, exact_kl(THETA))
    assert_mean(grads, exact_gradient(exact_kl))

    stale, stale_grads = kl_term(MU, seed=2, engine=False, kl_estimator=estimator)  # π_θ/π_old only
    assert_misses(stale, exact_kl(THETA))
    assert_misses(stale_grads, exact_gradient(exact_kl))
    # ... because it estimates π_θ's KL reweighted by μ/π_old instead.
    assert_mean(stale, (MU * THETA / OLD * k_of(estimator, THETA)).sum())


def test_k2_is_weighted_alike_and_estimates_its_own_expectation_under_pi_theta():
    values, _ = kl_term(MU, seed=3, kl_estimator="k2")
    own = (THETA * k_of("k2", THETA)).sum()  # E_π_θ[d²/2]: not the KL, by k2's construction
    assert_mean(values, own)
    assert_misses(values, exact_kl(THETA))


@pytest.mark.parametrize("tis_level", ["token", "sequence"])
def test_at_sequence_level_one_token_completions_estimate_the_kl_too(tis_level):
    """GSPO's s_i is the token's own ratio for a one-token completion: the same unbiased estimate at a lag, with
    the behaviour weight at either level (the product over one token is the token's)."""
    settings = {"importance_sampling_level": "sequence", "tis_level": tis_level}
    values, grads = kl_term(MU, seed=4, width=1, **settings)
    assert_mean(values, exact_kl(THETA))
    assert_mean(grads, exact_gradient(exact_kl))
    stale, _ = kl_term(MU, seed=4, width=1, engine=False, **settings)
    assert_misses(stale, exact_kl(THETA))
    gmpo, _ = kl_term(MU, seed=4, width=1, loss_type="gmpo")  # a loss whose ratio is the sequence's
    assert_mean(gmpo, exact_kl(THETA))


# ------------------------------------------------------------------- what truncated or no weights estimate
def test_truncated_masked_and_absent_behaviour_weights_estimate_what_kl_py_says():
    cap = 2.0  # π_old / μ is 3.125 for the last token (truncated to 2, or masked), 0.375 for the first (masked)
    ratio = OLD / MU
    cases = {
        "truncate": (dict(tis_cap=cap), torch.clamp(ratio, max=cap)),
        "mask": (dict(tis_cap=cap, tis_mode="mask"), torch.where((ratio > cap) | (ratio < 1 / cap), 0.0, ratio)),
        "none": (dict(tis_cap=None), torch.ones_like(ratio)),  # weights of 1: π_θ/π_old alone
    }
    truncated = (THETA * torch.clamp(cap * MU / OLD, max=1.0) * k_of("k3", THETA)).sum()
    assert torch.allclose(expected_weighted(cases["truncate"][1])(THETA), truncated)  # the docstring's form
    for settings, weight in cases.values():
        values, grads = kl_term(MU, seed=5, **settings)
        assert_mean(values, expected_weighted(weight)(THETA))
        assert_mean(grads, exact_gradient(expected_weighted(weight)))
        assert_misses(values, exact_kl(THETA))  # none of them is the KL


# ---------------------------------------------------------------------------------- the gradient, per token
def test_the_behaviour_weight_scales_the_token_ratios_gradient_and_carries_none():
    """d(ρ·w·k3)/d log π_θ = w·(ρ·k3 + ρ·(1 − e^d)), token by token: the gradient of the token ratio (and of k3),
    with w = π_old/μ a constant."""
    g = torch.Generator().manual_seed(6)
    tokens = torch.multinomial(MU, 64, replacement=True, generator=g).view(8, 8)
    logp = THETA.log()[tokens].clone().requires_grad_(True)
    old, ref, engine = OLD.log()[tokens], REF.log()[tokens], MU.log()[tokens]
    mask, settings = torch.ones(8, 8, dtype=torch.bool), {"loss_type": "dapo", "tis_cap": NO_TRUNCATION}
    loss, _ = grpo_loss(logp, old, ref, torch.zeros(8, dtype=D), mask, beta=1.0, kl_importance_weighted=True,
                        engine_logprobs=engine, **settings)  # fmt: skip
    loss.backward()
    rho, w, d = (logp - old).exp(), (old - engine).exp(), ref - logp
    k3 = d.exp() - d - 1
    torch.testing.assert_close(loss, (w * rho * k3).mean().detach())
    torch.testing.assert_close(logp.grad, (w * (rho * k3 + rho * (1 - d.exp())) / 64).detach())
