"""What docs/environments.md tells a user to write for skyrl-gym works with the installed skyrl-gym (0.4): each
``env_config`` key its example shows (``{text2sql: {db_path: ...}}``) is a field of that environment's config class.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def config_fields(env_id: str) -> set[str]:
    """The fields of the dataclass that the skyrl-gym environment ``env_id`` reads its ``env_config`` as."""
    from skyrl_gym.envs.registration import registry

    module, _, name = registry[env_id].entry_point.partition(":")
    environment = getattr(importlib.import_module(module), name)
    hint = typing.get_type_hints(environment.__init__)["env_config"]
    classes = [c for c in (*typing.get_args(hint), hint) if dataclasses.is_dataclass(c)]
    return {field.name for c in classes for field in dataclasses.fields(c)}


def test_the_env_config_keys_the_docs_show_are_the_environments_own():
    pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed: pip install -e .[skyrl-gym]")
    text = (ROOT / "docs" / "environments.md").read_text()
    shown = re.findall(r"env_config: \{\}\s+# by id: \{(\w+): \{(\w+): \.\.\.\}\}", text)
    assert shown, "docs/environments.md shows no env_config example"
    for env_id, key in shown:
        assert key in config_fields(env_id), f"skyrl-gym's {env_id} has no env_config key {key!r}"
