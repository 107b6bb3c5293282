"""Agents that run their own loop: an OpenAI-compatible gateway serving the policy during a round
(``gateway.py``, ``serving.py``), every call recorded in token space and merged into training rows (``calls.py``),
the agent run per trajectory (``environment.py``: ``AgentEnvironment``, a ``data.environment``) and the round's rows
scored (``rollout.py``). docs/environments.md, "Agents that run their own loop"."""

from grpo_lightning.integrations.agents.environment import AgentEnvironment

__all__ = ["AgentEnvironment"]
