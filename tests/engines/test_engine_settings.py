"""What the data side takes from the engine's settings, before and during training.

π_old under filtered sampling: an engine's ``logprobs`` are those of the distribution it sampled (tempered, top-k /
top-p filtered, EOS banned before ``min_new_tokens``, renormalised; ``engines/base.py``), which is not the policy's
when a filter is on; lean and transformers also give the policy's (``policy_logprobs``), which are π_old without a
pass. An engine that gives only the former is recomputed (``auto``) or refused (``sampler``). And an engine's context
shorter than the model's (vLLM's ``max_model_len``) is checked against the prompts before training.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import attach, length_reward

from grpo_lightning import GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError, ScheduleConfig, UpdateConfig
from grpo_lightning.config_checks import check_weights_can_leave
from grpo_lightning.engines import LeanEngine
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.round import run_round

register("test_filtered_length")(length_reward)


FILTERS = [{"top_k": 5}, {"top_p": 0.8}, {"min_new_tokens": 2}]


class FilteredOnly(LeanEngine):
    """An engine that gives only its sampling distribution's log-probs (as vLLM does): no policy log-probs."""

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        out.policy_logprobs = None
        return out


def round_with(tmp_path, engine, old_logprobs="auto", **filters):
    """One round of μ = 2 (π_old needed): what the round asked of the module (π_old passes) and its rollout."""
    module = GRPOModule(tiny_model=TINY)
    data = RolloutDataModule(
        engine=engine,
        rewards=[RewardSpec("test_filtered_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6, temperature=0.7, **filters),
        update=UpdateConfig(num_iterations=2, old_logprobs=old_logprobs),
        prompts_per_round=2,
    )
    attach(module, data, quiet_trainer(tmp_path))
    module.configure_model()
    asked = []

    def logprobs(batch, *, old, ref):
        asked.append(old)
        return module.rollout_logprobs(batch, old=old, ref=ref)

    batch = run_round(
        lambda: {"prompt": ["1+2=", "33+4="]},
        engine=data.collector.current_engine(),
        encoder=data.encoder(),
        scorer=data.scorer,
        logprobs=logprobs,
        settings=data.collector.round_settings(),
        generator=torch.Generator().manual_seed(0),
    )
    return module, batch, asked


@pytest.mark.parametrize("filters", [{}, *FILTERS], ids=lambda f: next(iter(f), "none"))
@pytest.mark.parametrize("old_logprobs", ["auto", "sampler"])
def test_the_samplers_policy_logprobs_are_pi_old_also_under_filters(tmp_path, filters, old_logprobs):
    """lean returns both: the filtered distribution's log-probs (μ) and the tempered policy's, which are π_old:
    no recompute pass, and the same values as one."""
    module, batch, asked = round_with(tmp_path, LeanEngine(), old_logprobs, **filters)
    assert asked == [False]
    recomputed, _ = module.rollout_logprobs(batch, old=True, ref=False)
    torch.testing.assert_close(batch.old_logprobs, recomputed, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: next(iter(f)))
def test_an_engine_without_policy_logprobs_is_recomputed_under_filters_and_refused_for_sampler(tmp_path, filters):
    module, batch, asked = round_with(tmp_path, FilteredOnly(), "auto", **filters)
    assert asked == [True]  # recomputed
    recomputed, _ = module.rollout_logprobs(batch, old=True, ref=False)
    torch.testing.assert_close(batch.old_logprobs, recomputed, atol=1e-6, rtol=1e-6)
    with pytest.raises(
        ConfigError, match="data.update.old_logprobs: sampler, but the engine returned no log-probs of the"
    ):
        round_with(tmp_path, FilteredOnly(), "sampler", **filters)


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
    with pytest.raises(
        ConfigError,
        match=r"max_new_tokens=8 exceed the short engine's limit \(data.engine.init_args"
        r".limit\) of 12 tokens; shorten the prompts or lower max_new_tokens, or raise it",
    ):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0 and not data.engine.is_setup  # refused before any rollout


class ZeRO3(SimpleNamespace):
    """What the data side reads of Lightning's ``DeepSpeedStrategy`` at stage 3 (DeepSpeed itself is CUDA-only)."""

    zero_stage_3 = True


@pytest.mark.parametrize(
    ("engine", "lag", "refused"),
    [("vllm_server", 0, "data.engine vllm_server holds its own copy"), ("lean", 1, "data.schedule.rollout_lag > 0")],
)
def test_deepspeed_zero3_weights_are_refused_where_they_must_leave_the_trainer(engine, lag, refused):
    """ZeRO-3 partitions every weight: an engine with its own copy, or a background process at a lag, would be sent
    empty placeholders. Refused when the data is set up (before any model is built); the built-in engine at lag 0,
    which samples from the trainer's own (gathered) weights, is not."""
    data = RolloutDataModule(
        engine=engine, schedule=ScheduleConfig(rollout_lag=lag), val_split=None, task_kwargs={"test_size": 20}
    )
    data.trainer = SimpleNamespace(strategy=ZeRO3(), accumulate_grad_batches=1, lightning_module=None)
    message = rf"^trainer.strategy: DeepSpeed ZeRO-3 partitions the weights, and {refused}"
    with pytest.raises(ConfigError, match=message):
        data.setup("fit")
    assert data.train_data is None  # before the prompts, let alone the model
    check_weights_can_leave(ZeRO3(), LeanEngine(), 0)  # sampled from the trainer's own weights: accepted
    check_weights_can_leave(SimpleNamespace(), data.engine, lag)  # another strategy: accepted


def test_partitioned_weights_never_leave_one_by_one():
    from grpo_lightning.engines.weights import policy_weights
    from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

    model = build_tiny_llama(TINY, build_char_tokenizer())
    next(model.parameters()).ds_id = 0  # how ZeRO-3 marks a partitioned parameter
    with pytest.raises(RuntimeError, match="ZeRO-3 weights are partitioned"):
        next(policy_weights(model))
