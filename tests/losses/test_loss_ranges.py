"""Every loss's settings take the range its paper gives them; a value outside is refused when the config is read
(issue 39, point 8).

Through the CLI (``grpo_lightning.cli.main``, the parse path a run takes): for each registered loss and each setting
it declares a range for, a value outside ends the run before any model is built with one line naming the setting,
the loss and the range, and the range's edge is accepted. The table below is the papers' ranges, written out: a
loss registered or a range declared without a row here fails the first test. A user's loss given by import path
declares its own ranges with ``@setting_ranges``, and keeps the generic ones where it declares none.
"""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from conftest import TINY

from grpo_lightning import GRPOModule
from grpo_lightning.cli import GRPOCLI, main
from grpo_lightning.losses import Range, available_policy_losses, get_policy_loss

BASE = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "max_epochs": 1, "logger": False, "enable_checkpointing": False},
    "model": {"tiny_model": asdict(TINY)},
    "data": {"sampling": {"group_size": 4, "max_new_tokens": 4}, "prompts_per_round": 4, "eval": {"limit": 8}},
}

# setting -> (interval, a value outside it, the value at its edge inside it)
CLIPPED = {
    "epsilon_low": ("[0, 1)", 1.0, 0.0),  # 1 − ε_low = 0: a lower ratio clip that clips nothing
    "epsilon_high": ("[0, inf)", -0.01, 0.0),
    "delta": ("(1, inf)", 1.0, 1.01),
    "clip_ratio_c": ("(1, inf)", 1.0, 1.01),
}
VESPO_POWER, VESPO_DECAY = ("(0, inf)", 0.0, 0.01), ("(0, inf)", -1.0, 0.01)
RANGES = {
    **dict.fromkeys(["grpo", "dapo", "dr_grpo", "bnpo", "luspo"], CLIPPED),
    "cispo": {"epsilon_low": ("[0, 1]", 1.01, 1.0), "epsilon_high": ("[0, inf)", -0.5, 0.0)},
    "gmpo": {"epsilon_low": ("[0, inf)", -0.1, 0.0), "epsilon_high": ("[0, inf)", -0.1, 0.0)},
    "sapo": {"tau_pos": ("(0, inf)", 0.0, 0.01), "tau_neg": ("(0, inf)", -1.05, 0.01)},
    "vespo": {"k_pos": VESPO_POWER, "k_neg": VESPO_POWER, "lambda_pos": VESPO_DECAY, "lambda_neg": VESPO_DECAY},
    "clip_cov": {
        "epsilon_low": CLIPPED["epsilon_low"],
        "epsilon_high": CLIPPED["epsilon_high"],
        "clip_cov_ratio": ("(0, 1]", 0.0, 1.0),
        "clip_cov_lb": ("[0, inf)", -1.0, 0.0),  # positive covariances: the tokens that lower the entropy
        "clip_cov_ub": ("(0, inf]", 0.0, 0.01),
    },
    "kl_cov": {"kl_cov_ratio": ("(0, 1]", 1.5, 1.0), "ppo_kl_coef": ("(0, inf)", 0.0, 0.01)},
}
GENERIC = ("epsilon_low", "epsilon_high", "delta", "clip_ratio_c")


def flags(loss_type: str, values: dict[str, float]) -> list[str]:
    """Command-line flags setting ``values`` for ``loss_type``: the generic settings directly, the others in
    ``loss_kwargs``."""
    out = ["--model.objective.loss_type", loss_type]
    for key, value in values.items():
        if key in GENERIC:
            out += [f"--model.objective.{key}", repr(value)]
    kwargs = {key: value for key, value in values.items() if key not in GENERIC}
    return out + (["--model.objective.loss_kwargs", json.dumps(kwargs)] if kwargs else [])


@pytest.fixture
def config(tmp_path, monkeypatch):
    """The base config's path; the working directory a run would use; nothing may build a model."""

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(GRPOModule, "configure_model", no_model)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(BASE))
    return tmp_path / "config.yaml"


def refused(capsys, config: Path, args: list[str]) -> str:
    """The one error line of ``fit`` with ``args`` (exit status 2, no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(config), *args])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def parsed(config: Path, args: list[str]):
    """The run's ``model.objective`` as the CLI builds it (its classes instantiated, nothing trained)."""
    return GRPOCLI(args=["--config", str(config), *args], run=False).model.objective


def test_every_registered_loss_declares_the_ranges_of_this_table():
    assert set(RANGES) == set(available_policy_losses())
    for name, table in RANGES.items():
        declared = get_policy_loss(name).ranges
        assert {key: value.interval for key, value in declared.items()} == {k: v[0] for k, v in table.items()}, name


CASES = [(name, key) for name in sorted(RANGES) for key in RANGES[name]]


@pytest.mark.parametrize("loss_type, setting", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_a_value_outside_its_losss_range_is_refused_when_the_config_is_read(capsys, config, loss_type, setting):
    interval, bad, _ = RANGES[loss_type][setting]
    where = setting if setting in GENERIC else f"loss_kwargs.{setting}"
    line = refused(capsys, config, flags(loss_type, {setting: bad}))
    assert line.startswith(
        f"error: model.objective.{where} = {bad!r} is outside loss_type {loss_type!r}'s range {interval} ("
    ), line


@pytest.mark.parametrize("loss_type", sorted(RANGES))
def test_each_range_accepts_its_edges_and_the_losss_defaults(config, loss_type):
    edges = {key: inside for key, (_, _, inside) in RANGES[loss_type].items()}
    objective = parsed(config, flags(loss_type, edges))
    given = {**objective.generic_settings, **(objective.loss_kwargs or {})}
    assert {key: given[key] for key in edges} == edges
    assert parsed(config, ["--model.objective.loss_type", loss_type]).loss_type == loss_type


def test_the_same_setting_takes_each_losss_own_range(capsys, config):
    """ε_low = 1.5 is a lower ratio clip below 0 for grpo, no lower bound past 0 for cispo, and e^−1.5 for gmpo."""
    assert "range [0, 1)" in refused(capsys, config, flags("grpo", {"epsilon_low": 1.5}))
    assert "range [0, 1]" in refused(capsys, config, flags("cispo", {"epsilon_low": 1.5}))
    assert parsed(config, flags("gmpo", {"epsilon_low": 1.5})).epsilon_low == 1.5


USER_LOSSES = """
from grpo_lightning.losses import Range, setting_ranges

@setting_ranges(scale=Range("(0, 10]", "a step size"), epsilon_low="[0, 2]")
def scaled(inputs, *, scale=1.0, epsilon_low=0.2):
    return -scale * inputs.advantages * inputs.logprobs, {}

def undeclared(inputs, *, delta=None):
    return -inputs.advantages * inputs.logprobs, {}

@setting_ranges(sacle="(0, 10]")
def typo(inputs, *, scale=1.0):
    return -scale * inputs.advantages * inputs.logprobs, {}
"""


@pytest.fixture
def user_losses(config):
    (config.parent / "ranged_losses.py").write_text(textwrap.dedent(USER_LOSSES))
    yield "ranged_losses"
    sys.modules.pop("ranged_losses", None)


def test_a_users_loss_by_import_path_declares_its_own_ranges(capsys, config, user_losses):
    scaled = f"{user_losses}:scaled"
    assert refused(capsys, config, flags(scaled, {"scale": 0.0})) == (
        f"error: model.objective.loss_kwargs.scale = 0.0 is outside loss_type '{scaled}''s range (0, 10] (a step size)"
    )
    assert refused(capsys, config, flags(scaled, {"scale": 10.5})).startswith("error: model.objective.loss_kwargs")
    # Its own range for a generic setting replaces the generic one: 1.5 is fine here, 2.5 is not.
    assert refused(capsys, config, flags(scaled, {"epsilon_low": 2.5})) == (
        f"error: model.objective.epsilon_low = 2.5 is outside loss_type '{scaled}''s range [0, 2]"
    )
    objective = parsed(config, flags(scaled, {"scale": 10.0, "epsilon_low": 1.5}))
    assert (objective.loss_kwargs, objective.epsilon_low) == ({"scale": 10.0}, 1.5)


def test_a_users_loss_keeps_the_generic_ranges_and_a_range_for_no_setting_is_refused(capsys, config, user_losses):
    undeclared = f"{user_losses}:undeclared"
    assert refused(capsys, config, flags(undeclared, {"delta": 0.5})).startswith(
        f"error: model.objective.delta = 0.5 is outside loss_type '{undeclared}''s range (1, inf)"
    )
    assert parsed(config, flags(undeclared, {"delta": 4.0})).delta == 4.0
    assert refused(capsys, config, ["--model.objective.loss_type", f"{user_losses}:typo"]) == (
        f"error: model.objective: loss_type '{user_losses}:typo' declares a range for 'sacle', not one of its settings"
    )


def test_a_range_is_an_interval():
    assert Range("[0, 1)").accepts(0.0) and not Range("[0, 1)").accepts(1.0)
    assert Range("(0, inf)").accepts(1e300) and not Range("(0, inf)").accepts(0)
    assert not Range("[0, 1]").accepts(True) and not Range("[0, 1]").accepts("0.5")
    assert not Range("[0, 1]").accepts(float("nan"))
    for malformed in ("0 to 1", "[1, 0]", "[a, 1)", "(0, 1"):
        with pytest.raises(ValueError, match="a setting's range is an interval such as"):
            Range(malformed)
