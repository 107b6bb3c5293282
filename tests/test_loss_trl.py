"""Our ``grpo_loss`` against TRL 1.16's ``GRPOTrainer._compute_loss`` on the same log-probs, advantages and masks.

TRL's method is run as it is, on a stand-in for the trainer that holds only the settings the loss reads; its
forward (``_get_per_token_logps_and_entropies``) returns the log-probs given here. Loss values and the gradients
with respect to the current log-probs must agree to 1e-6 (float64 inputs, so that the tolerance measures the
formulas, not rounding), for every loss both libraries have: grpo, bnpo, dr_grpo, dapo, GSPO (sequence-level
ratio), with clip-higher, INTELLECT-2's delta and the k3 KL. Settings map one to one: ``epsilon_low/high``,
``delta``, ``beta``, ``importance_sampling_level``, ``max_completion_length``; DAPO's ``num_items`` is TRL's
``num_items_in_batch`` (one process, no accumulation).
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.loss import grpo_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl (a dev dependency) is not installed")

B, T = 6, 7


class OneProcess:
    """Accelerate's collectives on one process: identities."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(logprobs, old, ref, advantages, mask, *, loss_type, eps_low, eps_high, delta, beta, level, max_len):
    """TRL's loss and its gradient with respect to ``logprobs``."""
    current = logprobs.detach().clone().requires_grad_(True)
    stand_in = SimpleNamespace(
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        importance_sampling_level=level,
        max_completion_length=max_len,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        accelerator=OneProcess(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=False, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (current, torch.zeros_like(current), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().to(torch.float64),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), current.grad


def batch(seed: int):
    """Log-probs with ratios well inside and outside the clip range, mixed-sign advantages, uneven lengths (one
    row empty)."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logprobs + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    ref = logprobs + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([T, 3, 1, 0, 5, T])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logprobs, old, ref, advantages, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    "eps_low, eps_high, delta, beta",
    [(0.2, 0.2, None, 0.0), (0.2, 0.28, None, 0.04), (0.2, 0.28, 1.5, 0.1)],
    ids=["grpo", "clip-higher+kl", "delta+kl"],
)
def test_loss_and_gradient_equal_trls(loss_type, level, eps_low, eps_high, delta, beta):
    logprobs, old, ref, advantages, mask = batch(seed=zlib.crc32(f"{loss_type}{level}{delta}{beta}".encode()))
    if level == "sequence":  # GSPO's ratios sit close to 1: a clip range its paper uses
        eps_low, eps_high = 3e-4, 4e-4
    expected, expected_grad = trl_loss(
        logprobs, old, ref, advantages, mask, loss_type=loss_type, eps_low=eps_low, eps_high=eps_high,
        delta=delta, beta=beta, level=level, max_len=T,
    )  # fmt: skip
    current = logprobs.clone().requires_grad_(True)
    ours, _ = grpo_loss(
        current, old, ref if beta else None, advantages, mask, loss_type=loss_type, epsilon_low=eps_low,
        epsilon_high=eps_high, delta=delta, beta=beta, importance_sampling_level=level, max_completion_length=T,
        num_items=int(mask.sum()),
    )  # fmt: skip
    ours.backward()
    torch.testing.assert_close(ours.detach(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(current.grad, expected_grad, atol=1e-6, rtol=0)
    assert expected_grad.abs().sum() > 0  # the case trains something


def test_the_cross_check_catches_a_different_formula():
    """The stand-in really runs TRL's formula: a different clip range gives a different loss."""
    logprobs, old, ref, advantages, mask = batch(seed=1)
    settings = dict(loss_type="grpo", delta=None, beta=0.0, level="token", max_len=T)
    narrow, _ = trl_loss(logprobs, old, ref, advantages, mask, eps_low=0.2, eps_high=0.2, **settings)
    wide, _ = trl_loss(logprobs, old, ref, advantages, mask, eps_low=0.2, eps_high=10.0, **settings)
    assert abs(float(narrow - wide)) > 1e-3
