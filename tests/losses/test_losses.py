"""The losses after GSPO (CISPO, SAPO, GMPO, LUSPO, VESPO), dual clip, the off-policy sequence mask and the
importance-weighted KL: value and gradient on small cases worked out by hand (plain Python arithmetic in the
test), micro-batch invariance for every aggregation, and the registry (a user's loss by import path, one-line
refusals). The GRPO family's hand tests are in test_loss.py, the cross-check against TRL in test_loss_trl.py.
"""

from __future__ import annotations

import math
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_lightning.config import ConfigError, ObjectiveConfig
from grpo_lightning.losses import AGGREGATIONS, LossInputs, available_policy_losses, get_policy_loss, grpo_loss


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def close(actual, expected, atol=1e-9):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-9)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def run(logp, old, adv, mask, **kwargs):
    """Loss, metrics and d loss / d logp."""
    leaf = t(logp).requires_grad_(True)
    loss, metrics = grpo_loss(leaf, None if old is None else t(old), kwargs.pop("ref", None), t(adv),
                              torch.tensor(mask, dtype=torch.bool), **kwargs)  # fmt: skip
    loss.backward()
    return loss.detach(), metrics, leaf.grad


LN = math.log
# One completion of two tokens, probabilities 0.5 and 0.25 now, ratios 1.5 and 0.5 to π_old.
LOGP2 = [[LN(0.5), LN(0.25)]]
OLD2 = [[LN(0.5) - LN(1.5), LN(0.25) - LN(0.5)]]


# ------------------------------------------------------------------------------------------------ CISPO
def test_cispo_weights_each_tokens_log_prob_by_its_clipped_detached_ratio():
    # Defaults (no lower bound, cap 1 + 4 = 5): weights 1.5 and 0.5 unclipped. A = 2, token_mean over 2 tokens:
    # L = -(1.5 * 2 * ln 0.5 + 0.5 * 2 * ln 0.25) / 2; dL/dlogp_t = -w_t * A / 2 (the weight has no gradient).
    loss, m, grad = run(LOGP2, OLD2, [2.0], [[1, 1]], loss_type="cispo")
    close(loss, -(1.5 * 2 * LN(0.5) + 0.5 * 2 * LN(0.25)) / 2)
    close(grad, [[-1.5, -0.5]])
    close(m["clip_frac"], 0.0)
    # The paper's relative clip [1 - 0.2, 1 + 0.2]: weights 1.2 and 0.8, and both tokens still get a gradient
    # (PPO's clip would give the first none).
    loss, m, grad = run(LOGP2, OLD2, [2.0], [[1, 1]], loss_type="cispo", epsilon_low=0.2, epsilon_high=0.2)
    close(loss, -(1.2 * 2 * LN(0.5) + 0.8 * 2 * LN(0.25)) / 2)
    close(grad, [[-1.2, -0.8]])
    close(m["clip_frac_high"], 0.5)
    close(m["clip_frac_low"], 0.5)


# ------------------------------------------------------------------------------------------------- SAPO
def test_sapo_gate_by_the_sign_of_the_advantage():
    # Row 0: one token, ρ = 1.5, A = +1 → τ = 1:    L = -σ(0.5)·4,              dL/dlogp = -4σ(1-σ)·ρ
    # Row 1: one token, ρ = 0.5, A = -1 → τ = 1.05: L = +σ(-0.525)·4/1.05,      dL/dlogp = +4σ(1-σ)·ρ
    # sequence_mean over 2 rows halves both.
    logp, old = [[LN(0.5)], [LN(0.25)]], [[LN(0.5) - LN(1.5)], [LN(0.25) - LN(0.5)]]
    loss, _, grad = run(logp, old, [1.0, -1.0], [[1], [1]], loss_type="sapo")
    s0, s1 = sigmoid(0.5), sigmoid(1.05 * -0.5)
    close(loss, (-s0 * 4 + s1 * 4 / 1.05) / 2)
    close(grad, [[-4 * s0 * (1 - s0) * 1.5 / 2], [4 * s1 * (1 - s1) * 0.5 / 2]])
    # On-policy the gate's slope is 1: the plain policy gradient -A / 2 per row.
    _, _, grad = run(logp, None, [1.0, -1.0], [[1], [1]], loss_type="sapo", loss_kwargs={"tau_pos": 3.0})
    close(grad, [[-0.5], [0.5]])


# ------------------------------------------------------------------------------------------------- GMPO
def test_gmpo_clips_in_log_space_by_the_sign_and_takes_the_geometric_mean():
    # Both rows: log-ratios (0.1, 0.6, -0.5), ε = 0.4.
    # A = +1: min(ℓ, clip ℓ) = (0.1, 0.4, -0.5), mean 0 → L = -1·e^0;  the clipped token has no gradient:
    #         dL/dlogp = -e^0 · (1/3) · (1, 0, 1)
    # A = -1: max(ℓ, clip ℓ) = (0.1, 0.6, -0.4), mean 0.1 → L = +e^0.1; dL/dlogp = e^0.1 · (1/3) · (1, 1, 0)
    # sequence_mean over the 2 rows halves everything.
    logp = [[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]]
    old = [[p - lr for p, lr in zip(row, (0.1, 0.6, -0.5))] for row in logp]
    loss, m, grad = run(logp, old, [1.0, -1.0], [[1, 1, 1], [1, 1, 1]], loss_type="gmpo")
    close(loss, (-1.0 + math.exp(0.1)) / 2)
    close(grad, [[-1 / 6, 0.0, -1 / 6], [math.exp(0.1) / 6, math.exp(0.1) / 6, 0.0]])
    close(m["clip_frac_high"], 1 / 6)  # (0.6 with A > 0) of 6 tokens
    close(m["clip_frac_low"], 1 / 6)  # (-0.5 with A < 0)


# ------------------------------------------------------------------------------------------------ LUSPO
def test_luspo_weights_each_completion_by_its_length():
    # Row 0: one token, ℓ = 0.1; row 1: three tokens, ℓ = (0.3, 0, 0): both s = e^0.1, inside [0.8, 1.2], A = 1.
    # L = (1/2)(1·(-s) + 3·(-s)); row 1's tokens each get -3·s·(1/3)/2 = -s/2, row 0's token -s/2.
    # GSPO (grpo at sequence level) would weigh the rows alike: -s/2 for row 0, -s/6 for each of row 1's.
    logp = [[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.5]]
    old = [[-1.1, 0.0, 0.0], [-1.3, -2.0, -0.5]]
    mask = [[1, 0, 0], [1, 1, 1]]
    s = math.exp(0.1)
    loss, _, grad = run(logp, old, [1.0, 1.0], mask, loss_type="luspo", epsilon_low=0.2, epsilon_high=0.2)
    close(loss, -(s + 3 * s) / 2)
    close(grad, [[-s / 2, 0, 0], [-s / 2, -s / 2, -s / 2]])
    _, _, gspo = run(logp, old, [1.0, 1.0], mask, importance_sampling_level="sequence")
    close(gspo, [[-s / 2, 0, 0], [-s / 6, -s / 6, -s / 6]])


# ------------------------------------------------------------------------------------------------ VESPO
def test_vespo_gamma_weight_of_the_summed_log_ratio():
    # Row 0: A = +1, ℓ = (0.2, -0.1) → log w = 0.1, φ = exp(3 + 2·0.1 - 3·e^0.1)   (k_pos 2, λ_pos 3)
    # Row 1: A = -1, ℓ = (0.5, 0.0) → log w = 0.5, φ = exp(2 + 3·0.5 - 2·e^0.5)    (k_neg 3, λ_neg 2)
    # L_t = -φ·A·logp_t, token_mean over 4 tokens: dL/dlogp_t = -φ·A/4 (φ has no gradient).
    logp = [[-1.0, -2.0], [-0.5, -1.5]]
    old = [[-1.2, -1.9], [-1.0, -1.5]]
    phi0 = math.exp(3 + 2 * 0.1 - 3 * math.exp(0.1))
    phi1 = math.exp(2 + 3 * 0.5 - 2 * math.exp(0.5))
    loss, m, grad = run(logp, old, [1.0, -1.0], [[1, 1], [1, 1]], loss_type="vespo")
    close(loss, (-phi0 * (-1.0 - 2.0) + phi1 * (-0.5 - 1.5)) / 4)
    close(grad, [[-phi0 / 4, -phi0 / 4], [phi1 / 4, phi1 / 4]])
    close(m["vespo_weight_mean"], (phi0 + phi1) / 2)
    # On-policy w = 1 and φ(1) = 1: the plain policy gradient.
    _, _, grad = run(logp, None, [1.0, -1.0], [[1, 1], [1, 1]], loss_type="vespo")
    close(grad, [[-0.25, -0.25], [0.25, 0.25]])


def test_vespo_folds_the_sampler_weights_into_w_and_is_not_weighted_again():
    # π_old / π_engine = e^0.3 on row 0's first token (inside the cap 2): log w = 0.1 + 0.3.
    logp, old = [[-1.0, -2.0]], [[-1.2, -1.9]]
    engine = [[-1.5, -1.9]]
    phi = math.exp(3 + 2 * 0.4 - 3 * math.exp(0.4))
    loss, _, grad = run(logp, old, [1.0], [[1, 1]], loss_type="vespo", engine_logprobs=t(engine))
    close(grad, [[-phi / 2, -phi / 2]])
    with pytest.raises(ValueError, match="tis_level token"):
        run(logp, old, [1.0], [[1, 1]], loss_type="vespo", engine_logprobs=t(engine), tis_level="sequence")


# --------------------------------------------------------------------------------------------- dual clip
def test_dual_clip_bounds_negative_advantage_losses_by_c_times_abs_a():
    # A = -1. ρ = 4: PPO gives -min(-4, -1.2) = 4 with slope 4; c = 3 bounds it at 3, slope 0.
    #         ρ = 2: -min(-2, -1.2) = 2 < 3, unchanged, slope 2. grpo over 2 one-token rows halves.
    logp, old = [[0.0], [0.0]], [[-LN(4)], [-LN(2)]]
    loss, m, grad = run(logp, old, [-1.0, -1.0], [[1], [1]], clip_ratio_c=3.0)
    close(loss, (3 + 2) / 2)
    close(grad, [[0.0], [1.0]])
    close(m["clip_frac_dual"], 0.5)
    loss, _, grad = run(logp, old, [-1.0, -1.0], [[1], [1]])
    close(loss, (4 + 2) / 2)
    close(grad, [[2.0], [1.0]])


# ---------------------------------------------------------------------------------- off-policy sequence mask
def test_off_policy_mask_drops_negative_completions_far_from_the_sampler():
    # On-policy, one-token rows; mean log π_sampler - log π_θ: 0.6, 0.3, 1.0; A: -1, -1, +1; δ = 0.5.
    # Row 0 is dropped (A < 0, drift > δ); row 1 is close enough; row 2 has A > 0. grpo: L = (0 + 1 - 1)/3.
    logp = [[-1.0], [-1.0], [-1.0]]
    engine = t([[-0.4], [-0.7], [0.0]])
    loss, m, grad = run(logp, None, [-1.0, -1.0, 1.0], [[1], [1], [1]], off_policy_mask=0.5,
                        engine_logprobs=engine, tis_cap=None)  # fmt: skip
    close(loss, 0.0)
    close(grad, [[0.0], [1 / 3], [-1 / 3]])
    close(m["off_policy_masked_frac"], 1 / 3)
    _, _, kept = run(logp, None, [-1.0, -1.0, 1.0], [[1], [1], [1]], engine_logprobs=engine, tis_cap=None)
    close(kept, [[1 / 3], [1 / 3], [-1 / 3]])


# ------------------------------------------------------------------------------------ importance-weighted KL
def test_importance_weighted_k3_kl():
    # One token, A = 0 (no policy term), β = 1: ρ = 2 (ℓ = ln 2), d = log π_ref - log π_θ = -0.5.
    # k3 = e^d - d - 1; weighted: ρ·k3, d/dlogp = ρ·k3 + ρ·(1 - e^d) (dρ/dlogp = ρ, dd/dlogp = -1).
    d, rho = -0.5, 2.0
    k3 = math.exp(d) - d - 1
    ref = t([[-1.5]])
    loss, m, grad = run([[-1.0]], [[-1.0 - LN(2)]], [0.0], [[1]], beta=1.0, ref=ref, kl_importance_weighted=True)
    close(loss, rho * k3)
    close(grad, [[rho * k3 + rho * (1 - math.exp(d))]])
    close(m["kl"], k3)  # the logged KL is the plain estimate
    loss, _, grad = run([[-1.0]], [[-1.0 - LN(2)]], [0.0], [[1]], beta=1.0, ref=ref)
    close(loss, k3)
    close(grad, [[1 - math.exp(d)]])


# ------------------------------------------------------------------------------ micro-batch invariance
def rollout(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2, 0, 4]
    mask = torch.tensor([[i < n for i in range(4)] for n in lengths])
    logp = -torch.rand(6, 4, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(6, 4, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(6, 4, generator=g, dtype=torch.float64)
    engine = old + 0.2 * torch.randn(6, 4, generator=g, dtype=torch.float64)
    return logp, old, ref, engine, t([1.0, -0.5, 0.7, -1.2, 0.3, -0.4]), mask


def combinations():
    for name in available_policy_losses():
        if get_policy_loss(name).micro_batch_statistics:  # by definition not (test_covariance_losses.py)
            continue
        for aggregation in get_policy_loss(name).aggregations:
            yield name, aggregation


@pytest.mark.parametrize("loss_type, aggregation", list(combinations()))
def test_every_loss_and_aggregation_gives_a_step_independent_of_the_micro_batch_size(loss_type, aggregation):
    """The trainer averages micro-batch losses (and multiplies ``token_mean`` back by their number): the step must
    be the same for 1, 2, 3 or 6 rows per micro-batch; ``micro_batch_token_mean`` by definition is not."""
    logp, old, ref, engine, adv, mask = rollout()
    settings = dict(loss_type=loss_type, aggregation=aggregation, beta=0.05, kl_importance_weighted=True,
                    off_policy_mask=0.2, num_items=int(mask.sum()), max_completion_length=4)  # fmt: skip
    grads = []
    for rows in (6, 3, 2, 1):
        leaf = logp.clone().requires_grad_(True)
        losses = []
        for s in range(0, 6, rows):
            sl = slice(s, s + rows)
            loss, _ = grpo_loss(leaf[sl], old[sl], ref[sl], adv[sl], mask[sl], **settings)
            losses.append(loss)
        step = sum(losses) if aggregation == "token_mean" else sum(losses) / len(losses)
        step.backward()
        grads.append(leaf.grad)
    assert grads[0].abs().sum() > 0
    if aggregation == "micro_batch_token_mean":
        assert not torch.allclose(grads[0], grads[-1])
        return
    for grad in grads[1:]:
        close(grad, grads[0], atol=1e-12)


# ------------------------------------------------------------------------------------------------ registry
USER_LOSSES = """
import torch

def reinforce(inputs, *, scale=1.0):
    return -scale * inputs.advantages * inputs.logprobs, {"user_scale": torch.tensor(scale)}

def needs_setting(inputs, *, alpha):
    return -alpha * inputs.advantages * inputs.logprobs, {}

def no_inputs():
    return None

def positional_setting(inputs, alpha):
    return None

not_a_function = 3
"""


@pytest.fixture
def user_losses(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(textwrap.dedent(USER_LOSSES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_losses"
    sys.modules.pop("my_losses", None)


def test_a_users_loss_by_import_path_is_called_with_its_settings(user_losses):
    loss, m, grad = run(LOGP2, None, [2.0], [[1, 1]], loss_type=f"{user_losses}:reinforce",
                        loss_kwargs={"scale": 3.0})  # fmt: skip
    # -3·A·logp, sequence_mean (a user loss's default) over one row of 2 tokens.
    close(loss, -3 * 2 * (LN(0.5) + LN(0.25)) / 2)
    close(grad, [[-3.0, -3.0]])
    close(m["user_scale"], 3.0)
    spec = get_policy_loss(f"{user_losses}.reinforce")  # the dotted form works too
    assert spec.aggregation == "sequence_mean" and spec.aggregations == AGGREGATIONS


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"loss_type": "bogus"}, "unknown loss_type 'bogus': use one of bnpo, cispo, clip_cov, dapo"),
        ({"loss_type": "my_losses:missing"}, "loss_type 'my_losses:missing' cannot be imported"),
        ({"loss_type": "nowhere.at_all:fn"}, "cannot be imported: No module named 'nowhere'"),
        ({"loss_type": "my_losses:not_a_function"}, "is not callable"),
        ({"loss_type": "my_losses:no_inputs"}, "must take the LossInputs as its first positional parameter"),
        ({"loss_type": "my_losses:positional_setting"}, "parameter 'alpha' after inputs must be a keyword"),
        ({"loss_type": "my_losses:needs_setting"}, "needs alpha: set it in model.objective.loss_kwargs"),
        ({"loss_type": "my_losses:reinforce", "loss_kwargs": {"scal": 1.0}}, "loss_kwargs.scal is not a setting"),
        ({"loss_type": "my_losses:reinforce", "epsilon_low": 0.2}, "epsilon_low is not a setting of loss_type"),
        ({"loss_type": "sapo", "loss_kwargs": {"tau": 1.0}}, "its settings: tau_pos, tau_neg, importance_sampling"),
        ({"loss_type": "sapo", "delta": 2.0}, "delta is not a setting of loss_type 'sapo'"),
        ({"loss_type": "gmpo", "importance_sampling_level": "token"}, "importance_sampling_level is not a setting"),
        ({"loss_type": "luspo", "importance_sampling_level": "token"}, "importance_sampling_level is not a setting"),
        ({"loss_type": "grpo", "aggregation": "token_mean"}, "contradicts loss_type 'grpo': its objective"),
        ({"loss_type": "gmpo", "aggregation": "token_mean"}, "(GMPO) fixes sequence_mean"),
        ({"loss_type": "cispo", "loss_kwargs": {"epsilon_high": 5.0}}, "set epsilon_high directly under"),
        ({"loss_type": "vespo", "tis_level": "sequence"}, "tis_level must be token with loss_type vespo"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c = 1.0 is outside loss_type 'grpo''s range (1, inf)"),
        ({"off_policy_mask": -1.0}, "off_policy_mask must be >= 0"),
    ],
)
def test_bad_loss_settings_are_refused_in_one_line_when_the_config_is_read(user_losses, settings, message):
    with pytest.raises(ConfigError) as error:
        ObjectiveConfig(**settings)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("model.objective")


def test_free_aggregations_and_loss_defaults():
    assert ObjectiveConfig(loss_type="sapo", aggregation="token_mean").aggregation_in_use == "token_mean"
    assert ObjectiveConfig(loss_type="cispo").aggregation_in_use == "token_mean"
    assert ObjectiveConfig(loss_type="dapo").aggregation_in_use == "token_mean"
    resolved = ObjectiveConfig(loss_type="gmpo").resolved()
    assert (resolved["epsilon_low"], resolved["aggregation"]) == (0.4, "sequence_mean")
    # A config that leaves the defaults unset equals one that writes them out (checkpoint comparisons).
    explicit = ObjectiveConfig(epsilon_low=0.2, importance_sampling_level="token", aggregation="sequence_mean")
    assert ObjectiveConfig().resolved() == explicit.resolved()


def test_loss_inputs_sequence_ratio_has_gspo_value_and_token_gradients():
    logp = t([[-1.0, -2.0, 5.0]]).requires_grad_(True)
    inputs = LossInputs(logp, t([[-1.2, -1.6, 0.0]]), t([[1.0, 1.0, 1.0]]), torch.tensor([[True, True, False]]))
    ratio = inputs.ratio("sequence")
    close(ratio.detach()[0, :2], [math.exp(-0.1)] * 2)
    ratio[0, 0].backward()
    close(logp.grad, [[math.exp(-0.1), 0.0, 0.0]])


def test_a_users_loss_by_import_path_trains_the_quickstart(user_losses, tmp_path, monkeypatch):
    """The quickstart's 40 rounds with ``loss_type: my_losses:reinforce`` (−scale·A·log π, the user's own) learn
    the task as the built-in losses do (30.6% before; docs/losses.md's recipe table has 98–99% after)."""
    from grpo_lightning.cli import GRPOCLI

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(root / "configs/quickstart.yaml"), "--model.model_name_or_path",
            str(root / "grpo_lightning/assets/tiny-arith"), "--model.objective.loss_type", f"{user_losses}:reinforce",
            "--model.objective.loss_kwargs", "{scale: 1.0}", "--trainer.logger", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.check_val_every_n_epoch", "40"]  # fmt: skip
    cli = GRPOCLI(args=args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert float(cli.trainer.callback_metrics["train/user_scale"]) == 1.0  # the user's loss ran
    assert float(cli.trainer.callback_metrics["val/accuracy"]) > 0.9


def test_the_readmes_loss_example_runs_by_import_path(tmp_path, monkeypatch):
    page = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
    section = page.read_text().split("A loss of your own", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    (tmp_path / "my_losses.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_losses", None)
    config = ObjectiveConfig(loss_type="my_losses:clipped_reinforce", loss_kwargs={"cap": 1.2})
    assert config.aggregation_in_use == "sequence_mean"
    # Ratios 1.5 and 0.5, capped at 1.2: -(1.2·2·ln 0.5 + 0.5·2·ln 0.25) / 2 over one completion.
    loss, m, grad = run(LOGP2, OLD2, [2.0], [[1, 1]], loss_type=config.loss_type, loss_kwargs=config.loss_kwargs)
    close(loss, -(1.2 * 2 * LN(0.5) + 0.5 * 2 * LN(0.25)) / 2)
    close(grad, [[-1.2, -0.5]])
    close(m["weight_mean"], (1.2 + 0.5) / 2)
    sys.modules.pop("my_losses", None)


def test_objective_settings_saved_before_these_fields_existed_load_with_their_defaults():
    """A checkpoint's hyperparameters hold the pickled ``ObjectiveConfig``; one written before ``aggregation`` &c.
    existed (and with ``epsilon_low: 0.2`` written out, the old default) loads as Lightning loads it and compares
    equal to today's defaults."""
    import io

    import grpo_lightning.module  # noqa: F401 (allows ObjectiveConfig for weights_only loading)
    from grpo_lightning.config_checks import check_checkpoint_hparams

    old = ObjectiveConfig(epsilon_low=0.2, importance_sampling_level="token")
    for name in ("aggregation", "clip_ratio_c", "loss_kwargs", "off_policy_mask", "kl_importance_weighted"):
        del old.__dict__[name]
    buffer = io.BytesIO()
    torch.save({"objective": old}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["objective"]
    assert (loaded.aggregation, loaded.kl_importance_weighted, loaded.aggregation_in_use) == (
        None,
        False,
        "sequence_mean",
    )
    assert check_checkpoint_hparams({"objective": loaded}, {"objective": ObjectiveConfig()}, "'x'") == []
    assert check_checkpoint_hparams({"objective": loaded}, {"objective": ObjectiveConfig(loss_type="dapo")}, "'x'")


@pytest.mark.parametrize("loss_type, aggregation", [c for c in combinations() if c[1] != "micro_batch_token_mean"])
def test_given_the_steps_rows_and_tokens_any_grouping_of_rows_gives_the_same_step(loss_type, aggregation):
    """Balanced micro-batches hold unequal row counts: with ``num_rows`` and ``num_items`` (the step's) the summed
    micro-batch losses (what the trainer's rescaling makes of them) are the step's loss, for any grouping."""
    logp, old, ref, engine, adv, mask = rollout()
    settings = dict(loss_type=loss_type, aggregation=aggregation, beta=0.05, num_items=int(mask.sum()), num_rows=6,
                    max_completion_length=4)  # fmt: skip
    grads = []
    for grouping in ([[0, 1, 2, 3, 4, 5]], [[0, 1, 2, 3], [4], [5]], [[5, 1], [0, 2, 3, 4]]):
        leaf = logp.clone().requires_grad_(True)
        groups = [torch.tensor(g) for g in grouping]
        step = sum(grpo_loss(leaf[g], old[g], ref[g], adv[g], mask[g], **settings)[0] for g in groups)
        step.backward()
        grads.append(leaf.grad)
    assert grads[0].abs().sum() > 0
    for grad in grads[1:]:
        close(grad, grads[0], atol=1e-12)
