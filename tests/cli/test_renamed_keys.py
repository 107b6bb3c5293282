"""Config keys that moved (``grpo_lightning/renamed_keys.py``) still work, with one warning line per key.

Configs written before the rollout settings moved from ``model`` to ``data`` (``tests/data/old_layout``: the
quickstart and DAPO recipe as they were) parse to exactly the run today's files describe; so does each old
command-line flag. An old key and its new one set differently are refused in one line, in a file and as flags alike.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from grpo_lightning import renamed_keys
from grpo_lightning.cli import main
from grpo_lightning.renamed_keys import RENAMED, migrate

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "tests/data/old_layout"

# A value for every old key, none of them the default: where each lands is checked against its new key.
OLD_VALUES = {
    "model.sampling": {"group_size": 4, "max_new_tokens": 3},
    "model.rewards": [{"name": "exact_answer", "weight": 2.0}],
    "model.accuracy_reward": "exact_answer",
    "model.reward_on_error": "zero",
    "model.reward_timeout_s": 5.0,
    "model.use_chat_template": False,
    "model.seed": 7,
    "model.eval_num_samples": 4,
    "model.eval_temperature": 0.7,
    "model.eval_pass_k": [1, 4],
    "model.eval_answer_fn": "grpo_lightning.rewards.math.extract_answer",
    "model.objective.num_iterations": 2,
    "model.objective.old_logprobs": "recompute",
    "model.objective.mask_truncated_completions": True,
    "model.objective.advantage_baseline": "rloo",
    "model.objective.advantage_scale": "none",
    "model.objective.advantage_std": "sample",
    "model.objective.advantage_eps": 0.001,
    # data's settings grouped (issue 51): keys that moved twice agree with their first spelling's value above.
    "data.num_iterations": 2,
    "data.mini_batch_size": 8,
    "data.micro_batch_size": 4,
    "data.balance_micro_batches": False,
    "data.pack_tokens": None,
    "data.old_logprobs": "recompute",
    "data.mask_truncated_completions": True,
    "data.rollout_lag": 1,
    "data.off_policy_correction": "behaviour",
    "data.rollout_threads": 1,
    "data.rollout_timeout_s": 60.0,
    "data.dynamic_sampling": True,
    "data.max_sampling_rounds": 2,
    "data.val_batch_size": 16,
    "data.val_limit": 8,
}
# Keys that moved twice land at their last place in one step (not at the first move's, which is gone too).
MOVED_TWICE = {
    "model.objective.num_iterations": "data.update.num_iterations",
    "model.objective.old_logprobs": "data.update.old_logprobs",
    "model.objective.mask_truncated_completions": "data.update.mask_truncated_completions",
}


@pytest.fixture(autouse=True)
def fresh_warnings(caplog):
    renamed_keys._warned.clear()  # each key warns once per process
    caplog.set_level(logging.WARNING, logger="grpo_lightning.renamed_keys")


def printed(capsys, *args: str) -> dict:
    """The resolved config of ``fit`` with ``args`` (``--print_config``, in this process)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["fit", *args, "--print_config"])
    assert done.value.code in (None, 0)
    return yaml.safe_load(capsys.readouterr().out)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grpo_lightning.renamed_keys"]


def nested(path: str, value) -> dict:
    out: dict = {}
    node = out
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def lookup(config: dict, path: str):
    for key in path.split("."):
        config = config[key]
    return config


def test_the_old_quickstart_and_dapo_recipe_describe_todays_runs_with_a_line_per_moved_key(capsys, caplog, monkeypatch):
    monkeypatch.chdir(ROOT)
    old = printed(capsys, "--config", str(OLD / "quickstart.yaml"), "--config", str(OLD / "dapo.yaml"))
    lines = warnings_of(caplog)
    new = printed(capsys, "--config", "configs/quickstart.yaml", "--config", "configs/recipes/dapo.yaml")
    assert old == new
    moved = ["model.sampling", "model.rewards", "model.objective.advantage_baseline",
             "model.objective.advantage_scale", "model.objective.mask_truncated_completions",
             "data.mini_batch_size", "data.val_limit", "data.dynamic_sampling", "data.max_sampling_rounds"]  # fmt: skip
    assert sorted(lines) == sorted(
        f"deprecated: {key} is now {RENAMED[key]}; the old key is read until grpo_lightning "
        f"{renamed_keys.REMOVED_IN}, rename it"
        for key in moved
    )
    assert len(warnings_of(caplog)) == len(lines)  # today's files warn of nothing


def test_every_old_key_lands_on_its_new_key_in_a_file(capsys, caplog, tmp_path, monkeypatch):
    assert set(OLD_VALUES) == set(RENAMED)  # a key added to the table gets a value here
    monkeypatch.chdir(ROOT)
    old_file, new_file = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old_doc, new_doc = {}, {}
    for old, value in OLD_VALUES.items():
        old_doc = merge(old_doc, nested(old, value))
        new_doc = merge(new_doc, nested(RENAMED[old], value))
    old_file.write_text(yaml.safe_dump(old_doc))
    new_file.write_text(yaml.safe_dump(new_doc))
    base = ("--config", "configs/quickstart.yaml")
    old = printed(capsys, *base, "--config", str(old_file))
    assert len(warnings_of(caplog)) == len(RENAMED)
    new = printed(capsys, *base, "--config", str(new_file))
    assert old == new
    for old_key, new_key in RENAMED.items():
        assert written(OLD_VALUES[old_key], lookup(new, new_key)), new_key
        with pytest.raises(KeyError):
            lookup(new, old_key)  # not a key of today's layout: the table names only keys that moved


def written(value, printed_value) -> bool:
    """Whether ``--print_config`` wrote ``value`` back (a partial mapping comes back filled with defaults)."""
    if isinstance(value, dict):
        return {k: printed_value[k] for k in value} == value
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return all(written(v, w) for v, w in zip(value, printed_value, strict=True))
    return printed_value == value


def test_old_command_line_flags_are_read_as_the_new_ones(capsys, caplog, monkeypatch):
    monkeypatch.chdir(ROOT)
    got = printed(
        capsys,
        "--config", "configs/quickstart.yaml",
        "--model.sampling.group_size", "4",
        "--model.objective.advantage_scale=none",
        "--model.seed", "7",
    )  # fmt: skip
    assert got["data"]["sampling"]["group_size"] == 4
    assert got["data"]["advantage"]["scale"] == "none"
    assert got["data"]["seed"] == 7
    assert len(warnings_of(caplog)) == 3


def test_an_old_key_and_its_new_one_set_differently_are_refused_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump({"model": {"seed": 3}, "data": {"seed": 4}}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "configs/quickstart.yaml", "--config", str(both), "--print_config"])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model.seed (deprecated, now data.seed) and data.seed are both set, differently: keep only data.seed"
    )


def refused(capsys, *args: str) -> str:
    """The one error line of ``fit`` with ``args`` (exit status 2, no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "configs/quickstart.yaml", *args, "--print_config"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


GROUP_SIZE_BOTH = (
    "error: model.sampling.group_size (deprecated, now data.sampling.group_size) and data.sampling.group_size are "
    "both set, differently: keep only data.sampling.group_size"
)


@pytest.mark.parametrize(
    "flags",
    [
        ["--model.sampling.group_size", "4", "--data.sampling.group_size", "8"],
        ["--data.sampling.group_size=8", "--model.sampling.group_size=4"],  # either order: the later would win
    ],
    ids=["old-first", "new-first"],
)
def test_an_old_flag_and_its_new_one_set_differently_are_refused_as_in_a_file(capsys, monkeypatch, flags):
    monkeypatch.chdir(ROOT)
    assert refused(capsys, *flags) == GROUP_SIZE_BOTH


def test_a_flag_setting_a_whole_mapping_is_compared_key_by_key(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert refused(capsys, "--model.sampling", "{group_size: 4}", "--data.sampling.group_size", "8") == (
        "error: model.sampling (deprecated, now data.sampling) and data.sampling.group_size are both set, "
        "differently: keep only data.sampling.group_size"
    )
    assert refused(capsys, "--data.advantage", "{scale: batch}", "--model.objective.advantage_scale", "none") == (
        "error: model.objective.advantage_scale (deprecated, now data.advantage.scale) and data.advantage are both "
        "set, differently: keep only data.advantage"
    )
    got = printed(capsys, "--config", "configs/quickstart.yaml", "--model.sampling", "{group_size: 4}",
                  "--data.sampling.max_new_tokens", "3")  # fmt: skip
    assert (got["data"]["sampling"]["group_size"], got["data"]["sampling"]["max_new_tokens"]) == (4, 3)


def test_old_and_new_flags_that_agree_or_a_flag_over_a_file_are_read(capsys, caplog, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    got = printed(capsys, "--config", "configs/quickstart.yaml", "--model.seed", "7", "--data.seed", "7",
                  "--model.objective.advantage_eps=0.001", "--data.advantage.eps", "1.0e-3")  # fmt: skip
    assert (got["data"]["seed"], got["data"]["advantage"]["eps"]) == (7, 0.001)
    assert len(warnings_of(caplog)) == 2
    new_file = tmp_path / "new.yaml"
    new_file.write_text(yaml.safe_dump({"data": {"seed": 4}}))
    got = printed(capsys, "--config", "configs/quickstart.yaml", "--config", str(new_file), "--model.seed", "3")
    assert got["data"]["seed"] == 3  # a flag overrides a file, old key or new


def test_migrate_reads_class_path_forms_and_a_config_for_the_whole_command_line():
    document = {
        "fit": {
            "model": {"class_path": "grpo_lightning.GRPOModule", "init_args": {"sampling": {"group_size": 4}}},
            "data": {"class_path": "grpo_lightning.RolloutDataModule"},
        }
    }
    assert migrate(document) == {
        "fit": {
            "model": {"class_path": "grpo_lightning.GRPOModule", "init_args": {}},
            "data": {"class_path": "grpo_lightning.RolloutDataModule", "init_args": {"sampling": {"group_size": 4}}},
        }
    }
    untouched = {"model": {"objective": {"beta": 0.0}}, "data": {"seed": 1}}
    assert migrate(yaml.safe_load(yaml.safe_dump(untouched))) == untouched
    assert migrate([1, 2]) == [1, 2] and migrate("text") == "text"
    value = {"base_url": "http://x", "model": {"seed": 3}}  # a setting's value, not a config: never rewritten
    assert migrate(yaml.safe_load(yaml.safe_dump(value))) == value


def test_an_old_key_that_cannot_be_moved_is_refused_rather_than_dropped():
    with pytest.raises(renamed_keys.ConfigError, match=r"^model.seed is deprecated .* set data.seed instead$"):
        migrate({"model": {"seed": 3}, "data": "data.yaml"})


def test_a_key_that_moved_twice_lands_at_its_last_place_in_one_step():
    for old, new in MOVED_TWICE.items():
        assert RENAMED[old] == new and new not in RENAMED  # no chain to follow
    document = migrate({"model": {"objective": {"num_iterations": 3}}, "data": {"rollout_lag": 1}})
    assert document == {
        "model": {"objective": {}},
        "data": {"update": {"num_iterations": 3}, "schedule": {"rollout_lag": 1}},
    }
    # A document with only data's old keys is moved too (nothing under model).
    assert migrate({"data": {"val_limit": 8, "eval": {"num_samples": 2}}}) == {
        "data": {"eval": {"num_samples": 2, "limit": 8}}
    }


@pytest.mark.parametrize(
    "old,value,new,other",
    [
        ("data.mini_batch_size", "8", "data.update.mini_batch_size", "16"),
        ("data.rollout_lag", "1", "data.schedule.rollout_lag", "2"),
        ("data.dynamic_sampling", "true", "data.sampling.dynamic_sampling", "false"),
        ("data.val_limit", "8", "data.eval.limit", "4"),
    ],
)
def test_a_grouped_key_set_at_both_places_differently_is_refused_in_one_line(
    capsys, monkeypatch, old, value, new, other
):
    monkeypatch.chdir(ROOT)
    assert refused(capsys, f"--{old}", value, f"--{new}", other) == (
        f"error: {old} (deprecated, now {new}) and {new} are both set, differently: keep only {new}"
    )


def test_a_grouped_key_in_a_file_warns_once_and_lands_in_its_group(capsys, caplog, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"data": {"mini_batch_size": 16, "rollout_lag": 1, "val_batch_size": 4}}))
    got = printed(capsys, "--config", "configs/quickstart.yaml", "--config", str(old))
    data = got["data"]
    assert (data["update"]["mini_batch_size"], data["schedule"]["rollout_lag"], data["eval"]["batch_size"]) == (
        16,
        1,
        4,
    )
    assert data["eval"]["limit"] == 500  # the quickstart's data.eval.limit, kept beside the moved key
    assert sorted(warnings_of(caplog)) == sorted(
        f"deprecated: {key} is now {RENAMED[key]}; the old key is read until grpo_lightning {renamed_keys.REMOVED_IN}, "
        "rename it"
        for key in ("data.mini_batch_size", "data.rollout_lag", "data.val_batch_size")
    )
