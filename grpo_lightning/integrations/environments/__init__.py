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
``openenv.py``         ``OpenEnvEnvironment``: an OpenEnv server (at a URL, or started by the run), a session per
                       trajectory; bounded retries, then one line
``openenv_sessions.py`` its sessions: one event loop thread, bounded retries (replayed on a new session), one line
``skyrl_gym.py``       ``SkyRLGymEnvironment``: a skyrl-gym environment by id (or the row's ``env_class``)
``message_frames.py``  chat messages as an observation frame (the template's text up to the next assistant header)
``local_server.py``    a server process the run starts and stops (no orphan: atexit, ``PR_SET_PDEATHSIG``)
=====================  ==========================================================================================

The rollout that drives them, in token space, is ``grpo_lightning/integrations/environments/multiturn.py``.
"""

from __future__ import annotations

from grpo_lightning.integrations.environments.base import Environment, Step, check_environment, cut_marker
from grpo_lightning.integrations.environments.openenv import OpenEnvEnvironment
from grpo_lightning.integrations.environments.skyrl_gym import SkyRLGymEnvironment
from grpo_lightning.integrations.environments.tool_env import ToolEnvironment
from grpo_lightning.integrations.environments.tools import ToolBroken, ToolError, calculator, resolve_tool
from grpo_lightning.integrations.environments.trl_classes import TRLEnvironment

__all__ = [
    "Environment",
    "OpenEnvEnvironment",
    "SkyRLGymEnvironment",
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
