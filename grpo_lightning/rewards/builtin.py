"""Imports every module that registers built-in reward functions (see ``grpo_lightning.rewards.get``)."""

from grpo_lightning.rewards import code, exact, format, math, model  # noqa: F401
from grpo_lightning.tasks import countdown  # noqa: F401  (registers the ``countdown`` reward)
