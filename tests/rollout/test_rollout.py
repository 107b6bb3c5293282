"""The rollout round inside Lightning: one rollout → μ × mini-batches optimizer steps, exact prompt count."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import attach, length_reward
from lightning import Callback

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import AdvantageConfig, ConfigError, EvalConfig, UpdateConfig
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout import datamodule as datamodule_module
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.round import compute_advantages, run_round
from grpo_lightning.update_plan import UpdatePlan

register("test_length")(length_reward)


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
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=beta), lr=1e-3)
    data = RolloutDataModule(
        rewards=[RewardSpec("test_length")],
        sampling=SamplingConfig(group_size=group, max_new_tokens=4),
        update=UpdateConfig(num_iterations=mu, mini_batch_size=mini, micro_batch_size=micro),
        prompts_per_round=prompts,
        eval=EvalConfig(limit=8),
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


def test_old_logprobs_only_when_a_round_has_several_steps_and_ref_only_when_beta(tmp_path):
    module, data, trainer, _ = make(tmp_path, mu=1, beta=0.0, epochs=1)  # one optimizer step per round
    trainer.fit(module, datamodule=data)
    assert module.ref is None
    assert data.last_rollout.old_logprobs is None and data.last_rollout.ref_logprobs is None
    module, data, trainer, _ = make(tmp_path, mu=1, beta=0.0, mini=8, epochs=1)  # μ = 1 but two steps per round
    trainer.fit(module, datamodule=data)
    assert data.last_rollout.old_logprobs is not None
    module, data, trainer, _ = make(tmp_path, mu=2, beta=0.1, epochs=1)
    trainer.fit(module, datamodule=data)
    assert module.ref is not None and not any(p.requires_grad for p in module.ref.parameters())
    assert data.last_rollout.old_logprobs is not None and data.last_rollout.ref_logprobs is not None


class RatioRecorder(Callback):
    def __init__(self):
        self.ratio_min, self.ratio_max, self.clip_frac = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.ratio_min.append(float(metrics["train/ratio_min"]))
        self.ratio_max.append(float(metrics["train/ratio_max"]))
        self.clip_frac.append(float(metrics["train/clip_frac"]))


@pytest.mark.parametrize("old_logprobs", ["sampler", "recompute"])
def test_every_step_after_the_first_of_a_round_is_clipped_against_pi_old(tmp_path, old_logprobs):
    """μ = 1 with two mini-batches per round: the second step's policy is not the one that sampled, so its ratio
    must move off 1 (and get clipped) instead of being taken against the detached current policy."""
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=3e-2)
    data = RolloutDataModule(
        rewards=[RewardSpec("test_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6, temperature=0.7),
        update=UpdateConfig(num_iterations=1, old_logprobs=old_logprobs, mini_batch_size=8),
        prompts_per_round=4,
        eval=EvalConfig(limit=8),
        task_kwargs={"test_size": 50},
    )
    recorder = RatioRecorder()
    trainer = quiet_trainer(tmp_path, max_epochs=1, callbacks=[recorder])
    trainer.fit(module, datamodule=data)
    assert len(recorder.ratio_min) == 2
    assert recorder.ratio_min[0] == pytest.approx(1.0, abs=1e-5) and recorder.ratio_max[0] == pytest.approx(
        1.0, abs=1e-5
    )
    # after one step at this learning rate some token moved by far more than float32 noise
    assert recorder.ratio_min[1] < 0.99 or recorder.ratio_max[1] > 1.01
    assert recorder.clip_frac[1] > 0


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
    attach(module, data, trainer)
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
    module, data, trainer, _ = make(tmp_path, mini=8, micro=4, accumulate=3)  # 1 (unset) is derived: 2
    with pytest.raises(ConfigError, match="accumulate_grad_batches = 3 contradicts"):
        trainer.fit(module, datamodule=data)


@pytest.mark.parametrize("choice", ["auto", "sampler", "recompute"])
def test_old_logprobs_from_the_sampler_equal_a_recomputed_pass(tmp_path, choice):
    """μ > 1: π_old's log-probs are the sampler's own (no extra forward) unless recompute is asked for; either
    way they are the rollout policy's log-probs of the sampled tokens."""
    module = GRPOModule(tiny_model=TINY)
    # DAPO's dynamic sampling concatenates several generations (prompts of other lengths): still aligned.
    data = RolloutDataModule(
        rewards=[RewardSpec("test_gated_digits")],
        sampling=SamplingConfig(
            group_size=4, max_new_tokens=6, temperature=0.7, dynamic_sampling=True, max_sampling_rounds=4
        ),
        update=UpdateConfig(num_iterations=2, old_logprobs=choice),
        prompts_per_round=2,
    )
    attach(module, data, quiet_trainer(tmp_path))
    module.configure_model()
    engine = data.collector.current_engine()
    asked = {"engine": [], "old": []}  # what the round asked of the engine (its log-probs) and of the module (π_old)
    generate = engine.generate

    def recording_generate(*args, return_logprobs=False, **kwargs):
        asked["engine"].append(return_logprobs)
        return generate(*args, return_logprobs=return_logprobs, **kwargs)

    def recording_logprobs(batch, *, old, ref):
        asked["old"].append(old)
        return module.rollout_logprobs(batch, old=old, ref=ref)

    engine.generate = recording_generate
    settings = data.collector.round_settings()
    assert settings.optimizer_steps == 2

    def round_of(prompt_lists, settings):
        prompts = iter(prompt_lists)
        for calls in asked.values():
            calls.clear()
        return run_round(
            lambda: {"prompt": next(prompts)},
            engine=engine,
            encoder=data.encoder(),
            scorer=data.scorer,
            logprobs=recording_logprobs,
            settings=settings,
            generator=data.collector.sampling_generator(module.device),
        )

    batch = round_of([["1+2=", "33+4="], ["7+8=", "123+4="], ["9+9=", "5+55="], ["1+1=", "2+2="]], settings)
    assert batch.metrics["rollout/sampling_rounds"] >= 2  # rows from several generations
    from_sampler = choice != "recompute"
    assert asked["engine"] == [from_sampler] * len(asked["engine"]) and asked["old"] == [not from_sampler]
    recomputed, _ = module.rollout_logprobs(batch, old=True, ref=False)
    torch.testing.assert_close(batch.old_logprobs, recomputed, atol=1e-5, rtol=1e-5)
    # A round of one optimizer step needs no π_old, whatever μ says.
    one_step = replace(settings, optimizer_steps=1, dynamic_sampling=False)
    assert round_of([["5+5="]], one_step).old_logprobs is None
    assert asked["engine"] == [False] and asked["old"] == [False]


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
    rows = prompts * group
    plan = UpdatePlan(num_iterations=2, rows_per_round=rows, mini_batch_size=rows, micro_batch_size=4)
    micro = batch.micro_batches(plan, generator=torch.Generator())
    assert len(micro) == 2 * 3
    for mb in micro:
        width = mb["completion_mask"].size(1)
        lengths = mb["completion_mask"].sum(1).tolist()
        expected = [row * width + column for row, length in enumerate(lengths) for column in range(length)]
        assert mb["layout"].positions.tolist() == expected
        first, inverse = mb["layout"].groups.first, mb["layout"].groups.inverse
        assert torch.equal(mb["prompt_ids"][first][inverse], mb["prompt_ids"])
        assert torch.equal(mb["prompt_mask"][first][inverse], mb["prompt_mask"])
        assert mb["layout"].groups.padded == (not bool(mb["prompt_mask"].all()))


class SGDModule(GRPOModule):
    """Plain SGD: the step is the gradient itself, so a wrongly normalised loss shows (Adam would hide a factor)."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=1.0)


def one_step_update(tmp_path, loss_type: str, micro: int) -> tuple[torch.Tensor, RolloutBatch]:
    """The weight change of one round of one optimizer step over a 16-row rollout, in micro-batches of ``micro``."""
    torch.manual_seed(0)
    module = SGDModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.04, loss_type=loss_type))
    module.configure_model()
    with torch.no_grad():  # a random model almost never ends a completion: make EOS likely in some contexts
        module.policy.get_output_embeddings().weight[module.tokenizer.eos_token_id] *= 100
    before = torch.cat([p.detach().flatten().clone() for p in module.policy.parameters()])
    data = RolloutDataModule(
        rewards=[RewardSpec("test_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=5, temperature=1.5),
        update=UpdateConfig(mask_truncated_completions=True, micro_batch_size=micro),
        prompts_per_round=4,
        eval=EvalConfig(limit=8),
        task_kwargs={"test_size": 50},
    )
    trainer = quiet_trainer(tmp_path, max_epochs=1, accumulate_grad_batches=16 // micro)
    trainer.fit(module, datamodule=data)
    after = torch.cat([p.detach().flatten() for p in module.policy.parameters()])
    return after - before, data.last_rollout


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo", "cispo", "vespo"])
def test_update_with_truncated_rows_does_not_depend_on_the_micro_batch_size(tmp_path, loss_type):
    """Rows emptied by mask_truncated_completions count as 0 in the mean over the mini-batch's completions, so
    one forward of 16 rows and 16/micro accumulated micro-batches make the same optimizer step."""
    reference, rollout = one_step_update(tmp_path, loss_type, micro=16)
    truncated = int(rollout.truncated.sum())
    assert 0 < truncated < len(rollout)  # some rows are empty, some are not: the case that matters
    assert reference.norm() > 0
    for micro in (1, 2, 4):
        update, again = one_step_update(tmp_path, loss_type, micro=micro)
        assert torch.equal(again.completion_ids, rollout.completion_ids)  # the same rollout
        # float32 sums taken in another order: a few float32 ulps of the update, far below 1e-6 relative
        assert ((update - reference).norm() / reference.norm()).item() < 1e-6, micro


@pytest.mark.parametrize("std,expected", [("population", 3**0.5), ("sample", 1.5)])
def test_advantage_std_setting_reaches_the_round(tmp_path, std, expected):
    """data.advantage.std chooses the std of the round's advantages (1/0/0/0 at G = 4)."""
    module = GRPOModule(tiny_model=TINY)
    data = RolloutDataModule(
        sampling=SamplingConfig(group_size=4), advantage=AdvantageConfig(std=std, eps=1e-12), prompts_per_round=1
    )
    attach(module, data, quiet_trainer(tmp_path))
    module.configure_model()
    batch = SimpleNamespace(
        rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]),
        reward_columns={"r": [1.0, 0.0, 0.0, 0.0]},
        step_rewards=None,
        unscorable=None,
    )
    advantages = compute_advantages(batch, data.collector.round_settings(), None)
    assert advantages[0].item() == pytest.approx(expected, rel=1e-6)


def test_advantage_std_is_checked():
    with pytest.raises(ConfigError, match="data.advantage.std"):
        AdvantageConfig(std="bessel")


class TwoRanks:
    """Two datamodules standing for the two ranks of one DDP run. ``state_dicts`` calls every rank's
    ``state_dict`` at once (one thread per rank), as Lightning does on every rank, and ``gather_per_rank`` (what the
    datamodule collects the ranks' states with) exchanges the values the ranks give it."""

    def __init__(self, data_factory):
        self.ranks = [data_factory() for _ in range(2)]
        for rank, data in enumerate(self.ranks):
            strategy = SimpleNamespace(root_device=torch.device("cpu"))
            data.trainer = SimpleNamespace(world_size=2, global_rank=rank, strategy=strategy)
        self.barrier, self.values = threading.Barrier(2, timeout=30), [None, None]

    def gather_per_rank(self, trainer, value):
        self.values[trainer.global_rank] = value
        self.barrier.wait()
        gathered = list(self.values)
        self.barrier.wait()
        return gathered

    def state_dicts(self, monkeypatch):
        monkeypatch.setattr(datamodule_module, "gather_per_rank", self.gather_per_rank)
        states = [None, None]

        def save(rank):
            states[rank] = self.ranks[rank].state_dict()

        threads = [threading.Thread(target=save, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return states


def test_data_parallel_resume_continues_every_ranks_prompt_stream(monkeypatch):
    """Dynamic sampling lets each rank refill on its own: rank 1 draws three times in a round where rank 0 draws
    once. A resume must continue each rank's own stream: no rank re-draws a prompt it trained on."""
    from datasets import Dataset

    def data_factory():
        data = RolloutDataModule(prompts_per_round=2, seed=3)
        data.train_data = Dataset.from_dict({"prompt": [f"p{i}" for i in range(40)]})
        return data

    run = TwoRanks(data_factory)
    drawn = [[], []]
    for rank, draws in ((0, 1), (1, 3)):
        for _ in range(draws):
            drawn[rank] += run.ranks[rank].next_prompts()["prompt"]
    # Lightning saves rank 0's state_dict (computed on every rank: the positions are gathered).
    states = run.state_dicts(monkeypatch)
    assert states[0]["positions"] == states[1]["positions"] == [4, 12]
    uninterrupted = [run.ranks[rank].next_prompts()["prompt"] for rank in (0, 1)]

    resumed = TwoRanks(data_factory)
    for data in resumed.ranks:
        data.load_state_dict(states[0])
    for rank in (0, 1):
        following = resumed.ranks[rank].next_prompts()["prompt"]
        assert following == uninterrupted[rank]
        assert not set(following) & set(drawn[0] + drawn[1])  # nothing trained on is drawn again


def test_a_resume_with_another_number_of_processes_continues_after_the_furthest_rank():
    data = RolloutDataModule(prompts_per_round=2)
    data.load_state_dict({"position": 4, "positions": [4, 12]})
    assert data.position == 12
    data.load_state_dict({"position": 8})  # a checkpoint from before per-rank positions
    assert data.position == 8
