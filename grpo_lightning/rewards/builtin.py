"""Imports every module that registers built-in reward functions (see ``grpo_lightning.rewards.get``)."""

from grpo_lightning.rewards import code, countdown, exact, format, math, model, reasoning_gym  # noqa: F401
