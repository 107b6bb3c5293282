"""Environments of multi-turn rollouts (``data.environment``): the interface and the tool-calling environment.

=====================  ==========================================================================================
``base.py``            ``Environment`` (``reset(row)``, ``step(turn) -> Step``, limits, ``fit_observation``) and
                       ``Step``
``tool_env.py``        ``ToolEnvironment``: runs the last tool call of each turn, answers with its result
``tools.py``           the tools: ``calculator``, ``python`` (the sandbox of the code reward), ``pkg.mod:fn``
``formats.py``         how calls and results are written: ``ToolCall``, ``TagFormat`` (tags)
``chat_formats.py``    the chat template's own calls (Hermes/Qwen, Llama-3 JSON), found by rendering one;
                       ``tool_format`` picks the format of the ``format`` setting
``stops.py``           stop texts in token space: the turn's cut (linear scan) and the engine's stop sequences
``trl_classes.py``     ``TRLEnvironment``: TRL's ``environment_factory`` classes (public methods as tools, reset,
                       get_reward; a dict of them chosen per row) in the chat template's own format
=====================  ==========================================================================================

The rollout that drives them, in token space, is ``grpo_lightning/rollout/multiturn.py``.
"""

from __future__ import annotations

from grpo_lightning.environments.base import Environment, Step, check_environment, cut_marker
from grpo_lightning.environments.tool_env import ToolEnvironment
from grpo_lightning.environments.tools import ToolBroken, ToolError, calculator, resolve_tool
from grpo_lightning.environments.trl_classes import TRLEnvironment

__all__ = [
    "Environment",
    "Step",
    "TRLEnvironment",
    "ToolBroken",
    "ToolEnvironment",
    "ToolError",
    "calculator",
    "check_environment",
    "cut_marker",
    "resolve_tool",
]
