"""The GRPO family wired end to end: dynamic sampling, process rewards, KL control, reference sync, recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import length_reward, step_length_reward
from lightning import Callback

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig, UpdateConfig
from grpo_lightning.callbacks.kl import KLController, ReferenceSync, adaptive_beta
from grpo_lightning.cli import GRPOCLI
from grpo_lightning.engines import Completions, RolloutEngine
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.step_ends import step_token_ends

ROOT = Path(__file__).resolve().parents[2]


@register("test_even_a_length")
def even_a_length(prompts, completions, **_):
    """Informative only for prompts whose first operand is even: other groups all score 0."""
    return [float(len(c)) if int(p.split("+")[0]) % 2 == 0 else 0.0 for p, c in zip(prompts, completions)]


register("test_process")(step_length_reward)


def fit(module, data, epochs=1, callbacks=(), tmp_path=None):
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=epochs,
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=data)
    return trainer


def tiny_module(**objective):
    return GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(**objective), lr=1e-3)


def tiny_data(rewards, sampling: dict | None = None, **settings):
    """A DataModule with the rewards ``rewards`` and G = 4 completions of at most 6 tokens (``sampling``: more of
    ``data.sampling``)."""
    sampling = SamplingConfig(group_size=4, max_new_tokens=6, **(sampling or {}))
    return RolloutDataModule(rewards=[RewardSpec(r) for r in rewards], sampling=sampling, **settings)


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    module = tiny_module(beta=0.0)
    dynamic = {"dynamic_sampling": True, "max_sampling_rounds": 8}
    data = tiny_data(["test_even_a_length"], dynamic, prompts_per_round=4, val_split=None)
    fit(module, data, tmp_path=tmp_path)
    rollout = data.last_rollout
    assert len(rollout) == 16
    firsts = {int(p.split("+")[0]) % 2 for p in rollout.prompts}
    assert firsts == {0}  # every kept group is informative
    assert rollout.metrics["rollout/filtered_fraction"] == 0.0
    assert rollout.metrics["rollout/sampling_rounds"] >= 2  # about half the prompts were dropped
    assert data.position == 4 * rollout.metrics["rollout/sampling_rounds"]  # every drawn prompt is counted


def test_dynamic_sampling_cap_tops_up_with_uninformative_groups(tmp_path):
    module = tiny_module(beta=0.0)
    dynamic = {"dynamic_sampling": True, "max_sampling_rounds": 1}
    data = tiny_data(["test_even_a_length"], dynamic, prompts_per_round=8, val_split=None)
    fit(module, data, tmp_path=tmp_path)
    assert len(data.last_rollout) == 32  # the size never changes (ranks stay in step)
    assert data.last_rollout.metrics["rollout/sampling_rounds"] == 1


def test_step_token_ends_on_a_hand_example():
    tok = build_char_tokenizer()
    texts = ["ab1cd1e", "xy"]
    enc = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    ids = torch.full((2, 8), tok.pad_token_id)
    mask = torch.zeros((2, 8), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    ends = step_token_ends(texts, ids, mask, tok, "1")
    # "ab|1cd|1e<eos>": step "ab" ends at token 1, "cd" at token 4, "e" at the last token (EOS, index 7)
    assert ends.tolist() == [[1, 4, 7], [2, -1, -1]]


class FixedEngine(RolloutEngine):
    """An engine that "samples" ``texts`` as every prompt's group: each ended by EOS, or, from ``width`` characters
    on, cut there without one (truncated by the length limit)."""

    name = "fixed"

    def __init__(self, texts: list[str], width: int) -> None:
        super().__init__()
        self.texts, self.width = texts, width

    def setup(self, policy, tokenizer, *modality) -> None:  # noqa: ANN001
        super().setup(policy, tokenizer, *modality)
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False):  # noqa: ANN001
        tok, width, group = self.tokenizer, self.width, len(self.texts)
        assert params.group_size == group
        texts = self.texts * prompt_ids.size(0)
        rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
        truncated = torch.tensor([len(row) > width for row in rows])
        rows = [row[:width] for row in rows]
        ids = torch.full((len(rows), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return Completions(
            prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0), ids, mask, truncated
        )


def test_process_rewards_give_per_token_advantages(tmp_path):
    """One group of completions chosen by hand, through the real round: steps are separated by "1" and scored by
    their length, each step's reward is normalised over all the steps of the group, and a token's advantage is the
    sum over the steps that end at or after it."""
    module = tiny_module(beta=0.0)
    # Steps (lengths): "a|bcd" (1, 3), "abc" (3), "a" (1), "abc|d" (3, 1): mean 2, population std 1.
    engine = FixedEngine(["a1bcd", "abc", "a", "abc1d"], width=6)
    data = tiny_data(["test_process"], engine=engine, prompts_per_round=1, val_split=None)
    fit(module, data, tmp_path=tmp_path)
    rollout = data.last_rollout
    nan = float("nan")
    torch.testing.assert_close(
        rollout.step_rewards, torch.tensor([[1.0, 3.0], [3.0, nan], [1.0, nan], [3.0, 1.0]]), equal_nan=True
    )
    # A step ends at the token of its last character; the last step at the last token (the EOS).
    assert rollout.step_ends.tolist() == [[0, 5], [3, -1], [1, -1], [2, 5]]
    # Normalised step rewards: (r - 2) / (1 + advantage_eps) = ±k.
    k = 1 / (1 + 1e-4)
    expected = k * torch.tensor(
        [
            [0.0, 1, 1, 1, 1, 1],  # a (-k, ends at 0) | 1bcd<eos> (+k, ends at 5): token 0 gets -k + k
            [1, 1, 1, 1, 0, 0],  # abc<eos> (+k), then padding
            [-1, -1, 0, 0, 0, 0],  # a<eos> (-k)
            [0, 0, 0, -1, -1, -1],  # abc (+k, ends at 2) | 1d<eos> (-k, ends at 5)
        ]
    )
    # float32 sums of two or three terms of size ~1: a few float32 ulps (2**-23 relative), well inside 1e-6.
    torch.testing.assert_close(rollout.advantages, expected, atol=1e-6, rtol=0)


register("test_variants_length")(length_reward)


class FirstGradients(Callback):
    """The gradients of the first optimizer step."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:  # noqa: ANN001
        if self.grads is None:
            self.grads = [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]


def first_step(tmp_path, texts: list[str], mask_truncated: bool):
    """One round of one optimizer step on the completions ``texts`` (max_new_tokens 6): rollout and gradients."""
    torch.manual_seed(0)
    module = tiny_module(beta=0.0, loss_type="dapo")
    data = tiny_data(
        ["test_variants_length"],
        engine=FixedEngine(texts, width=6),
        update=UpdateConfig(mask_truncated_completions=mask_truncated),
        prompts_per_round=1,
        val_split=None,
    )
    grads = FirstGradients()
    fit(module, data, callbacks=[grads], tmp_path=tmp_path)
    return data.last_rollout, grads.grads


def test_truncated_completions_are_masked_out_of_the_loss_and_the_gradient(tmp_path):
    """DAPO's overlong filtering (the dapo recipe turns it on): a completion cut by max_new_tokens gets an all-zero
    loss mask, and the update does not depend on its tokens. Two rollouts whose truncated rows differ in their
    tokens only (same rewards, so the same advantages everywhere) make the same first optimizer step."""
    ended = ["ab", "abcd"]  # rewards 2, 4; EOS within 6 tokens
    first, second = ["abcdefgh", "abcdefgh"], ["zyxwvuts", "qqqqqqqq"]  # cut at 6 tokens: reward 6 either way
    rollout, grads = first_step(tmp_path, ended + first, mask_truncated=True)
    assert rollout.truncated.tolist() == [False, False, True, True]
    assert (rollout.advantages[2:] != 0).all()  # without the mask, these rows would push the update
    assert torch.equal(rollout.loss_mask[:2], rollout.completion_mask[:2])
    assert rollout.loss_mask[2:].sum() == 0 and rollout.completion_mask[2:].sum() == 12
    _, grads_other_tokens = first_step(tmp_path, ended + second, mask_truncated=True)
    for a, b in zip(grads, grads_other_tokens, strict=True):
        # Masked terms are multiplied by exactly 0: only the other rows' sums remain, in the same order.
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Control: without the setting the same change of tokens does change the update.
    _, unmasked = first_step(tmp_path, ended + first, mask_truncated=False)
    _, unmasked_other_tokens = first_step(tmp_path, ended + second, mask_truncated=False)
    assert any(not torch.equal(a, b) for a, b in zip(unmasked, unmasked_other_tokens))


def test_adaptive_beta_formula():
    # KL above target by 50%: error clipped to +0.2; n / horizon = 100 / 1000
    assert adaptive_beta(0.1, kl=0.15, target=0.1, num_samples=100, horizon=1000) == pytest.approx(0.1 * 1.02)
    # KL at half the target: error −0.5 clipped to −0.2
    assert adaptive_beta(0.1, kl=0.05, target=0.1, num_samples=100, horizon=1000) == pytest.approx(0.1 * 0.98)
    assert adaptive_beta(0.1, kl=0.11, target=0.1, num_samples=1000, horizon=1000) == pytest.approx(0.1 * 1.1)


def test_kl_controller_lowers_beta_when_kl_is_below_target(tmp_path):
    module = tiny_module(beta=0.1)
    controller = KLController(target_kl=10.0, horizon=100)  # KL of a tiny run is far below 10
    fit(
        module,
        tiny_data(["test_even_a_length"], prompts_per_round=2, val_split=None),
        epochs=2,
        callbacks=[controller],
        tmp_path=tmp_path,
    )
    assert module.beta == pytest.approx(0.1 * (1 - 0.2 * 8 / 100) ** 2)
    assert controller.state_dict() == {"beta": module.beta}
    assert module.objective.beta == 0.1  # the starting value, as configured


def test_reference_sync_moves_reference_towards_policy(tmp_path):
    module = tiny_module(beta=0.1)
    module.configure_model()
    ref_before = [p.clone() for p in module.ref.parameters()]
    sync = ReferenceSync(sync_steps=1, alpha=0.5)
    trainer = fit(
        module,
        tiny_data(["test_even_a_length"], prompts_per_round=2, val_split=None),
        epochs=1,
        callbacks=[sync],
        tmp_path=tmp_path,
    )
    assert trainer.global_step == 1
    for before, ref, policy in zip(ref_before, module.ref.parameters(), module.policy.parameters()):
        # Elementwise, one rounding per operation either way: the float32 defaults (atol 1e-5, rtol 1.3e-6) hold
        # on any machine (no reduction whose order could change).
        torch.testing.assert_close(ref, 0.5 * before + 0.5 * policy.detach())
    assert module.reference_moved  # so checkpoints now keep the reference


@pytest.mark.parametrize("recipe", ["grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "gmpo"])
def test_recipe_configs_compose_with_the_quickstart(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    cli = GRPOCLI(
        args=[
            "--config",
            "configs/quickstart.yaml",
            "--config",
            f"configs/recipes/{recipe}.yaml",
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            "[]",
        ],
        run=False,
    )
    assert cli.model.objective.loss_type == {"gspo": "grpo"}.get(recipe, recipe)
    if recipe == "gspo":
        assert cli.model.objective.importance_sampling_level == "sequence"
    if recipe == "cispo":  # the paper's no lower bound, ScaleRL's cap of 5 on the weight
        assert (cli.model.objective.epsilon_low, cli.model.objective.epsilon_high) == (1.0, 4.0)
    if recipe == "sapo":
        assert cli.model.objective.loss_kwargs == {"tau_pos": 1.0, "tau_neg": 1.05}
    if recipe == "gmpo":  # log space: ratios within (e^-0.4, e^0.4)
        assert cli.model.objective.resolved()["epsilon_low"] == 0.4
    if recipe == "dapo":
        assert cli.datamodule.collector.sampling.dynamic_sampling and cli.model.objective.epsilon_high == 0.28
        assert (
            cli.datamodule.collector.update.mask_truncated_completions
        )  # DAPO's overlong filtering (see the test above)
