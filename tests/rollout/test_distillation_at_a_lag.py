"""The distillation advantage λ · (log π_T − log π_S) takes π_S, the student's unfiltered distribution, at every lag
and off-policy correction (``rollout/round.py: finish_round``): with ``off_policy_correction: behaviour`` at a lag,
π_old is μ, the sampler's filtered distribution (top-p / top-k / the EOS ban: log μ ≥ log π), which would bias the
teacher's advantage low; π_S is then the student's own pass (π_prox), as with the other corrections.

The log-probs are made up: μ (the engine's), π_prox (the trainer's pass) and π_T (the teacher's) differ everywhere.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.round import RoundSettings, SampledRound, finish_round

N, T = 4, 3
MU, PROX, TEACHER = -0.1, -0.7, -0.5  # log μ ≥ log π: the filtered sampler's is the larger


def sampled() -> SampledRound:
    mask = torch.ones(N, T, dtype=torch.long)
    batch = RolloutBatch(
        prompt_ids=torch.ones(N, 2, dtype=torch.long),
        prompt_mask=torch.ones(N, 2, dtype=torch.long),
        completion_ids=torch.ones(N, T, dtype=torch.long),
        completion_mask=mask,
        truncated=torch.zeros(N, dtype=torch.bool),
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        reward_columns={"r": [1.0, 0.0, 1.0, 0.0]},
        engine_logprobs=torch.full((N, T), MU),
    )
    batch.unscorable = torch.zeros(N, dtype=torch.bool)
    return SampledRound(batch)


@pytest.mark.parametrize("lag,correction", [(1, "behaviour"), (1, "decoupled"), (1, "none"), (2, "behaviour")])
def test_the_teachers_advantage_takes_the_students_own_log_probs_at_every_lag(lag, correction):
    """Issue 50 item 6: at a lag with ``behaviour`` the teacher's gap was log π_T − log μ (−0.4 here); it is
    log π_T − log π_S (+0.2), as with ``decoupled`` and ``none``; π_old for the ratio stays μ with ``behaviour``."""
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=2),
        advantage=AdvantageConfig(scale="none"),
        optimizer_steps=1,
        reference=False,
        rollout_lag=lag,
        correction=correction,
        teacher_weight=1.0,
    )
    asked = {}

    def logprobs(batch, *, old, ref):
        asked["old"] = old
        return (torch.full((N, T), PROX) if old else None), None

    out = finish_round(
        sampled(), logprobs=logprobs, settings=settings, teacher=lambda batch: torch.full((N, T), TEACHER)
    )
    assert asked["old"]  # the student's own pass ran
    outcome = torch.tensor([0.5, -0.5, 0.5, -0.5])[:, None]  # scale none: r − mean
    torch.testing.assert_close(out.advantages, (outcome + (TEACHER - PROX)).expand(N, T))
    assert out.metrics["distill/reverse_kl_k1"] == pytest.approx(PROX - TEACHER)
    expected_old = MU if correction == "behaviour" else PROX  # the ratio's π_old: μ itself with behaviour
    torch.testing.assert_close(out.old_logprobs, torch.full((N, T), expected_old))
