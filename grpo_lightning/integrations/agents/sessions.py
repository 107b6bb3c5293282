"""``SessionOutcome``: one trajectory's agent run (its gateway session, what the agent returned, how it ended).

The agent environment fills it as its agents run (``integrations/agents/environment.py``); the round's rows are made and
scored from it (``integrations/agents/rollout.py``). A module of its own so that both read it without importing each
other.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass, field
from typing import Any

from grpo_lightning.integrations.agents.gateway import Session


@dataclass
class SessionOutcome:
    """One trajectory's agent run: its session, what the agent returned, and how it ended."""

    row: dict[str, Any]
    session: Session | None = None
    result: Any = None
    rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    timed_out: bool = False
    finished: bool = False
    deadline: float = math.inf
    process: subprocess.Popen | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.timed_out
