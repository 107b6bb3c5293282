"""What the data side takes from the engine's settings, before and during training.

π_old under filtered sampling: the engine's log-probs are those of the distribution it sampled (tempered, top-k /
top-p filtered, EOS banned before ``min_new_tokens``, renormalised; ``engines/base.py``), which is not the policy's
when a filter is on. ``old_logprobs: auto`` then recomputes π_old, and ``sampler`` is refused. And an engine's
context shorter than the model's (vLLM's ``max_model_len``) is checked against the prompts before training."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, quiet_trainer

from grpo_lightning import GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError
from grpo_lightning.engines import LeanEngine
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.round import run_round


@register("test_filtered_length")
def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


FILTERS = [{"top_k": 5}, {"top_p": 0.8}, {"min_new_tokens": 2}]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: next(iter(f)))
def test_sampler_is_refused_with_a_filter(filters):
    with pytest.raises(ConfigError, match=r"^data.old_logprobs: sampler takes π_old from the engine's log-probs.*"
                       r"use auto or recompute"):
        RolloutDataModule(sampling=SamplingConfig(group_size=2, max_new_tokens=4, **filters), old_logprobs="sampler")


@pytest.mark.parametrize("filters", [{}, *FILTERS], ids=lambda f: next(iter(f), "none"))
def test_auto_takes_the_engines_logprobs_only_when_they_are_the_policys(tmp_path, filters):
    module = GRPOModule(tiny_model=TINY)
    data = RolloutDataModule(
        rewards=[RewardSpec("test_filtered_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6, temperature=0.7, **filters),
        num_iterations=2,
        prompts_per_round=2,
    )
    data.trainer = quiet_trainer(tmp_path)
    data.trainer.strategy.connect(module)
    module.configure_model()
    engine = data.engine.get(module)
    asked = []

    def logprobs(batch, *, old, ref):
        asked.append(old)
        return module.rollout_logprobs(batch, old=old, ref=ref)

    batch = run_round(
        lambda: {"prompt": ["1+2=", "33+4="]},
        engine=engine,
        encoder=data.encoder(),
        scorer=data.scorer,
        logprobs=logprobs,
        settings=data.round_settings(),
        generator=torch.Generator().manual_seed(0),
    )
    assert asked == [bool(filters)]  # recomputed exactly when a filter is on
    recomputed, _ = module.rollout_logprobs(batch, old=True, ref=False)
    torch.testing.assert_close(batch.old_logprobs, recomputed, atol=1e-5, rtol=1e-5)
    if filters:  # why: the engine's own log-probs of the same tokens are the renormalised ones
        out = engine.generate(
            batch.prompt_ids[::4],
            batch.prompt_mask[::4],
            data.sampling.params(),
            generator=torch.Generator().manual_seed(0),
            return_logprobs=True,
        )
        mask = out.completion_mask.bool()
        assert torch.equal(out.completion_ids, batch.completion_ids[:, : out.completion_ids.size(1)])
        assert (out.logprobs[mask] - recomputed[:, : mask.size(1)][mask]).abs().max() > 1e-3


class ShortContextEngine(LeanEngine):
    """An engine that takes 12 tokens of prompt + completion at most (as vLLM with ``max_model_len: 12``)."""

    context_name = "the short engine's limit (data.engine.init_args.limit)"

    def max_context(self, model_context):
        return 12


def test_an_engines_context_shorter_than_the_data_needs_is_refused_before_training(tmp_path):
    module = GRPOModule(tiny_model=TINY)
    data = RolloutDataModule(
        engine=ShortContextEngine(),
        rewards=[RewardSpec("test_filtered_length")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=8),
        prompts_per_round=2,
        task_kwargs={"test_size": 10},
    )
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    with pytest.raises(ConfigError, match=r"max_new_tokens=8 exceed the short engine's limit \(data.engine.init_args"
                       r".limit\) of 12 tokens; shorten the prompts or lower max_new_tokens, or raise it"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0 and not data.engine.engine.is_setup  # refused before any rollout
