"""Environments of multi-turn rollouts (``data.environment``): the interface and the tool-calling environment.

=====================  ==========================================================================================
``base.py``            ``Environment`` (``reset(row)``, ``step(turn) -> Step``, limits) and ``Step``
``tool_env.py``        ``ToolEnvironment``: runs the last tool call of each turn, answers with its result
``tools.py``           the tools: ``calculator``, ``python`` (the sandbox of the code reward), ``pkg.mod:fn``
``formats.py``         how calls and results are written: tags, or the tokenizer's chat template
=====================  ==========================================================================================

The rollout that drives them, in token space, is ``grpo_lightning/rollout/multiturn.py``.
"""

from __future__ import annotations

from grpo_lightning.environments.base import Environment, Step, check_environment
from grpo_lightning.environments.tool_env import ToolEnvironment
from grpo_lightning.environments.tools import ToolError, calculator, resolve_tool

__all__ = ["Environment", "Step", "ToolEnvironment", "ToolError", "calculator", "check_environment", "resolve_tool"]
