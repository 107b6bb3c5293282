"""What an agent's session recorded, and how its calls become training rows (the extension rule).

Every call the gateway serves is recorded as a ``Call``: the prompt's token ids as the model was given them, the
completion's token ids as the engine drew them, and their sampling log-probs. ``merge_calls`` turns a session's
calls, in the order they were served, into ``AgentRow``s:

- a call whose prompt ids **start with** a row's whole token sequence so far (that row's last prompt + its last
  completion) extends that row: the prompt's new tokens (the tool result, the user's next message, the chat
  template's frame around them) are appended out of the loss, the completion's tokens in the loss;
- any other call (a template that rewrites history, a summarised context, a fresh conversation) starts a row of its
  own.

The rows are checked latest first, so the usual loop (each call extends the previous one) is one row, and an agent
that interleaves two conversations (a sub-agent) makes one row per conversation. The check is on token ids, so a
row is token for token what the model was given and drew: a re-rendered history that tokenizes differently from
what the model drew fails the check and starts a row instead of training on tokens the model never produced.

The rewards score a session's last call's text: ``scored_row`` is the row that holds it (the last row, or an earlier
one that the last call continued), the session's representative where one row stands for it (held-out metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """One served request: its token ids and the engine's log-probs of the drawn tokens."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the sampling distribution's (the engine's ``Completions.logprobs``)
    policy_logprobs: list[float] | None  # the tempered policy's, unfiltered (lean, transformers); None from vLLM
    text: str  # the completion's text as returned to the agent
    finish_reason: str  # "stop" (an end token or a stop text) or "length"
    request: dict[str, Any] = field(default_factory=dict)  # the request's body, for reward functions


@dataclass
class AgentRow:
    """One training row: a prompt, then turns of the model (in the loss) and of everything else (out of it)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)  # 1 on the model's tokens
    logprobs: list[float] = field(default_factory=list)  # 0 on the other tokens (never read: out of the loss)
    policy_logprobs: list[float] | None = field(default_factory=list)
    calls: int = 0
    truncated: bool = False  # its last call was cut by its token limit
    text: str = ""  # its last call's text
    last_call: int = -1  # the position of its last call among the session's calls (-1: none)

    @property
    def ids(self) -> list[int]:
        """The row's whole token sequence so far."""
        return self.prompt_ids + self.completion_ids

    def extended_by(self, call: Call) -> bool:
        """Whether ``call``'s prompt starts with this row's whole sequence (the extension property)."""
        ids = self.ids
        return len(call.prompt_ids) >= len(ids) and call.prompt_ids[: len(ids)] == ids

    def add(self, observation: list[int], call: Call) -> None:
        """Append ``observation`` (out of the loss) and ``call``'s completion (in the loss)."""
        self.completion_ids += observation + call.completion_ids
        self.action += [0] * len(observation) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(observation) + list(call.logprobs)
        if self.policy_logprobs is not None and call.policy_logprobs is not None:
            self.policy_logprobs += [0.0] * len(observation) + list(call.policy_logprobs)
        else:
            self.policy_logprobs = None  # a call without them (vLLM): none for the row
        self.calls += 1
        self.truncated, self.text = call.finish_reason == "length", call.text


def merge_calls(calls: list[Call]) -> list[AgentRow]:
    """A session's calls (in the order served) as training rows: see the module docstring."""
    rows: list[AgentRow] = []
    for position, call in enumerate(calls):
        row = next((r for r in reversed(rows) if r.extended_by(call)), None)
        if row is None:
            row = AgentRow(prompt_ids=list(call.prompt_ids))
            rows.append(row)
        row.add(call.prompt_ids[len(row.ids) :], call)
        row.last_call = position
    return rows


def scored_row(rows: list[AgentRow]) -> int:
    """The index of the row holding the session's last call, whose text the rewards score (0 without calls)."""
    return max(range(len(rows)), key=lambda i: rows[i].last_call)
