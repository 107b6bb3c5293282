"""Token rows of a multi-turn rollout (``integrations/environments/multiturn.py``): observations tokenized a turn at a
time, and trajectories' token lists as padded tensors.

Why a module of their own: the rollout calls them once per trajectory per turn, so they are written to make one
call into the tokenizer or into torch per turn rather than one per trajectory (each such call costs a few to tens of
microseconds of Python, which a round of 256 trajectories multiplies); the results are those of the per-row calls.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
from torch import Tensor


class TurnEnvironment(Protocol):
    """What a multi-turn rollout asks of an environment: ``integrations/environments/base.Environment`` declares each
    (its docstrings say what they do); the rollout's modules read no other attribute."""

    tokenizer: Any
    max_turns: int
    max_turn_tokens: int | None
    max_observation_tokens: int
    max_concurrency: int
    replays_exactly: bool
    steps_in_threads: bool

    @property
    def stop_texts(self) -> tuple[str, ...]: ...
    def setup(self, tokenizer: Any) -> None: ...
    def spawn(self) -> TurnEnvironment: ...
    def reset(self, row: dict[str, Any]) -> str | None: ...
    def step(self, turn: str) -> Any: ...  # a ``Step``
    def trajectory_prompt(self, prompt: Any) -> Any: ...
    def prompt_tools(self, row: dict[str, Any]) -> list[dict[str, Any]] | None: ...
    def final_rewards(self) -> dict[str, float]: ...
    def reward_view(self) -> Any: ...
    def reward_weights(self) -> dict[str, float]: ...


_WARNED_OVERSIZE: set[str] = set()  # environment classes already warned about an oversize observation


def observation_ids(environment: TurnEnvironment, text: str, tokenizer: Any) -> list[int]:
    """``text`` tokenized on its own, at most ``max_observation_tokens`` tokens.

    An environment keeps its observations within the limit itself (``Environment.fit_observation`` cuts the text
    and keeps the frame); cutting the tokens here also cuts the frame (a closing tag, the next turn's header), so
    it is a last resort, with a warning once per environment class."""
    return observations_ids(environment, [text], tokenizer)[0]


def observations_ids(environment: TurnEnvironment, texts: list[str], tokenizer: Any) -> list[list[int]]:
    """``observation_ids`` of each of ``texts``, with one call of the tokenizer for all of them (a batch of texts
    is tokenized each on its own: no padding, the same ids as one call per text)."""
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    limit = environment.max_observation_tokens
    for i, ids in enumerate(encoded):
        if len(ids) > limit:
            _warn_oversize(environment, len(ids), limit)
            encoded[i] = ids[:limit]
    return [list(ids) for ids in encoded]


def _warn_oversize(environment: TurnEnvironment, length: int, limit: int) -> None:
    kind, name = type(environment), type(environment).__qualname__
    if f"{kind.__module__}.{name}" in _WARNED_OVERSIZE:
        return
    _WARNED_OVERSIZE.add(f"{kind.__module__}.{name}")
    warnings.warn(
        f"{name} returned an observation of {length} tokens (max_observation_tokens = {limit}): its tokens "
        "are cut, its closing text with them; return Environment.fit_observation(text, render) instead",
        RuntimeWarning,
        stacklevel=3,
    )


def left_padded(rows: list[list[int]], pad_token_id: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """``rows`` left-padded with ``pad_token_id`` into ``[len(rows), longest]`` ids and their attention mask."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids.view(len(rows), width).to(device), mask.view(len(rows), width).to(device)


def right_padded(rows: list[list], value: float | int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``rows`` right-padded with ``value`` into ``[len(rows), max(longest, 1)]`` of ``dtype``."""
    width = max([len(r) for r in rows] + [1])
    padded = torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)
    return padded.view(len(rows), width).to(device)
