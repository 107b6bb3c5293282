"""Truncated importance sampling (``loss.truncated_importance_weights``, ``grpo_loss(engine_logprobs=...)``).

An engine that is not the trainer (vLLM) samples from its own rounding of π_old; the surrogate of every token is
weighted by min(π_old_trainer / π_engine, C) (token level) or by the capped product over the completion
(sequence level). Hand-computed values first, then an engine whose copy of the weights is deliberately noisy.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from engine_contract import check_a_perturbed_engine_is_caught, importance_weights_of

from grpo_lightning.engines import TransformersEngine
from grpo_lightning.importance import truncated_importance_weights
from grpo_lightning.losses import grpo_loss

# Trainer and engine probabilities of 3 tokens of one completion, and a second completion with one real token.
TRAINER = torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.7, 0.7]]).log()
ENGINE = torch.tensor([[0.25, 0.4, 0.3], [0.6, 0.1, 0.1]]).log()
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_token_level_weights_and_metrics_by_hand():
    weights, metrics = truncated_importance_weights(TRAINER, ENGINE, MASK, cap=2.0, level="token")
    # ratios 2, 0.5, 3 | 0.5 (padding ignored) → capped at 2: 2, 0.5, 2 | 0.5
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 2.0], [0.5, 0.0, 0.0]]))
    ratios = [2.0, 0.5, 3.0, 0.5]
    assert metrics["tis_truncated_frac"].item() == pytest.approx(1 / 4)  # only 3 > C (2 is not above it)
    assert metrics["tis_weight_mean"].item() == pytest.approx(5.0 / 4)
    assert metrics["mismatch_abs_logprob"].item() == pytest.approx(sum(abs(math.log(r)) for r in ratios) / 4)
    assert metrics["mismatch_kl"].item() == pytest.approx(sum(r - math.log(r) - 1 for r in ratios) / 4)


def test_sequence_level_weights_are_the_capped_product_of_the_token_ratios():
    weights, metrics = truncated_importance_weights(TRAINER, ENGINE, MASK, cap=2.0, level="sequence")
    # completion 1: 2 · 0.5 · 3 = 3 → 2 on each of its tokens; completion 2: 0.5
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 2.0], [0.5, 0.0, 0.0]]))
    assert metrics["tis_truncated_frac"].item() == pytest.approx(1 / 2)  # of completions


def test_no_cap_keeps_the_weights_at_one_and_still_measures():
    weights, metrics = truncated_importance_weights(TRAINER, ENGINE, MASK, cap=None)
    torch.testing.assert_close(weights, MASK.float())
    assert metrics["tis_truncated_frac"].item() == 0 and metrics["mismatch_kl"].item() > 0


def test_grpo_loss_weights_each_tokens_surrogate_and_gradient():
    """On-policy (ρ = 1), one advantage A: loss = −A · mean over tokens of the weights (grpo: per completion, then
    over completions); the gradient of each token's log-prob is −A · w / |o|."""
    logprobs = TRAINER.clone().requires_grad_(True)
    advantages = torch.tensor([1.5, -2.0])
    loss, metrics = grpo_loss(
        logprobs, None, None, advantages, MASK, beta=0.0, engine_logprobs=ENGINE, tis_cap=2.0, loss_type="grpo"
    )
    expected = -(1.5 * (2.0 + 0.5 + 2.0) / 3 + -2.0 * 0.5 / 1) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[-1.5 * 2 / 3, -1.5 * 0.5 / 3, -1.5 * 2 / 3], [2.0 * 0.5, 0, 0]]) / 2
    )
    assert metrics["tis_weight_mean"].item() == pytest.approx(5.0 / 4)
    plain, plain_metrics = grpo_loss(TRAINER, None, None, advantages, MASK, beta=0.0, loss_type="grpo")
    assert "tis_weight_mean" not in plain_metrics  # an engine that is the trainer: no weights, no such metrics


def test_a_perturbed_engine_raises_the_mismatch_and_pulls_weights_below_one_where_it_overrates(tiny_llama, tokenizer):
    """An engine on a noisy copy of the policy (the mistake TIS guards against: vLLM's weights or kernels off):
    its log-probs disagree with the trainer's, the metrics rise far above a faithful engine's, and each token's
    weight is below 1 exactly where the engine gave the token more probability than the trainer."""
    noisy = copy.deepcopy(tiny_llama)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn_like(parameter))
    faithful = importance_weights_of(make_engine(tiny_llama, tokenizer), tiny_llama, tokenizer)[3]
    assert faithful["mismatch_abs_logprob"] < 1e-5 and faithful["mismatch_kl"] < 1e-9  # float32 rounding
    check_a_perturbed_engine_is_caught(
        faithful, importance_weights_of(make_engine(noisy, tokenizer), tiny_llama, tokenizer)
    )


def make_engine(model: torch.nn.Module, tokenizer) -> TransformersEngine:
    engine = TransformersEngine()
    engine.setup(model, tokenizer)
    return engine
