"""Imports every core module that registers built-in reward functions (see ``grpo_lightning.rewards.get``); the
integrations' are registered by path (``rewards.REWARD_PLUGINS``)."""

from grpo_lightning.rewards import countdown, exact, format, math, model  # noqa: F401
