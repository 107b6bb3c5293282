"""The top-entropy-quantile mask and the adaptive entropy coefficient against TRL 1.16's ``GRPOTrainer``.

TRL's own code runs here: ``get_high_entropy_mask`` (on a stand-in accelerator: one process, or two whose other
rank's tokens are given) and ``_compute_loss`` (on a stand-in trainer holding only what the loss reads, as
``test_loss_trl.py`` does, now with the entropies and the adaptive controller's state, kept across calls so that
several optimizer steps run through TRL's controller, ``grpo_trainer.py`` lines 3186-3245). Ours: ``grpo_loss``
with ``top_entropy_quantile`` and ``entropy_coef``, and ``EntropyControl`` fed as ``GRPOModule.training_step``
and ``on_before_optimizer_step`` feed it. Entropies are float32, as both trainers compute them; log-probs float64.

Where the two differ on purpose, the test says by how much: our ``entropy_coef`` keeps its meaning (the bonus
−c·H_t per token, aggregated like the loss), where TRL's bonus is the token mean of the kept tokens of each
micro-batch whatever the loss; with every token kept and a token-mean loss the two are the same number.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import yaml
from test_loss_ranges import BASE, parsed, refused

from grpo_lightning import GRPOModule
from grpo_lightning.losses import grpo_loss
from grpo_lightning.losses.entropy import EntropyControl, all_ranks_pool, entropy_threshold, high_entropy_mask

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl (a dev dependency) is not installed")
GRPOTrainer = trl_grpo.GRPOTrainer
TRL_CONFIG = {f.name: f.default for f in dataclasses.fields(trl_grpo.GRPOConfig)}
from test_loss_trl import B, T, trl_loss_inputs  # noqa: E402 (after TRL's importorskip)

LENGTHS = [T, 3, 1, 0, 5, T]  # uneven, one row empty
TOL = dict(atol=1e-6, rtol=0)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, **TOL)


class Accelerator:
    """Accelerate's collectives for one process, or for rank 0 of two with the other rank's ``other`` tokens."""

    def __init__(self, other: torch.Tensor | None = None) -> None:
        self.other, self.sync_gradients, self.num_processes = other, True, 1 if other is None else 2

    def pad_across_processes(self, x, dim=0, pad_index=0):
        width = x.numel() if self.other is None else max(x.numel(), self.other.numel())
        return torch.cat([x, x.new_full((width - x.numel(),), pad_index)])

    def gather(self, x):
        if self.other is None:
            return x
        return torch.cat([x, self.pad_across_processes(self.other.to(x.dtype), pad_index=-1e9)])

    def reduce(self, x, reduction="sum"):
        return x


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logprobs + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    ref = logprobs + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    entropy = torch.rand(B, T, generator=g) * 4  # float32, as the trainers compute it
    return logprobs, old, ref, advantages, mask, entropy


class TRL:
    """A stand-in ``GRPOTrainer`` for ``_compute_loss``, its entropy controller's state kept between calls."""

    def __init__(self, accumulation: int = 1, accelerator: Accelerator | None = None, **config) -> None:
        unknown = set(config) - set(TRL_CONFIG)
        assert not unknown, f"not GRPOConfig fields: {unknown}"
        args = SimpleNamespace(**{**TRL_CONFIG, "max_completion_length": T, "steps_per_generation": accumulation,
                                  "use_bias_correction_kl": False, **config})  # fmt: skip
        self.trainer = trainer = SimpleNamespace(  # what GRPOTrainer.__init__ copies from args (lines 845-857)
            loss_type=args.loss_type, epsilon_low=args.epsilon, epsilon_high=args.epsilon, beta=args.beta,
            importance_sampling_level=args.importance_sampling_level, max_completion_length=T,
            top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=None, use_vllm=False,
            entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
            _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
            _last_world_entropy=float("inf"), _entropy_window_stats=None, aux_loss_enabled=False,
            current_gradient_accumulation_steps=accumulation, model=SimpleNamespace(training=True),
            accelerator=accelerator or Accelerator(), _metrics=defaultdict(lambda: defaultdict(list)), args=args,
        )  # fmt: skip
        trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)

    def loss(self, logprobs, old, ref, advantages, mask, entropy, *, sync=True):
        """TRL's loss and its gradients with respect to the log-probs and the entropies."""
        current = logprobs.detach().clone().requires_grad_(True)
        entropies = entropy.detach().clone().requires_grad_(True)
        self.trainer._get_per_token_logps_and_entropies = lambda *a, **k: (current, entropies, None)
        self.trainer.accelerator.sync_gradients = sync
        inputs = trl_loss_inputs(mask, advantages, old, ref)
        loss = GRPOTrainer._compute_loss(self.trainer, None, inputs)
        loss.backward()
        return loss.detach(), current.grad, entropies.grad


def ours(logprobs, old, ref, advantages, mask, entropy, **settings):
    current = logprobs.clone().requires_grad_(True)
    entropies = entropy.clone().requires_grad_(True)
    settings = {"max_completion_length": T, "num_items": int(mask.sum()), **settings}
    loss, metrics = grpo_loss(current, old, ref, advantages, mask, entropy=entropies, **settings)
    loss.backward()
    grad = entropies.grad if entropies.grad is not None else torch.zeros_like(entropy)
    return loss.detach(), current.grad, grad, metrics


# ------------------------------------------------------------------------------------------- the mask


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.05, 0.999])
def test_the_mask_is_trls_get_high_entropy_mask(quantile):
    for seed in range(20):
        *_, mask, entropy = batch(seed)
        if seed % 2:  # ties: every value repeated
            entropy = torch.round(entropy * 2) / 2
        trainer = SimpleNamespace(accelerator=Accelerator())
        expected = GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask, 1 - quantile)
        threshold = entropy_threshold(entropy, mask, quantile)
        assert torch.equal(high_entropy_mask(entropy, mask, threshold), expected)
        close(threshold, torch.quantile(entropy[mask], 1 - quantile))


def test_the_mask_over_two_ranks_is_trls():
    """TRL takes the quantile over every process's tokens; ours over the pool ``all_ranks_pool`` gathers."""
    *_, mask, entropy = batch(1)
    *_, other_mask, other_entropy = batch(2)
    other_mask, other_entropy = other_mask[:4, :5], other_entropy[:4, :5] + 1  # another shape, other values
    trainer = SimpleNamespace(accelerator=Accelerator(other=other_entropy[other_mask]))
    expected = GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask, 1 - 0.3)

    def all_gather(t):  # Lightning's: the same shape on every rank, stacked in rank order
        theirs = torch.where(other_mask, other_entropy, math.nan).flatten()
        theirs = torch.tensor([theirs.numel()]) if t.dtype == torch.long else torch.cat(
            [theirs, torch.full((t.numel() - theirs.numel(),), math.nan)])  # fmt: skip
        return torch.stack([t, theirs])

    pool = all_ranks_pool(entropy, mask, all_gather)
    kept = high_entropy_mask(entropy, mask, entropy_threshold(entropy, mask, 0.3, pool=pool))
    assert torch.equal(kept, expected)
    alone = high_entropy_mask(entropy, mask, entropy_threshold(entropy, mask, 0.3))
    assert not torch.equal(kept, alone)  # the other rank's tokens moved the threshold


def test_no_token_keeps_nothing():
    *_, mask, entropy = batch(0)
    empty = torch.zeros_like(mask)
    assert entropy_threshold(entropy, empty, 0.2) == math.inf
    assert not high_entropy_mask(entropy, empty, entropy_threshold(entropy, empty, 0.2)).any()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_with_the_mask_equals_trls(loss_type, beta):
    """The policy term on the kept tokens only, the KL term on all of them, the aggregation over all of them."""
    data = batch(len(loss_type) * 7 + int(beta * 100))
    trl = TRL(loss_type=loss_type, beta=beta, top_entropy_quantile=0.3).loss(*data)
    loss, grad, _, metrics = ours(*data, loss_type=loss_type, beta=beta, top_entropy_quantile=0.3)
    close(loss, trl[0])
    close(grad, trl[1])
    assert 0.2 < float(metrics["top_entropy_frac"]) < 0.45
    everything = ours(*data, loss_type=loss_type, beta=beta)
    assert float((everything[1] - grad).abs().max()) > 1e-3  # the mask changed the gradient
    if beta:  # a masked token keeps its KL gradient
        mask = data[4]
        dropped = mask & ~high_entropy_mask(data[5], mask, metrics["top_entropy_threshold"])
        assert (grad[dropped].abs() > 0).all()


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_entropy_bonus_equals_trls_when_every_token_counts(loss_type):
    """With a token-mean loss over every token, our −c·H_t aggregated like the loss is TRL's bonus exactly:
    the loss, its gradient in the log-probs and in the entropies."""
    data = batch(11)
    trl = TRL(loss_type=loss_type, entropy_coef=0.07).loss(*data)
    loss, grad, entropy_grad, _ = ours(*data, loss_type=loss_type, entropy_coef=0.07)
    close(loss, trl[0])
    close(grad, trl[1])
    close(entropy_grad.double(), trl[2].double())
    assert (entropy_grad[data[4]] < 0).all()  # the bonus raises the entropy: its gradient descends on −H


def test_entropy_bonus_with_the_mask_is_trls_rescaled_by_the_kept_fraction():
    """With the mask, both put the bonus on the kept tokens; TRL divides it by the kept tokens, ours (dapo:
    token_mean) by every loss token, so ours is TRL's with the coefficient × kept / all."""
    data = batch(12)
    mask = data[4]
    loss, grad, entropy_grad, metrics = ours(*data, loss_type="dapo", entropy_coef=0.07, top_entropy_quantile=0.3)
    kept = high_entropy_mask(data[5], mask, metrics["top_entropy_threshold"])
    scaled = 0.07 * int(kept.sum()) / int(mask.sum())
    trl = TRL(loss_type="dapo", entropy_coef=scaled, top_entropy_quantile=0.3).loss(*data)
    close(loss, trl[0])
    close(grad, trl[1])
    close(entropy_grad.double(), trl[2].double())
    assert (entropy_grad[mask & ~kept] == 0).all() and (entropy_grad[kept] < 0).all()


# ----------------------------------------------------------------------------------- the adaptive coefficient


# Each optimizer step's entropy scale: above the target of 1, then below, then above and below again.
STEPS = [2.6, 2.8, 3.0, 0.4, 0.5, 0.3, 0.2, 3.0, 0.1]


@pytest.mark.parametrize("quantile", [1.0, 0.4])
def test_adaptive_coefficient_follows_trls_controller_step_by_step(quantile):
    """Two micro-batches per optimizer step (TRL's accumulation window, our ``accumulate`` then ``step``): after
    every step the coefficient and the measured entropy are TRL's; with every token kept, so is every loss.
    Starting at 0.05 with δ 0.02 in [0, 0.08], the coefficient hits both bounds."""
    settings = dict(entropy_target=1.0, entropy_coef_delta=0.02, entropy_coef_min=0.0, entropy_coef_max=0.08)
    trl = TRL(accumulation=2, loss_type="bnpo", entropy_coef=0.05, use_adaptive_entropy=True,
              top_entropy_quantile=quantile, **settings)  # fmt: skip
    control = EntropyControl(0.05, quantile=quantile, adaptive=True, target=1.0, delta=0.02, coef_max=0.08)
    coefs, applied, logged = [], [], []
    for step, scale in enumerate(STEPS):
        for micro in range(2):
            logprobs, old, ref, advantages, mask, entropy = batch(100 * step + micro)
            entropy = entropy * scale / 2
            expected = trl.loss(logprobs, old, ref, advantages, mask, entropy, sync=micro == 1)
            settings = control.loss_settings(entropy.requires_grad_(), mask, None)  # what training_step passes
            assert settings["entropy"].requires_grad == (settings["entropy_coef"] != 0)  # no backward without c
            entropy = entropy.detach()
            applied.append(settings["entropy_coef"])
            loss, grad, _, metrics = ours(logprobs, old, ref, advantages, mask, entropy, loss_type="bnpo",
                                          entropy_coef=settings["entropy_coef"],
                                          top_entropy_quantile=settings["top_entropy_quantile"])  # fmt: skip
            control.accumulate(entropy, mask, metrics.get("top_entropy_threshold"))  # as training_step does
            if quantile == 1.0:  # TRL divides each micro-batch's loss by the accumulation; Lightning does
                close(loss / 2, expected[0])
                close(grad / 2, expected[1])
        control.step(log=lambda name, value, **_: logged.append((name, value)))
        close(torch.tensor(control.coef), torch.tensor(trl.trainer.entropy_coef))
        close(torch.tensor(control.last_entropy), torch.tensor(trl.trainer._last_world_entropy))
        coefs.append(control.coef)
    assert coefs == pytest.approx([0.03, 0.01, 0.0, 0.02, 0.04, 0.06, 0.08, 0.06, 0.08])
    assert logged == [("train/entropy_coef", coef) for coef in coefs]  # after each step, as TRL logs it
    assert applied[:2] == [0.0, 0.0]  # no bonus before a first measurement
    assert applied[2:8] == [0.0] * 6  # nor after a step above the target
    assert applied[8:10] == pytest.approx([0.02, 0.02])  # the coefficient the last step left, below the target


def test_a_skipped_step_moves_nothing_and_the_state_round_trips():
    control = EntropyControl(0.1, adaptive=True, target=1.0, delta=0.05, coef_min=0.0, coef_max=1.0)
    *_, mask, entropy = batch(3)
    control.accumulate(entropy * 0.1, mask)
    control.step(skipped=True)
    assert (control.coef, control.last_entropy, control.applied) == (0.1, math.inf, 0.0)
    control.accumulate(entropy * 0.1, mask)
    control.step(lambda t, reduce_op: t * 2)  # a sum over two identical ranks: the same mean
    assert control.coef == pytest.approx(0.15)
    assert control.last_entropy == pytest.approx(float((entropy * 0.1)[mask].mean()), abs=1e-6)
    restored = EntropyControl(0.1, adaptive=True, target=1.0, delta=0.05)
    restored.load_state_dict(control.state_dict())
    assert restored.state_dict() == control.state_dict() and restored.applied == control.applied
    restored.load_state_dict({})  # a checkpoint from before the setting: the state stays
    assert restored.coef == control.coef
    fixed = EntropyControl(0.3)
    fixed.accumulate(entropy, mask)
    fixed.step()
    assert (fixed.coef, fixed.applied, fixed.active) == (0.3, 0.3, True)
    assert not EntropyControl(0.0).active


# ------------------------------------------------------------------------------------------- the settings


@pytest.fixture
def cli_config(tmp_path, monkeypatch):
    """test_loss_ranges.py's base config file; building a model fails the test."""
    monkeypatch.setattr(GRPOModule, "configure_model", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(BASE))
    return tmp_path / "config.yaml"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"top_entropy_quantile": 0.0}, "top_entropy_quantile must be in (0, 1] (got 0.0)"),
        ({"top_entropy_quantile": 1.2}, "top_entropy_quantile must be in (0, 1] (got 1.2)"),
        ({"entropy_coef_delta": 0.0}, "entropy_coef_delta must be > 0 (got 0.0)"),
        ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min and entropy_coef_max must satisfy"),
        ({"entropy_target": -0.1}, "entropy_target must be >= 0 nats (got -0.1)"),
        ({"use_adaptive_entropy": True, "entropy_coef": 1.5}, "entropy_coef = 1.5 (the adaptive coefficient's start)"),
    ],
)
def test_entropy_settings_that_cannot_work_are_refused_in_one_line(capsys, cli_config, settings, message):
    args = [f"--model.objective.{key}={value}" for key, value in settings.items()]
    line = refused(capsys, cli_config, args)
    assert line.startswith(f"error: model.objective.{message}"), line
    objective = parsed(cli_config, ["--model.objective.top_entropy_quantile=0.2"])
    assert objective.top_entropy_quantile == 0.2 and objective.entropy_control().quantile == 0.2
