"""Modules that moved under ``grpo_lightning/integrations/`` still import by their old names, for a release
(``grpo_lightning/moved_modules.py``): the same module object, one warning line naming the new place, and a YAML
that names a class by its old path runs as before."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import yaml

from grpo_lightning import moved_modules
from grpo_lightning.cli import main
from grpo_lightning.moved_modules import MOVED, new_name


def importable(name: str) -> bool:
    """False where the module needs an optional package this environment lacks (vLLM, reasoning-gym)."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and not err.name.startswith("grpo_lightning"):
            return False
        raise
    return True


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_name_is_the_new_module(old, caplog):
    now = new_name(f"grpo_lightning.{old}")
    assert now == f"grpo_lightning.{MOVED[old]}"
    if not importable(now):
        pytest.skip(f"{now} needs an optional package")
    sys.modules.pop(f"grpo_lightning.{old}", None)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning"):
        module = importlib.import_module(f"grpo_lightning.{old}")
    assert module is importlib.import_module(now)
    assert module.__spec__.name == now  # the module's own spec, not the alias's
    lines = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert lines == [f"grpo_lightning.{old} moved to {now}; the old name works until grpo_lightning 0.2.0"]


def test_a_submodule_of_a_moved_package_follows_it():
    assert new_name("grpo_lightning.vision.inputs") == "grpo_lightning.integrations.vision.inputs"
    assert new_name("grpo_lightning.rollout.round") is None and new_name("os.path") is None
    from grpo_lightning.environments.tool_env import ToolEnvironment

    from grpo_lightning.integrations.environments.tool_env import ToolEnvironment as Now

    assert ToolEnvironment is Now


def test_the_finder_is_installed_once():
    moved_modules.install()
    moved_modules.install()
    assert sum(isinstance(f, moved_modules.MovedModules) for f in sys.meta_path) == 1


def test_a_yaml_naming_a_class_by_its_old_path_runs_as_before(capsys):
    environment = {"class_path": "grpo_lightning.environments.ToolEnvironment", "init_args": {"tools": ["calculator"]}}
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "configs/quickstart.yaml", f"--data.environment={yaml.safe_dump(environment)}",
              "--print_config"])  # fmt: skip
    assert done.value.code in (None, 0)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["environment"]["init_args"]["tools"] == ["calculator"]
