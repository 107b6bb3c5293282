"""Multi-turn rollouts in token space: policy turns and environment observations, concatenated as token ids.

``generate_trajectories`` runs G trajectories per prompt against copies of ``data.environment``:

    1. the first turn is sampled from the prompts with the engine's group sampling (one prefill per prompt);
    2. each later turn is sampled from the trajectory's own token ids so far (prompt + earlier turns +
       observations), never from re-tokenized text: a token the policy drew stays that token (TRL #5224, verl
       #3960 are the drift this avoids);
    3. a turn ends at EOS, at a stop text of the environment (a tool call's close tag: ``SamplingParams.
       stop_sequences`` lets the engine stop there, and the turn is cut there in any case, which leaves the
       distribution of what was kept unchanged) or at its length limit;
    4. the environment answers the turn's text (``step``): ``done`` ends the trajectory (the turn was the final
       answer); otherwise its observation is tokenized on its own and appended, and the next turn follows.

The whole trajectory after the prompt is the "completion" of the rest of the pipeline: ``completion_mask`` = every
token (all are context for the log-prob passes), ``action_mask`` = the policy's tokens only, which becomes the
round's ``loss_mask``: environment tokens are in the context but out of the loss, the KL and every loss metric.
The engine's log-probs of environment tokens are 0 (never used: masked).

Limits: ``environment.max_turns`` policy turns, ``environment.max_turn_tokens`` per turn, and
``params.max_new_tokens`` for everything after the prompt. A trajectory cut by a length limit (a turn without EOS
or stop, or no room left for an observation and a next turn) is ``truncated``, as a single-turn completion cut
by ``max_new_tokens`` is. Each turn re-prefills its context in the engine; no engine continues from the previous
turn's cache yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.environments.base import Environment
from grpo_lightning.rollout.prompts import PromptEncoder


@dataclass
class Trajectories:
    """G trajectories per prompt (groups adjacent), as ``Completions`` plus what the turns add."""

    completions: Completions  # completion_* = the whole trajectory after the prompt
    action_mask: Tensor  # [N, T] 1 on the policy's tokens (0 on observations and padding)
    final_texts: list[str]  # the last policy turn's text: what the rewards score
    transcripts: list[str]  # every turn and observation, as text
    env_rewards: dict[str, list[float]] = field(default_factory=dict)  # per trajectory, summed over its turns
    stats: dict[str, list[float]] = field(default_factory=dict)  # turns, policy/env tokens, environment metrics
    environment_s: float = 0.0  # seconds spent in the environment (its steps and resets)


@dataclass
class _Trajectory:
    env: Environment
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    final_text: str = ""
    turns: int = 0
    active: bool = True
    truncated: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def append(self, ids: list[int], policy: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.action += [int(policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def setup_environment(environment: Environment, tokenizer: Any) -> None:
    """``environment.setup(tokenizer)`` unless it was set up with this tokenizer already."""
    if getattr(environment, "tokenizer", None) is not tokenizer:
        environment.setup(tokenizer)


def stop_sequences(environment: Environment, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The environment's stop texts as token ids (the engine's early stop; the text check stays the rule)."""
    return tuple(tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in environment.stop_texts)


def cut_at_stop_text(ids: list[int], stop_texts: tuple[str, ...], tokenizer: Any) -> int:
    """The shortest prefix of ``ids`` whose text holds a stop text (``len(ids)`` when none does)."""
    if not stop_texts or not any(t in tokenizer.decode(ids, skip_special_tokens=True) for t in stop_texts):
        return len(ids)
    for k in range(1, len(ids) + 1):  # the first token that completes a stop text
        if any(t in tokenizer.decode(ids[:k], skip_special_tokens=True) for t in stop_texts):
            return k
    return len(ids)


def _left_padded(rows: list[list[int]], pad_token_id: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def _right_padded(rows: list[list], value: float | int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    width = max([len(r) for r in rows] + [1])
    return torch.stack([F.pad(torch.tensor(r, dtype=dtype), (0, width - len(r)), value=value) for r in rows]).to(device)


def generate_trajectories(
    rows: dict[str, list[Any]],
    *,
    engine: RolloutEngine,
    encoder: PromptEncoder,
    environment: Environment,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    device: torch.device | str = "cpu",
) -> Trajectories:
    """``params.group_size`` trajectories (one when greedy) per prompt of ``rows``; see the module docstring."""
    tokenizer = encoder.tokenizer
    setup_environment(environment, tokenizer)
    group = 1 if params.greedy else params.group_size
    prompt_ids, prompt_mask = encoder.encode(rows["prompt"], device)
    total_limit = params.max_new_tokens
    turn_limit = min(environment.max_turn_tokens or total_limit, total_limit)
    stops = stop_sequences(environment, tokenizer)
    stop_texts = environment.stop_texts
    env_seconds = 0.0

    started = time.perf_counter()
    trajectories = []
    for b in range(prompt_ids.size(0)):
        prompt = prompt_ids[b][prompt_mask[b].bool()].tolist()
        row = {name: values[b] for name, values in rows.items()}
        for _ in range(group):
            trajectory = _Trajectory(env=environment.spawn(), prompt=prompt)
            first = trajectory.env.reset(row)
            if first:
                observed = tokenizer(first, add_special_tokens=False)["input_ids"][: environment.max_observation_tokens]
                trajectory.append(observed, policy=False)
                trajectory.segments.append(tokenizer.decode(observed))
                if len(observed) >= total_limit:  # no room for a turn
                    trajectory.active, trajectory.truncated = False, True
            trajectories.append(trajectory)
    env_seconds += time.perf_counter() - started

    for turn in range(environment.max_turns):
        active = [t for t in trajectories if t.active]
        if not active:
            break
        limits = [min(turn_limit, total_limit - len(t.ids)) for t in active]
        turn_params = params.with_(max_new_tokens=max(limits), stop_sequences=stops)
        if turn == 0 and not any(t.ids for t in trajectories):
            # All trajectories of a group share their context: the engine's group sampling, one prefill per prompt.
            out = engine.generate(
                prompt_ids, prompt_mask, turn_params, generator=generator, return_logprobs=return_logprobs
            )
        else:
            ids, mask = _left_padded([t.prompt + t.ids for t in active], tokenizer.pad_token_id, device)
            out = engine.generate(
                ids,
                mask,
                turn_params.with_(group_size=1, min_new_tokens=0),
                generator=generator,
                return_logprobs=return_logprobs,
            )
        lengths = out.completion_mask.sum(-1).tolist()
        generated = out.completion_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        for i, (trajectory, limit) in enumerate(zip(active, limits)):
            ids = generated[i][: min(lengths[i], limit)]
            ids = ids[: cut_at_stop_text(ids, stop_texts, tokenizer)]
            ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
            text = tokenizer.decode(ids, skip_special_tokens=True)
            stopped = not ended and any(s in text for s in stop_texts)  # cut right after it
            trajectory.append(ids, policy=True, logprobs=logprobs[i][: len(ids)] if logprobs else None)
            trajectory.segments.append(text)
            trajectory.final_text, trajectory.turns = text, trajectory.turns + 1

            start = time.perf_counter()
            step = trajectory.env.step(text)
            env_seconds += time.perf_counter() - start
            for name, value in step.rewards.items():
                trajectory.rewards[name] = trajectory.rewards.get(name, 0.0) + float(value)
            for name, value in step.metrics.items():
                trajectory.metrics[name] = trajectory.metrics.get(name, 0.0) + float(value)
            if not ended and not stopped:  # cut by a length limit: the policy did not finish its turn
                trajectory.active, trajectory.truncated = False, True
                continue
            if step.done or turn + 1 == environment.max_turns:  # the final answer, or out of turns
                trajectory.active = False
                continue
            observed = []
            if step.observation:
                observed = tokenizer(step.observation, add_special_tokens=False)["input_ids"]
                observed = observed[: environment.max_observation_tokens]
            if len(trajectory.ids) + len(observed) >= total_limit:  # no room for the answer and a next turn
                trajectory.active, trajectory.truncated = False, True
                continue
            trajectory.append(observed, policy=False)
            trajectory.segments.append(tokenizer.decode(observed))
    return _assemble(
        trajectories, prompt_ids, prompt_mask, group, tokenizer.pad_token_id, env_seconds, device, return_logprobs
    )


def _assemble(
    trajectories: list[_Trajectory],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group: int,
    pad_token_id: int,
    env_seconds: float,
    device: torch.device | str,
    with_logprobs: bool,
) -> Trajectories:
    ids = _right_padded([t.ids for t in trajectories], pad_token_id, torch.long, device)
    mask = _right_padded([[1] * len(t.ids) for t in trajectories], 0, torch.long, device)
    completions = Completions(
        prompt_ids=prompt_ids.repeat_interleave(group, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group, dim=0),
        completion_ids=ids,
        completion_mask=mask,
        truncated=torch.tensor([t.truncated for t in trajectories], device=ids.device),
        logprobs=_right_padded([t.logprobs for t in trajectories], 0.0, torch.float32, device)
        if with_logprobs
        else None,
    )
    names = sorted({name for t in trajectories for name in t.rewards})
    metric_names = sorted({name for t in trajectories for name in t.metrics})
    stats = {
        "turns": [float(t.turns) for t in trajectories],
        "policy_tokens": [float(sum(t.action)) for t in trajectories],
        "env_tokens": [float(len(t.action) - sum(t.action)) for t in trajectories],
        **{name: [t.metrics.get(name, 0.0) for t in trajectories] for name in metric_names},
    }
    return Trajectories(
        completions=completions,
        action_mask=_right_padded([t.action for t in trajectories], 0, torch.long, device),
        final_texts=[t.final_text for t in trajectories],
        transcripts=["".join(t.segments) for t in trajectories],
        env_rewards={name: [t.rewards.get(name, 0.0) for t in trajectories] for name in names},
        stats=stats,
        environment_s=env_seconds,
    )
