"""Modules that moved: still importable, for one release, under their old names with a one-line warning.

Module paths are public API: a YAML names classes by them (``class_path: grpo_lightning.environments.tool_env.
ToolEnvironment``), a vLLM server is started with ``--worker-extension-cls`` naming one, a checkpoint pickles them.
When the integrations moved under ``grpo_lightning/integrations/`` (the core imports none of them), each old name
became an alias: importing it imports the new module, registers it under the old name too (one module object, so
``isinstance`` and pickles agree) and says once, on the ``grpo_lightning`` logger, where it lives now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from types import ModuleType

log = logging.getLogger("grpo_lightning")

REMOVED_IN = "0.2.0"  # the release that stops reading them (as ``renamed_keys.REMOVED_IN``)

_PACKAGE = "grpo_lightning"
# old module (under grpo_lightning) -> its place now; a package's submodules follow their package
MOVED: dict[str, str] = {
    "engines.vllm": "integrations.vllm.engine",
    "engines.vllm_server": "integrations.vllm.server",
    "engines.vllm_gloo": "integrations.vllm.gloo",
    "engines.vllm_nccl": "integrations.vllm.nccl",
    "engines.vllm_loading": "integrations.vllm.loading",
    "engines.vllm_plugin": "integrations.vllm.plugin",
    "engines.weight_transfer": "integrations.vllm.weight_transfer",
    "tasks.vision": "integrations.vision.tasks",
    "rollout.multiturn": "integrations.environments.multiturn",
    "rollout.turn_tokens": "integrations.environments.turn_tokens",
    "models.teacher": "integrations.distillation.teacher",
    "models.served_teacher": "integrations.distillation.served_teacher",
    "tasks.reasoning_gym": "integrations.reasoning_gym.tasks",
    "tasks.reasoning_gym_levels": "integrations.reasoning_gym.levels",
    "rewards.reasoning_gym": "integrations.reasoning_gym.rewards",
    "rewards.sandbox": "integrations.sandbox.sandbox",
    "rewards.code": "integrations.sandbox.code",
    "sft": "integrations.sft",
    "vision": "integrations.vision",
    "environments": "integrations.environments",
    "agents": "integrations.agents",
    "models.lean": "models.lean_forward",
}


def new_name(old: str) -> str | None:
    """Where module ``old`` (a full dotted name) lives now; None if it did not move."""
    if not old.startswith(_PACKAGE + "."):
        return None
    relative = old[len(_PACKAGE) + 1 :]
    for moved, now in MOVED.items():
        if relative == moved or relative.startswith(moved + "."):
            return f"{_PACKAGE}.{now}{relative[len(moved) :]}"
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__  # the import machinery sets the alias's spec on it: put the module's back
        log.warning("%s moved to %s; the old name works until grpo_lightning %s", spec.name, self.target, REMOVED_IN)
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the target ran when it was imported


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds an old module name and answers with its new module (installed once, by ``grpo_lightning``)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        now = new_name(fullname)
        if now is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(now))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
