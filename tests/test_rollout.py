"""The rollout round inside Lightning: one rollout → μ × mini-batches optimizer steps, exact prompt count."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, quiet_trainer
from lightning import Callback

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.batch import RolloutBatch


@register("test_length")
def length_reward(prompts, completions, **_):
    """Rewards with spread even for a random model: the completion's length."""
    return [float(len(c)) for c in completions]


@register("test_gated_digits")
def gated_digits(prompts, completions, **_):
    """Digits in the completion for prompts starting with 7 or 9, else 0: other groups are uninformative."""
    return [float(sum(ch.isdigit() for ch in c)) if p[0] in "79" else 0.0 for p, c in zip(prompts, completions)]


class Recorder(Callback):
    def __init__(self):
        self.steps_per_epoch, self.positions, self.batch_rows = [], [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batch_rows.append(batch["completion_ids"].shape[0])

    def on_train_epoch_end(self, trainer, module):
        self.steps_per_epoch.append(trainer.global_step)
        self.positions.append(trainer.datamodule.position)


def make(tmp_path, *, mu=1, beta=0.04, prompts=4, group=4, mini=None, micro=None, accumulate=1, epochs=2):
    module = GRPOModule(
        tiny_model=TINY,
        rewards=[RewardSpec("test_length")],
        sampling=SamplingConfig(group_size=group, max_new_tokens=4),
        objective=ObjectiveConfig(beta=beta, num_iterations=mu),
        lr=1e-3,
    )
    data = RolloutDataModule(
        prompts_per_round=prompts,
        mini_batch_size=mini,
        micro_batch_size=micro,
        val_limit=8,
        task_kwargs={"test_size": 50},
    )
    recorder = Recorder()
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=epochs,
        callbacks=[recorder],
        accumulate_grad_batches=accumulate,
    )
    return module, data, trainer, recorder


@pytest.mark.parametrize("mu,mini,micro,accumulate", [(1, None, None, 1), (2, 8, None, 1), (2, 8, 4, 2), (1, 4, 2, 2)])
def test_optimizer_steps_per_round(tmp_path, mu, mini, micro, accumulate):
    module, data, trainer, rec = make(tmp_path, mu=mu, mini=mini, micro=micro, accumulate=accumulate)
    trainer.fit(module, datamodule=data)
    rollout = 4 * 4
    steps_per_round = mu * rollout // (mini or rollout)
    assert rec.steps_per_epoch == [steps_per_round, 2 * steps_per_round]
    assert set(rec.batch_rows) == {micro or mini or rollout}
    assert rec.positions == [4, 8]  # exactly prompts_per_round consumed per round


def test_old_logprobs_only_when_mu_above_one_and_ref_only_when_beta(tmp_path):
    module, data, trainer, _ = make(tmp_path, mu=1, beta=0.0, epochs=1)
    trainer.fit(module, datamodule=data)
    assert module.ref is None
    assert data.last_rollout.old_logprobs is None and data.last_rollout.ref_logprobs is None
    module, data, trainer, _ = make(tmp_path, mu=2, beta=0.1, epochs=1)
    trainer.fit(module, datamodule=data)
    assert module.ref is not None and not any(p.requires_grad for p in module.ref.parameters())
    assert data.last_rollout.old_logprobs is not None and data.last_rollout.ref_logprobs is not None


def test_training_changes_policy_but_not_reference(tmp_path):
    module, data, trainer, _ = make(tmp_path, beta=0.1, epochs=2)
    module.configure_model()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    ref_before = {k: v.clone() for k, v in module.ref.state_dict().items()}
    trainer.fit(module, datamodule=data)
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    assert all(torch.equal(ref_before[k], v) for k, v in module.ref.state_dict().items())


def test_prompt_stream_is_a_seeded_permutation_without_repeats(tmp_path):
    module, data, trainer, _ = make(tmp_path, epochs=1)
    data.trainer = trainer
    trainer.strategy.connect(module)
    data.setup("fit")
    seen = []
    size = len(data.train_data)
    while data.position < size:
        seen += data.next_prompts()["prompt"]
    seen = seen[:size]
    assert len(set(seen)) == size  # every training prompt exactly once per pass
    held_out = set(data.val_data["prompt"]) if data.val_data is not None else set()
    assert not held_out & set(seen)


def test_batch_sizes_that_do_not_divide_are_refused(tmp_path):
    module, data, trainer, _ = make(tmp_path, mini=6)
    with pytest.raises(ConfigError, match="mini_batch_size"):
        trainer.fit(module, datamodule=data)
    module, data, trainer, _ = make(tmp_path, mini=8, micro=4, accumulate=1)
    with pytest.raises(ConfigError, match="accumulate_grad_batches"):
        trainer.fit(module, datamodule=data)


@pytest.mark.parametrize("choice", ["auto", "sampler", "recompute"])
def test_old_logprobs_from_the_sampler_equal_a_recomputed_pass(choice):
    """μ > 1: π_old's log-probs are the sampler's own (no extra forward) unless recompute is asked for; either
    way they are the rollout policy's log-probs of the sampled tokens."""
    from dataclasses import replace

    from grpo_lightning.rollout.round import collect_rollout

    module = GRPOModule(
        tiny_model=TINY,
        rewards=[RewardSpec("test_gated_digits")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6, temperature=0.7),
        objective=ObjectiveConfig(num_iterations=2, old_logprobs=choice),
    )
    module.configure_model()
    assert module.old_logprobs_from_sampler() is (choice != "recompute")
    prompts = iter([["1+2=", "33+4="], ["7+8=", "123+4="], ["9+9=", "5+55="], ["1+1=", "2+2="]])
    # DAPO's dynamic sampling concatenates several generations (prompts of other lengths): still aligned.
    batch = collect_rollout(module, lambda: {"prompt": next(prompts)}, dynamic_sampling=True, max_sampling_rounds=4)
    assert batch.metrics["rollout/sampling_rounds"] >= 2  # rows from several generations
    recomputed, _ = module.rollout_logprobs(replace(batch, old_logprobs=None))
    torch.testing.assert_close(batch.old_logprobs, recomputed, atol=1e-5, rtol=1e-5)
    module.objective = ObjectiveConfig(num_iterations=1, old_logprobs=choice)
    assert not module.old_logprobs_from_sampler()
    assert collect_rollout(module, lambda: {"prompt": ["5+5="]}).old_logprobs is None


def test_micro_batches_carry_the_token_positions_and_prompt_groups_of_their_rows():
    """What the update's forward would otherwise read from the masks (a device sync each time) comes with each
    micro-batch: the completion tokens' flat positions and, per row, a row with the same prompt."""
    torch.manual_seed(0)
    prompts, group, length = 3, 4, 5
    prompt_ids = torch.randint(3, 30, (prompts, 4)).repeat_interleave(group, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[group:, 0] = 0  # two of the prompts are padded
    completion_mask = (torch.arange(length) < torch.randint(1, length + 1, (prompts * group, 1))).long()
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, 30, (prompts * group, length)),
        completion_mask=completion_mask,
        truncated=torch.zeros(prompts * group, dtype=torch.bool),
        rewards=torch.rand(prompts * group),
        advantages=torch.randn(prompts * group),
    )
    micro = batch.micro_batches(
        micro_batch_size=5, mini_batch_size=prompts * group, num_iterations=2, generator=torch.Generator()
    )
    assert len(micro) == 2 * 3
    for mb in micro:
        width = mb["completion_mask"].size(1)
        lengths = mb["completion_mask"].sum(1).tolist()
        expected = [row * width + column for row, length in enumerate(lengths) for column in range(length)]
        assert mb["token_positions"].tolist() == expected
        first, inverse = mb["prompt_first"], mb["prompt_inverse"]
        assert torch.equal(mb["prompt_ids"][first][inverse], mb["prompt_ids"])
        assert torch.equal(mb["prompt_mask"][first][inverse], mb["prompt_mask"])
        assert mb["prompts_padded"] == (not bool(mb["prompt_mask"].all()))
