"""Tests for grpo_lightning.losses' grpo_loss (advantages: test_advantages.py; TIS: test_tis.py).

Expected values are derived by hand (plain Python arithmetic).
"""

import math

import pytest
import torch

from grpo_lightning.advantages import group_advantages
from grpo_lightning.losses import grpo_loss

EPS = 1e-4


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# ----------------------------------------------------------------------------- grpo_loss: hand example

# Row 0 has 3 tokens, row 1 has 2 (+1 padding token holding garbage that must be ignored).
MASK = [[1, 1, 1], [1, 1, 0]]
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.3, -0.5, -1.5], [-0.3, -0.8, -5.0]]
ADV = [1.0, -0.5]
# log-ratios: row 0 (0.3, 0, -0.5), row 1 (0, -0.4). With eps = 0.2 (clip range [0.8, 1.2]):
#   r0t0: rho = e^0.3 = 1.35 > 1.2, A > 0 -> clipped: -1.2          (clip high active)
#   r0t1: rho = 1                         -> -1
#   r0t2: rho = e^-0.5, A > 0, min picks the unclipped rho  -> -e^-0.5
#   r1t0: rho = 1, A = -0.5               -> 0.5
#   r1t1: rho = e^-0.4 = 0.67 < 0.8, A < 0 -> min(-0.335, -0.4) = -0.4 -> 0.4 (clip low active)
ROW0 = -1.2 - 1.0 - math.exp(-0.5)
ROW1 = 0.5 + 0.4


def hand_inputs(requires_grad=False):
    logp = t(LOGP).requires_grad_(requires_grad)
    return logp, t(OLD), t(ADV), torch.tensor(MASK, dtype=torch.bool)


@pytest.mark.parametrize(
    "loss_type,kwargs,expected",
    [
        ("grpo", {}, (ROW0 / 3 + ROW1 / 2) / 2),
        ("dapo", {}, (ROW0 + ROW1) / 5),
        ("dapo", {"num_items": 10}, (ROW0 + ROW1) / 10),
        ("bnpo", {}, (ROW0 + ROW1) / 5),
        ("dr_grpo", {"max_completion_length": 4}, (ROW0 + ROW1) / (2 * 4)),
    ],
)
def test_loss_types_hand_values(loss_type, kwargs, expected):
    logp, old, adv, mask = hand_inputs()
    loss, metrics = grpo_loss(logp, old, None, adv, mask, loss_type=loss_type, **kwargs)
    close(loss, expected)
    close(metrics["pg_loss"], expected)
    close(metrics["kl"], 0.0)


def test_metrics_hand_example():
    logp, old, adv, mask = hand_inputs()
    _, m = grpo_loss(logp, old, None, adv, mask)
    close(m["clip_frac_low"], 1 / 5)
    close(m["clip_frac_high"], 1 / 5)
    close(m["clip_frac"], 2 / 5)
    ratios = [math.exp(0.3), 1.0, math.exp(-0.5), 1.0, math.exp(-0.4)]
    close(m["ratio_mean"], sum(ratios) / 5)
    close(m["ratio_min"], math.exp(-0.5))
    close(m["ratio_max"], math.exp(0.3))  # not e^5 from the padding token
    assert "entropy" not in m
    assert all(not v.requires_grad for v in m.values())


def test_epsilon_high_asymmetric():
    logp, old, adv, mask = hand_inputs()
    # eps_high = 0.4: e^0.3 = 1.35 < 1.4 so r0t0 is no longer clipped; low side unchanged (0.8).
    loss, m = grpo_loss(logp, old, None, adv, mask, epsilon_high=0.4, loss_type="bnpo")
    close(loss, (ROW0 + 1.2 - math.exp(0.3) + ROW1) / 5)
    close(m["clip_frac_high"], 0.0)
    close(m["clip_frac_low"], 1 / 5)
    # eps_low = 0.4: r1t1 rho 0.67 is inside [0.6, ...], so it takes 0.5 * e^-0.4 instead of 0.4.
    loss, m = grpo_loss(logp, old, None, adv, mask, epsilon_low=0.4, epsilon_high=0.2, loss_type="bnpo")
    close(loss, (ROW0 + ROW1 - 0.4 + 0.5 * math.exp(-0.4)) / 5)
    close(m["clip_frac_low"], 0.0)
    close(m["clip_frac_high"], 1 / 5)


def test_delta_caps_ratio_for_negative_advantages():
    # rho = e^{ln 3} = 3, A = -1: standard clipping gives -min(-3, -1.2) = 3 with gradient -A * rho = 3;
    # delta = 2 caps the unclipped branch: -min(-2, -1.2) = 2, and the gradient vanishes.
    logp = t([[math.log(3.0)]]).requires_grad_(True)
    old, adv, mask = t([[0.0]]), t([-1.0]), torch.ones(1, 1)
    loss, _ = grpo_loss(logp, old, None, adv, mask)
    close(loss, 3.0)
    loss.backward()
    close(logp.grad, [[3.0]])
    logp.grad = None
    loss, _ = grpo_loss(logp, old, None, adv, mask, delta=2.0)
    close(loss, 2.0)
    loss.backward()
    close(logp.grad, [[0.0]])
    # With A > 0 the clip already binds at 1 + eps, delta changes nothing.
    loss, _ = grpo_loss(logp.detach(), old, None, t([1.0]), mask, delta=2.0)
    close(loss, -1.2)


# ----------------------------------------------------------------------------- KL

# d = ref - logp = (-0.5, 1.0)
KL_LOGP, KL_REF = [[-1.0, -2.0]], [[-1.5, -1.0]]
K1 = (0.5 + -1.0) / 2
K2 = (0.5**2 / 2 + 1.0**2 / 2) / 2
K3 = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1.0 - 1)) / 2


@pytest.mark.parametrize("estimator,expected", [("k1", K1), ("k2", K2), ("k3", K3)])
def test_kl_estimators(estimator, expected):
    logp, ref, mask = t(KL_LOGP), t(KL_REF), torch.ones(1, 2)
    # Zero advantages: the surrogate is 0, so the loss is exactly beta * mean KL (one row, grpo).
    loss, m = grpo_loss(logp, None, ref, t([0.0]), mask, beta=0.1, kl_estimator=estimator)
    close(m["kl"], expected)
    close(m["pg_loss"], 0.0)
    close(loss, 0.1 * expected)
    # beta = 0: KL is still reported but not added.
    loss, m = grpo_loss(logp, None, ref, t([0.0]), mask, kl_estimator=estimator)
    close(m["kl"], expected)
    close(loss, 0.0)


def test_beta_kl_added_to_surrogate():
    logp, old, adv, mask = hand_inputs()
    ref = t([[-1.0, -0.5, -2.0], [0.0, -1.2, 0.0]])  # d = 0 except r1t0: d = 0.3
    k3 = math.exp(0.3) - 0.3 - 1
    loss, m = grpo_loss(logp, old, ref, adv, mask, beta=0.5)
    close(loss, (ROW0 / 3 + (ROW1 + 0.5 * k3) / 2) / 2)
    close(m["pg_loss"], (ROW0 / 3 + ROW1 / 2) / 2)
    close(m["kl"], k3 / 5)


# ----------------------------------------------------------------------------- sequence level (GSPO)


def test_sequence_level_values_and_gradient():
    logp, old, adv, mask = hand_inputs(requires_grad=True)
    # Sequence ratios: s0 = exp((0.3 + 0 - 0.5) / 3), s1 = exp((0 - 0.4) / 2); both inside [0.8, 1.2].
    s0, s1 = math.exp(-0.2 / 3), math.exp(-0.2)
    loss, m = grpo_loss(logp, old, None, adv, mask, importance_sampling_level="sequence")
    close(loss, (-s0 * 1.0 + s1 * 0.5) / 2)
    close(m["ratio_min"], s1)
    close(m["ratio_max"], s0)
    close(m["clip_frac"], 0.0)
    loss.backward()
    # d/d logp_{i,t} of -(1/B) A_i s_i = -(1/B) A_i s_i / L_i, the same for every token of row i.
    g0, g1 = -0.5 * 1.0 * s0 / 3, -0.5 * -0.5 * s1 / 2
    close(logp.grad, [[g0, g0, g0], [g1, g1, 0.0]])

    # Token level on the same input: clipped tokens get 0, others -(1/B) A rho / L_i.
    logp.grad = None
    loss, _ = grpo_loss(logp, old, None, adv, mask, importance_sampling_level="token")
    loss.backward()
    close(logp.grad, [[0.0, -1 / 6, -math.exp(-0.5) / 6], [0.5 / 4, 0.0, 0.0]])

    # dapo with sequence ratios: every token of row i carries -A_i s_i.
    loss, _ = grpo_loss(logp, old, None, adv, mask, importance_sampling_level="sequence", loss_type="dapo")
    close(loss, (3 * -s0 + 2 * 0.5 * s1) / 5)


def test_gspo_token_with_per_token_advantages():
    """GSPO-token (Zheng et al. 2025, §4.3): every token has the value s_i of its sequence's ratio, and the
    gradient -A_{i,t} s_i d(log pi_t) of its own advantage, not the row's mean advantage."""
    logp = t([[-1.0, -2.0]]).requires_grad_(True)
    old = t([[-1.1, -2.0]])  # s = exp((0.1 + 0) / 2) = e^0.05 = 1.051, inside [0.8, 1.2]
    adv = t([[1.0, -2.0]])
    s = math.exp(0.05)
    loss, m = grpo_loss(logp, old, None, adv, torch.ones(1, 2), importance_sampling_level="sequence")
    close(loss, (-s * 1.0 + s * 2.0) / 2)  # grpo: (1/|o|) sum_t -s A_t
    close(m["ratio_min"], s)
    close(m["ratio_max"], s)
    loss.backward()
    close(logp.grad, [[-s * 1.0 / 2, s * 2.0 / 2]])  # each token its own advantage


def test_sequence_level_clipped_row_has_no_gradient():
    # Mean log-ratio 0.5 -> s = e^0.5 = 1.65 > 1.2 with A > 0: the whole sequence is clipped.
    logp = t([[0.4, 0.6]]).requires_grad_(True)
    loss, m = grpo_loss(logp, t([[0.0, 0.0]]), None, t([2.0]), torch.ones(1, 2), importance_sampling_level="sequence")
    close(loss, -2 * 1.2)
    close(m["clip_frac_high"], 1.0)
    loss.backward()
    close(logp.grad, [[0.0, 0.0]])


# ----------------------------------------------------------------------------- edge cases


def test_zero_advantages_give_zero_policy_loss():
    logp, old, _, mask = hand_inputs(requires_grad=True)
    adv = group_advantages(t([0.5, 0.5]), 2)  # an all-equal group
    for level in ("token", "sequence"):
        loss, m = grpo_loss(logp, old, None, adv, mask, importance_sampling_level=level)
        close(loss, 0.0)
        close(m["pg_loss"], 0.0)
        loss.backward()
        close(logp.grad, torch.zeros(2, 3))
        logp.grad = None


@pytest.mark.parametrize(
    "loss_type,divisor",
    [("grpo", 1), ("dapo", 1), ("bnpo", 1), ("dr_grpo", 3)],
)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_single_token_completion(loss_type, divisor, level):
    # rho = e^0.2 = 1.2214 > 1.2, A = 2 -> -min(2.443, 2.4) = -2.4.
    logp, old, mask = t([[-0.5, 0.0, 0.0]]), t([[-0.7, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]])
    loss, _ = grpo_loss(
        logp, old, None, t([2.0]), mask, loss_type=loss_type, max_completion_length=3, importance_sampling_level=level
    )
    close(loss, -2.4 / divisor)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fully_masked_row_counts_as_zero(loss_type, level):
    """An all-padding row adds nothing (no NaN leaks from its garbage). "grpo" means over completions, so the
    empty row counts as a 0 among 3 rows (2/3 of the 2-row loss); the token-level losses do not change."""
    nan = float("nan")
    logp, old, adv, mask = hand_inputs()
    ref = logp - 0.1
    ent = t([[0.5, 0.6, 0.7], [0.8, 0.9, 1.0]])
    kwargs = {"loss_type": loss_type, "importance_sampling_level": level, "beta": 0.1, "entropy_coef": 0.01}

    leaf = logp.clone().requires_grad_(True)
    base, base_m = grpo_loss(leaf, old, ref, adv, mask, entropy=ent, **kwargs)
    base.backward()

    # Insert an all-padding row full of NaN garbage between the two real rows.
    def insert(x, fill):
        return torch.cat([x[:1], torch.full_like(x[:1], fill), x[1:]])

    leaf2 = insert(logp, nan).requires_grad_(True)
    loss, m = grpo_loss(
        leaf2, insert(old, nan), insert(ref, nan), insert(adv, nan), insert(mask, False), entropy=insert(ent, nan),
        **kwargs,
    )  # fmt: skip
    loss.backward()
    scale = 2 / 3 if loss_type == "grpo" else 1.0
    close(loss, base * scale)
    assert not torch.isnan(leaf2.grad).any()
    close(leaf2.grad[[0, 2]], leaf.grad * scale)
    close(leaf2.grad[1], torch.zeros(3))
    for key, value in base_m.items():
        close(m[key], value * scale if key == "pg_loss" else value)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fully_masked_input_is_finite(loss_type, level):
    logp = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    loss, m = grpo_loss(
        logp, logp.detach() - 1, logp.detach() + 1, t([1.0, -1.0]), torch.zeros(2, 3), beta=0.1,
        loss_type=loss_type, max_completion_length=3, importance_sampling_level=level, entropy=torch.ones(2, 3),
        entropy_coef=0.1,
    )  # fmt: skip
    close(loss, 0.0)
    loss.backward()  # the graph is intact
    close(logp.grad, torch.zeros(2, 3))
    assert set(m) == {
        "pg_loss", "kl", "clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "ratio_min", "ratio_max",
        "entropy",
    }  # fmt: skip
    for key, value in m.items():
        assert torch.isfinite(value), key


def test_entropy_bonus():
    logp, old, adv, mask = hand_inputs()
    ent = t([[0.3, 0.6, 0.9], [1.0, 2.0, 99.0]])  # 99 is padding
    loss, m = grpo_loss(logp, old, None, adv, mask, entropy=ent, entropy_coef=0.01)
    close(loss, ((ROW0 - 0.01 * 1.8) / 3 + (ROW1 - 0.01 * 3.0) / 2) / 2)
    close(m["entropy"], (0.3 + 0.6 + 0.9 + 1.0 + 2.0) / 5)
    close(m["pg_loss"], (ROW0 / 3 + ROW1 / 2) / 2)
    # Given but with coef 0: logged only.
    loss, m = grpo_loss(logp, old, None, adv, mask, entropy=ent)
    close(loss, (ROW0 / 3 + ROW1 / 2) / 2)
    assert "entropy" in m


def test_per_token_advantages_match_broadcast():
    logp, old, adv, mask = hand_inputs()
    a, _ = grpo_loss(logp, old, None, adv, mask)
    b, _ = grpo_loss(logp, old, None, adv[:, None].expand(2, 3), mask)
    close(a, b)


def test_on_policy_ratio_is_one():
    logp, _, adv, mask = hand_inputs()
    _, m = grpo_loss(logp, None, None, adv, mask)
    close(m["ratio_mean"], 1.0)
    close(m["ratio_min"], 1.0)
    close(m["ratio_max"], 1.0)
    close(m["clip_frac"], 0.0)


# ----------------------------------------------------------------------------- gradients / invariance


def make_rollout(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4, 2]
    mask = torch.tensor([[i < n for i in range(4)] for n in lengths])
    logp = -torch.rand(4, 4, generator=g, dtype=torch.float64) * 2
    old = logp + 0.3 * torch.randn(4, 4, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(4, 4, generator=g, dtype=torch.float64)
    adv = t([1.0, -0.5, 0.7, -1.2])
    return logp, old, ref, adv, mask


def test_dapo_is_micro_batch_invariant():
    logp, old, ref, adv, mask = make_rollout()
    num_items = 3 + 1 + 4 + 2
    totals, grads = [], []
    for mb in (1, 2, 4):
        leaf = logp.clone().requires_grad_(True)
        total = 0.0
        for s in range(0, 4, mb):
            sl = slice(s, s + mb)
            loss, _ = grpo_loss(leaf[sl], old[sl], ref[sl], adv[sl], mask[sl], loss_type="dapo", beta=0.05,
                                num_items=num_items)  # fmt: skip
            total = total + loss
        total.backward()
        totals.append(total.detach())
        grads.append(leaf.grad)
    close(totals[0], totals[1])
    close(totals[0], totals[2])
    close(grads[0], grads[1])
    close(grads[0], grads[2])
    assert grads[0].abs().sum() > 0


def test_on_policy_gradient_is_policy_gradient():
    logp, _, _, adv, mask = make_rollout()
    leaf = logp.clone().requires_grad_(True)
    loss, _ = grpo_loss(leaf, None, None, adv, mask, loss_type="grpo")
    close(loss, -adv.mean())  # ratio == 1 -> -(1/B) sum_i A_i
    loss.backward()

    ref_leaf = logp.clone().requires_grad_(True)
    terms = []
    for i in range(4):
        n = int(mask[i].sum())
        terms.append(adv[i] * ref_leaf[i, :n].sum() / n)
    (-torch.stack(terms).mean()).backward()
    close(leaf.grad, ref_leaf.grad)


# ----------------------------------------------------------------------------- validation


def test_grpo_loss_validation():
    logp, old, adv, mask = hand_inputs()
    for kwarg, allowed in [("loss_type", "dapo"), ("kl_estimator", "k3"), ("importance_sampling_level", "token")]:
        with pytest.raises(ValueError, match=f"{kwarg}.*{allowed}"):
            grpo_loss(logp, old, None, adv, mask, **{kwarg: "bogus"})
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo_loss(logp, old[:, :2], None, adv, mask)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(logp, old, None, adv, mask[:1])
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, old, None, t([1.0, 2.0, 3.0]), mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, old, None, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logp, old, None, adv, mask, loss_type="dr_grpo")
