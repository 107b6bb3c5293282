"""Packed log-prob passes (``models/packing.py``) against the padded ones they replace.

float32 throughout: the packed and padded passes do the same arithmetic on the same tokens in another grouping
(other matmul shapes, another mask), so they differ by float32 rounding only: log-probs and gradients agree to 1e-5
(``helpers.F32``, the bound ``test_lean.py`` measured for the lean forward against ``transformers``). A leak across a
sequence boundary moves a log-prob by orders of magnitude more: ``test_*_no_leak`` changes another sequence of the
same bin and requires the log-probs to stay the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import (
    ARCHITECTURES,
    F32,
    LEAN_ARCHITECTURES,
    build_architecture,
    checksum_reward,
    length_reward,
    step_length_reward,
)

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import UpdateConfig
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.models.lean_forward import lean_unsupported, prompt_groups
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.packing import (
    full_packing,
    lean_packing,
    pack_budget,
    packed_token_count,
    packing_isolates,
    plan_bins,
)
from grpo_lightning.rewards import RewardSpec, register

ASSETS = Path(__file__).resolve().parents[2] / "grpo_lightning" / "assets"


def uneven_rollout(group_size: int = 3, lengths=(9, 1, 4, 12, 2, 7, 12, 5, 3)):
    """Three left-padded prompts (0, 2 and 4 padding positions), each repeated for its group; completions of
    uneven lengths (prefix masks), one of a single token."""
    torch.manual_seed(1)
    prompt_ids = torch.randint(1, 40, (3, 6)).repeat_interleave(group_size, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[group_size : 2 * group_size, :2] = 0
    prompt_mask[2 * group_size :, :4] = 0
    width = max(lengths)
    completion_ids = torch.randint(1, 40, (len(lengths), width))
    completion_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.fixture
def packed_runs(monkeypatch):
    """Counts the packed forwards that ran (so that no equivalence can hold by never packing)."""
    import grpo_lightning.models.logprobs as logprobs

    runs = {"lean": 0, "own": 0}
    lean, full = logprobs.lean_packed_hidden, logprobs.full_packing

    def lean_spy(*args, **kwargs):
        runs["lean"] += 1
        return lean(*args, **kwargs)

    def full_spy(*args, **kwargs):
        runs["own"] += 1
        return full(*args, **kwargs)

    monkeypatch.setattr(logprobs, "lean_packed_hidden", lean_spy)
    monkeypatch.setattr(logprobs, "full_packing", full_spy)
    return runs


def logprobs_and_grads(model, rollout, **kwargs):
    model.zero_grad()
    logprobs, entropy = completion_logprobs(model, *rollout, with_entropy=True, chunk_size=7, **kwargs)
    weights = torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)
    ((logprobs * weights).sum() + entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


# --------------------------------------------------------------------------------------------- bin planning
def test_first_fit_decreasing_fills_bins_within_the_budget():
    lengths = [5, 9, 3, 9, 1, 12, 4]
    bins = plan_bins(lengths, budget=12)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    # In decreasing order 12, 9, 9, 5, 4, 3, 1: 12 | 9 | 9 | 5 (fits nowhere) | 4 joins 5 | 3 joins the first 9 |
    # 1 joins the second 9.
    assert bins == [[5], [1, 2], [3, 4], [0, 6]]
    assert plan_bins(lengths, budget=12) == bins  # deterministic
    assert plan_bins([20, 2], budget=12) == [[0], [1]]  # longer than the budget: a bin of its own


def test_auto_packs_uneven_completions_and_leaves_even_ones_padded():
    uneven = torch.tensor([[1] * n + [0] * (16 - n) for n in (16, 2, 3, 5, 15, 1)])
    assert packed_token_count([16, 2, 3, 5, 15, 1], 16) == (96, 48)  # bins 16 | 15 + 1 | 5 + 3 + 2
    assert pack_budget("auto", uneven) == 0
    assert pack_budget("auto", torch.ones(6, 5, dtype=torch.long)) is None
    assert pack_budget(None, uneven) is None and pack_budget(64, uneven) == 64
    with pytest.raises(ValueError, match="pack_tokens must be"):
        pack_budget(0, uneven)


@pytest.mark.parametrize("value", [0, -5, True, "max", 12.5])
def test_a_pack_tokens_that_is_not_a_token_count_is_refused_in_one_line(value):
    from grpo_lightning.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"^data\.update\.pack_tokens must be a number of tokens >= 1, auto or null"
    ) as err:
        UpdateConfig(pack_tokens=value)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "own-forward"])
def test_packed_logprobs_entropies_and_gradients_equal_the_padded_ones(name, lean, packed_runs):
    if lean and name not in LEAN_ARCHITECTURES:
        pytest.skip(f"{name} has no lean forward")
    model = build_architecture(name)
    rollout = uneven_rollout()
    if not lean:
        assert packing_isolates(model), f"{name}'s attention should keep packed sequences apart"
    padded = logprobs_and_grads(model, rollout, lean=lean)
    for budget in (0, 13, 40):  # bins as long as the longest, a bit longer, several sequences each
        packed = logprobs_and_grads(model, rollout, lean=lean, pack_tokens=budget or "auto")
        torch.testing.assert_close(packed[0], padded[0], **F32)
        torch.testing.assert_close(packed[1], padded[1], **F32)
        assert packed[2].keys() == padded[2].keys()
        for key in padded[2]:
            torch.testing.assert_close(packed[2][key], padded[2][key], **F32, msg=key)
    assert packed_runs["lean" if lean else "own"] == 3 and packed_runs["own" if lean else "lean"] == 0
    mask = rollout[3].bool()
    assert (padded[0][~mask] == 0).all() and (padded[0][mask] != 0).all()


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "own-forward"])
def test_a_tokens_logprob_does_not_see_the_other_sequences_of_its_bin_no_leak(lean):
    model = build_architecture("llama")
    prompt_ids, prompt_mask, completion_ids, completion_mask = uneven_rollout()
    groups = prompt_groups(prompt_ids, prompt_mask)
    packing = lean_packing(prompt_mask, completion_mask, groups, 40)
    rows = packing.index[0]
    shared = [r for r in range(len(rows)) if len(set(rows[r].tolist())) > 1]
    assert shared, "some bin holds several sequences"
    full = full_packing(prompt_ids, prompt_mask, completion_ids, completion_mask, 40)
    assert full.input_ids.size(0) < completion_ids.size(0)  # the own forward's bins hold several sequences too
    before = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, lean=lean,
                                 pack_tokens=40)[0]  # fmt: skip
    for row in range(completion_ids.size(0)):  # change one sequence at a time: every other must stay
        changed = completion_ids.clone()
        changed[row] = (changed[row] + 7) % 39 + 1
        after = completion_logprobs(model, prompt_ids, prompt_mask, changed, completion_mask, lean=lean,
                                    pack_tokens=40)[0]  # fmt: skip
        others = torch.arange(completion_ids.size(0)) != row
        torch.testing.assert_close(after[others], before[others], atol=1e-6, rtol=0)
        assert not torch.allclose(after[row], before[row])


def test_attention_that_mixes_packed_sequences_falls_back_to_padded_rows(caplog):
    """An attention implementation that ignores the packed position ids is found by the probe: padded rows."""
    model = build_architecture("gpt2")
    model.config._attn_implementation = "eager"
    original = model.forward

    def ignores_positions(*args, position_ids=None, **kwargs):  # the attention then runs causally across the bin
        return original(*args, **kwargs)

    model.forward = ignores_positions
    rollout = uneven_rollout()
    with caplog.at_level("WARNING"):
        packed = completion_logprobs(model, *rollout, lean=False, pack_tokens="auto")[0]
    assert "mixes packed sequences" in caplog.text
    padded = completion_logprobs(model, *rollout, lean=False)[0]
    torch.testing.assert_close(packed, padded, atol=0, rtol=0)


def test_lora_packed_equals_padded(packed_runs):
    peft = pytest.importorskip("peft")
    model = build_architecture("llama")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    assert lean_unsupported(model) is not None  # the own forward's packing
    rollout = uneven_rollout()
    padded = logprobs_and_grads(model, rollout)
    packed = logprobs_and_grads(model, rollout, pack_tokens="auto")
    assert packed_runs["own"] == 1
    torch.testing.assert_close(packed[0], padded[0], **F32)
    assert padded[2] and packed[2].keys() == padded[2].keys()
    for key in padded[2]:
        torch.testing.assert_close(packed[2][key], padded[2][key], **F32, msg=key)


BF16_UNIT_ROUNDOFF = 2**-8


@pytest.mark.parametrize("precision", ["bf16-weights", "bf16-autocast"])
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "own-forward"])
def test_packed_bf16_logprobs_round_as_the_padded_ones(lean, precision, packed_runs):
    """In bfloat16 (weights, or float32 weights under autocast, as ``bf16-mixed`` trains) the packed pass rounds as
    the padded one, and its backward runs.

    Both passes round every intermediate tensor to bfloat16 (unit roundoff u = 2**-8) but in other matmul shapes
    and another attention mask, so an intermediate may land on the other side of a rounding boundary: a logit moves
    by about one bfloat16 step of the logits' size, and a log-prob (a logit minus the log-sum-exp of all of them) by
    up to two. Allowed: 4 u · max|logit|, as ``test_lean.py`` allows the lean forward against ``transformers``
    (measured: at most 16 % of it, 2 threads). A token that saw another sequence of its bin moves by far more (the
    float32 no-leak test above).
    """
    model = build_architecture("llama")
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    rollout = uneven_rollout()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        with torch.no_grad():
            prompt_ids, prompt_mask, completion_ids, _ = rollout
            logits = model(torch.cat([prompt_ids, completion_ids], 1)).logits
            padded = completion_logprobs(model, *rollout, chunk_size=7, lean=lean)[0]
        packed = completion_logprobs(model, *rollout, chunk_size=7, lean=lean, pack_tokens=13)[0]
        packed.sum().backward()
    assert packed_runs["lean" if lean else "own"] == 1
    tolerance = 4 * BF16_UNIT_ROUNDOFF * logits.float().abs().max().item()
    torch.testing.assert_close(packed.detach().float(), padded.float(), atol=tolerance, rtol=0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.isfinite().all() for g in grads)


def test_balanced_micro_batches_share_the_tokens_and_keep_every_row_once():
    from grpo_lightning.rollout.batch import balanced_split

    lengths = torch.tensor([512, 16, 300, 40, 480, 100, 256, 64])
    rows = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    parts = balanced_split(rows, 2, lengths)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    totals = [int(lengths[p].sum()) for p in parts]
    assert abs(totals[0] - totals[1]) <= 64 and sum(totals) == int(lengths.sum())  # 884 / 884
    for part in parts:  # each keeps the mini-batch's (shuffled) order
        order = [rows.tolist().index(r) for r in part.tolist()]
        assert order == sorted(order)
    assert all(len(p) >= 1 for p in balanced_split(rows, 8, lengths))


# ------------------------------------------------------------------------------------ through the trainer
class _SGDModule(GRPOModule):
    """Plain SGD, so that the step is the gradient itself (Adam would hide a wrong factor)."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=self.hparams.lr)


register("test_packing_steps")(step_length_reward)
register("test_packing_length")(length_reward)
register("test_packing_checksum")(checksum_reward)


def _round_update(tmp_path, case: str, pack_tokens, balance: bool) -> tuple[torch.Tensor, Any]:
    """The weight change of one round (μ = 2 passes, mini-batches of 8 in micro-batches of 4, π_old recomputed and
    π_ref's KL) with ``data.update.pack_tokens = pack_tokens``, and the round's rollout."""
    torch.manual_seed(0)
    objective = ObjectiveConfig(beta=0.04, loss_type="dapo" if case == "outcome" else "grpo")
    update = UpdateConfig(num_iterations=2, mini_batch_size=8, micro_batch_size=4, old_logprobs="recompute")
    update.pack_tokens, update.balance_micro_batches = pack_tokens, balance
    if case == "outcome":
        update.mask_truncated_completions = True
    settings: dict[str, Any] = dict(update=update, val_split=None)
    if case == "multi-turn":  # the calculator demo's model: real tool calls, environment tokens out of the loss
        module = _SGDModule(model_name_or_path=str(ASSETS / "tiny-calc"), objective=objective, lr=1e-2)
        data = RolloutDataModule(
            dataset="multiplication",
            rewards=[RewardSpec("test_packing_checksum")],
            environment=ToolEnvironment(tools=["calculator"], format="tag", max_turns=3, max_turn_tokens=40),
            sampling=SamplingConfig(group_size=4, max_new_tokens=96, temperature=1.5),
            prompts_per_round=4,
            **settings,
        )
    else:
        module = _SGDModule(tiny_model=TINY, objective=objective, lr=1.0)
        reward = "test_packing_steps" if case == "process" else "test_packing_length"
        data = RolloutDataModule(
            rewards=[RewardSpec(reward)],
            sampling=SamplingConfig(group_size=4, max_new_tokens=12, temperature=1.5),
            prompts_per_round=4,
            **settings,
        )
    module.configure_model()
    if case != "multi-turn":
        with torch.no_grad():  # a random model rarely ends a completion: make EOS likely, so lengths vary
            module.policy.get_output_embeddings().weight[module.tokenizer.eos_token_id] *= 60
    before = torch.cat([p.detach().flatten().clone() for p in module.policy.parameters()])
    quiet_trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2).fit(module, datamodule=data)
    after = torch.cat([p.detach().flatten() for p in module.policy.parameters()])
    return after - before, data.last_rollout


@pytest.mark.parametrize("case", ["outcome", "process", "multi-turn"])
def test_a_round_packed_with_balanced_micro_batches_updates_like_the_padded_round(tmp_path, case, packed_runs):
    """The whole round through the trainer (π_old and π_ref passes, μ × mini-batches, the update): packed bins and
    token-balanced micro-batches make the update of padded rows in equal-count micro-batches, with DAPO's token
    loss over truncated-and-masked rows, with process rewards' per-token advantages, and with multi-turn
    trajectories whose environment tokens are in the context but out of the loss."""
    reference, rollout = _round_update(tmp_path / "padded", case, pack_tokens=None, balance=False)
    assert packed_runs == {"lean": 0, "own": 0}
    lengths = rollout.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # uneven: packing and balancing have something to do
    if case == "process":
        assert rollout.advantages.dim() == 2 and rollout.step_rewards is not None
    if case == "multi-turn":
        assert (rollout.completion_mask.bool() & ~rollout.loss_mask.bool()).any()  # environment tokens
    if case == "outcome":
        assert rollout.truncated.any() and not rollout.truncated.all()
    update, again = _round_update(tmp_path / "packed", case, pack_tokens=8, balance=True)
    assert torch.equal(again.completion_ids, rollout.completion_ids)  # the same rollout
    assert packed_runs["lean"] + packed_runs["own"] > 0  # the passes packed: π_old, π_ref, 2 × 2 micro-batches per step
    assert reference.norm() > 0
    # float32 arithmetic over the same tokens in another grouping: a few ulps of the update
    assert ((update - reference).norm() / reference.norm()).item() < 1e-5
