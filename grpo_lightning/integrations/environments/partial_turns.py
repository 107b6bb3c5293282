"""Partial rollouts of multi-turn environments (``data.schedule.partial_rollouts`` with ``data.environment``): a
trajectory that spans weight pushes, one segment per push (``rollout/partial.py``).

A segment runs the rollout's own turn loop (``turn_loop.run_turns``) over every unfinished trajectory of the pool,
with a budget of ``tokens_per_push`` *model* tokens per trajectory (observations do not count):

- a turn that reaches the budget is cut there, mid-turn, as a single-turn sequence is; the next segment continues
  it under the new weights, from the trajectory's token ids so far (the engine prefills them again: no cache is kept
  across a push; within a segment the turns reuse the engine's KV cache, as a round's do);
- a turn that ends inside a segment is stepped in the background (``steps_in_background``: the budget is below
  ``max_new_tokens``, the environment's steps may run in a thread): the step is launched in the segment's thread
  pool (at most the environment's ``max_concurrency`` at once) and the trajectory parked; the segment goes on with
  the others and ends without waiting for it. The next segment waits for every step still running before anything
  else (``settle``: its top-up's tokenizer calls never overlap a step's), then applies them in trajectory order
  (``collect_steps``: the observation appended, or the trajectory ended by ``done``, its turns or its length) before
  it decodes. A parked trajectory is not ended (its step may end it, with rewards), so its group is not scored yet.
  Which step is launched and in which segment its observation joins depend on the budget alone, never on the clock:
  only how long the next segment waits does. A trajectory therefore spans at most ⌈max_new_tokens /
  tokens_per_push⌉ + ``max_turns`` pushes (``pushes_spanned``: each turn starts a segment, the last step is collected
  by one more). With a budget that covers ``max_new_tokens`` the steps stay inside the segment, as a round's: a
  segment is then a round; so do those of an environment timed by SIGALRM (main thread only:
  ``Environment.steps_in_threads`` False and ``max_concurrency`` 1, TRL's classes), as before;
- every model token records the weights version that drew it, its μ and the policy's log-prob; observation tokens
  have no version (-1) and stay out of the loss (``action_mask``), as in a round's rollout;
- a group is scored, through the round's one scoring (``multiturn.score_trajectories``), when its G trajectories
  have all ended.

Where the environments live. Each trajectory's copy of the environment (``Environment.spawn``) is kept in the
background process between segments (``held``, by group and sample), never sent or checkpointed: a checkpoint holds
each trajectory's plain record (``Sample.state``: its turns' texts, the observations they got, its rewards, the
text of a turn whose step was still running, ...). A resumed run *replays* a trajectory into a fresh copy: ``reset``
on its row, then ``step`` on each of its turns' texts in order, and on the pending turn's text last (its step, whose
observation the next segment collects as the uninterrupted run collects the running one); each replayed observation
is checked against the recorded one, and a difference is refused in one line (the environment is not
deterministic: the resumed run would differ silently). That is exact for a deterministic environment; one that
cannot be replayed (a server whose sessions do not restart alike) declares ``Environment.replays_exactly = False``
and a resume with its trajectories in flight is refused in one line.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lightning.config import ConfigError, pushes_per_sequence
from grpo_lightning.engines.base import RolloutEngine, SamplingParams
from grpo_lightning.integrations.environments.multiturn import (
    add_final_rewards,
    assemble,
    score_trajectories,
    start_trajectory,
)
from grpo_lightning.integrations.environments.turn_loop import (
    Trajectory,
    collect_steps,
    open_session,
    run_turns,
    turn_loop,
)
from grpo_lightning.integrations.environments.turn_tokens import TurnEnvironment, left_padded
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.partial import Group, Sample
from grpo_lightning.rollout.prompts import PromptEncoder


@dataclass
class Live:
    """What the background process keeps of a trajectory between segments (``held``, by group number and sample):
    its environment copy, and the step of its ended turn while that runs (None: none)."""

    env: TurnEnvironment
    step: Future | None = None


def steps_in_background(environment: TurnEnvironment, budget: int, max_new_tokens: int) -> bool:
    """Whether a segment of ``budget`` model tokens steps the ended turns of ``environment`` in the background: a
    budget below ``max_new_tokens`` (with one that covers it a segment is a round, and steps inside it as a round
    does), and an environment whose steps may run in a thread (``Environment.steps_in_threads``, or a
    ``max_concurrency`` above 1: an environment timed by SIGALRM steps in the main thread, inside the segment)."""
    threads = environment.steps_in_threads or environment.max_concurrency > 1
    return threads and budget < max_new_tokens


def pushes_spanned(environment: TurnEnvironment, max_new_tokens: int, budget: int) -> int:
    """The most weight pushes one trajectory spans (what ``max_staleness`` must cover): a turn of n model tokens
    spans ⌈n / budget⌉ segments, each turn starts a segment when its steps run in the background, and one more
    collects the last step, so ⌈max_new_tokens / budget⌉ + ``max_turns``; ⌈max_new_tokens / budget⌉ otherwise."""
    pushes = pushes_per_sequence(max_new_tokens, budget)
    return pushes + environment.max_turns if steps_in_background(environment, budget, max_new_tokens) else pushes


def settle(held: dict[Any, Any]) -> float:
    """Wait for every step the last segment left running (``Live.step``); the seconds waited. Run first in a
    segment: a fast tokenizer refuses to change its padding (the top-up's prompts) while a step's thread encodes."""
    running = [live.step for live in held.values() if live.step is not None]
    start = time.perf_counter()
    wait(running)
    return time.perf_counter() - start if running else 0.0


def decode_segment(
    environment: TurnEnvironment,
    groups: list[Group],
    *,
    engine: RolloutEngine,
    encoder: PromptEncoder,
    params: SamplingParams,
    budget: int,
    version: int,
    generator: torch.Generator | None,
    return_logprobs: bool,
    device: torch.device | str,
    held: dict[Any, Any],
) -> float:
    """``Environment.decode_segment`` (the module docstring): every unfinished trajectory of ``groups`` at most
    ``budget`` model tokens further under ``version``. Returns the seconds spent in the environments."""
    tokenizer = encoder.tokenizer
    for key in [key for key in held if key[0] not in {g.number for g in groups}]:
        del held[key]  # groups that ended (scored) or left as stale: their environments with them
    started = time.perf_counter()
    entries: list[tuple[tuple[int, int], Sample, Trajectory]] = []
    for group in groups:
        for index, sample in enumerate(group.samples):
            if sample.ended:
                continue
            if not sample.state:  # fresh: its environment reset now, as a round resets it
                trajectory = Trajectory(environment.spawn(), group.prompt, group.row["prompt"])
                start_trajectory(trajectory, group.row, environment, encoder, params.max_new_tokens)
                held[group.number, index] = Live(trajectory.env)
            else:
                trajectory = _restored(environment, group, index, sample, encoder, params, held)
            entries.append(((group.number, index), sample, trajectory))
    env_seconds = time.perf_counter() - started
    trajectories = [t for *_, t in entries]
    group_size = len(groups[0].samples) if groups else 1
    fresh = all(not s.tokens and not s.segments for _, s, _ in entries) and len(entries) == group_size * len(groups)
    grouped = fresh and all(t.prompt == trajectories[i - i % group_size].prompt for i, t in enumerate(trajectories))
    group_prompts = None
    if grouped and trajectories:  # a round's first turn: G per prompt, one prefill each
        prompts = [t.prompt for t in trajectories[::group_size]]
        group_prompts = (*left_padded(prompts, tokenizer.pad_token_id, device), None)
    background = steps_in_background(environment, budget, params.max_new_tokens)
    workers = environment.max_concurrency
    steps = ThreadPoolExecutor(workers, thread_name_prefix="environment-step") if background else None
    session = open_session(engine, encoder)
    try:
        loop = turn_loop(
            engine, environment, tokenizer, params, generator=generator, return_logprobs=return_logprobs,
            device=device, session=session, version=version, steps=steps,
        )  # fmt: skip
        start = time.perf_counter()
        collect_steps(loop, trajectories)  # the last segment's steps (done: ``settle``), in trajectory order
        env_seconds += time.perf_counter() - start
        with_policy_logprobs, stepped = run_turns(trajectories, loop, group_prompts=group_prompts, budget=budget)
    finally:
        if session is not None:
            session.close()
        if steps is not None:
            steps.shutdown(wait=False)  # its launched steps run on; the next segment collects them
    env_seconds += stepped
    start = time.perf_counter()
    for key, sample, trajectory in entries:
        held[key].step = trajectory.step
        if not trajectory.active:
            add_final_rewards(trajectory)  # once, when it ends (TRL's get_reward)
        _record(sample, trajectory, (return_logprobs, with_policy_logprobs))
    return env_seconds + time.perf_counter() - start


def score_segment(
    environment: TurnEnvironment,
    groups: list[Group],
    *,
    encoder: PromptEncoder,
    scorer: Scorer,
    params: SamplingParams,
    device: torch.device | str,
    held: dict[Any, Any],
    timings: dict[str, float],
) -> RolloutBatch:
    """``Environment.score_segment``: the ended ``groups``' trajectories, scored as a round's are."""
    trajectories = [
        _restored(environment, group, index, sample, encoder, params, held)
        for group in groups
        for index, sample in enumerate(group.samples)
    ]
    pad = encoder.tokenizer.pad_token_id
    prompt_ids, prompt_mask = left_padded([t.prompt for t in trajectories], pad, device)
    states = [s.state for g in groups for s in g.samples]
    logprob_kinds = (states[0]["engine_logprobs"], all(state["policy_logprobs"] for state in states))
    seconds = timings.get("environment", 0.0)
    assembled = assemble(trajectories, prompt_ids, prompt_mask, pad, seconds, device, logprob_kinds)
    rows = {k: [g.row[k] for g in groups] for k in groups[0].row}
    return score_trajectories(
        environment, rows, assembled, encoder=encoder, scorer=scorer, params=params, timings=timings
    )


def _record(sample: Sample, trajectory: Trajectory, logprob_kinds: tuple[bool, bool]) -> None:
    """The trajectory as ``sample``'s plain data (what a checkpoint holds; ``_restored`` reads it back), and whether
    its engine calls gave the sampler's log-probs and (every one so far) the policy's."""
    sample.tokens, sample.versions = list(trajectory.ids), list(trajectory.versions)
    sample.logprobs, sample.policy_logprobs = list(trajectory.logprobs), list(trajectory.policy_logprobs)
    sample.segments += 1
    sample.ended, sample.truncated = not trajectory.active, trajectory.truncated
    sample.stepping = trajectory.pending is not None
    sample.state = {
        "prompt": list(trajectory.prompt),
        "source": trajectory.source,
        "action": list(trajectory.action),
        "segments": list(trajectory.segments),
        "final_text": trajectory.final_text,
        "turns": trajectory.turns,
        "turn": trajectory.turn,
        "rewards": dict(trajectory.rewards),
        "metrics": dict(trajectory.metrics),
        "steps": list(trajectory.steps),
        "observations": list(trajectory.observations),
        "pending": None if trajectory.pending is None else list(trajectory.pending),
        "engine_logprobs": logprob_kinds[0],
        "policy_logprobs": sample.state.get("policy_logprobs", True) and logprob_kinds[1],
    }


def _restored(
    environment: TurnEnvironment,
    group: Group,
    index: int,
    sample: Sample,
    encoder: PromptEncoder,
    params: SamplingParams,
    held: dict[Any, Any],
) -> Trajectory:
    """The trajectory of ``sample`` from its plain record, with its live environment (``held``), or one replayed
    into a fresh copy (a resumed run: the module docstring)."""
    state = sample.state
    live = held.get((group.number, index))
    if live is None:
        live = _replayed(environment, group, sample, encoder, params)
        held[group.number, index] = live
    pending = state.get("pending")  # (a checkpoint from before background steps has none)
    return Trajectory(
        live.env,
        list(state["prompt"]),
        state["source"],
        ids=list(sample.tokens),
        action=list(state["action"]),
        logprobs=list(sample.logprobs),
        policy_logprobs=list(sample.policy_logprobs),
        versions=list(sample.versions),
        segments=list(state["segments"]),
        final_text=state["final_text"],
        turns=state["turns"],
        active=not sample.ended,
        truncated=sample.truncated,
        rewards=dict(state["rewards"]),
        metrics=dict(state["metrics"]),
        turn=state["turn"],
        steps=list(state["steps"]),
        observations=list(state["observations"]),
        pending=None if pending is None else (str(pending[0]), bool(pending[1]), bool(pending[2])),
        step=live.step,
    )


def _replayed(
    environment: TurnEnvironment, group: Group, sample: Sample, encoder: PromptEncoder, params: SamplingParams
) -> Live:
    """A fresh copy of ``environment`` brought to ``sample``'s state: reset on the row, then its turns stepped in
    order, each observation checked against the recorded one; then its pending turn's step, if any (``Live.step``,
    done: collected by the segment as the uninterrupted run collects the one it launched, an exception with it)."""
    name = type(environment).__name__
    if not environment.replays_exactly:
        raise ConfigError(
            f"data.environment {name} declares replays_exactly = False: a resumed run cannot restore its trajectories "
            "in flight with data.schedule.partial_rollouts; resume with partial_rollouts: false, or start afresh"
        )
    trajectory = Trajectory(environment.spawn(), group.prompt, group.row["prompt"])
    start_trajectory(trajectory, group.row, environment, encoder, params.max_new_tokens)
    replayed = [trajectory.prompt, trajectory.ids]
    recorded = [sample.state["prompt"], sample.tokens[: len(trajectory.ids)]]
    steps = sample.state["steps"]
    for turn, seen in zip(steps, sample.state["observations"]):
        replayed.append(trajectory.env.step(turn).observation)
        recorded.append(seen)
    if replayed != recorded:
        raise RuntimeError(
            f"data.environment {name} answered a replay of a trajectory in flight otherwise than the run it was "
            "checkpointed in (not deterministic): partial rollouts cannot resume it exactly; make reset and step "
            "deterministic, declare replays_exactly = False, or resume with partial_rollouts: false"
        )
    pending, step = sample.state.get("pending"), None
    if pending is not None:
        step = Future()
        try:
            step.set_result(trajectory.env.step(pending[0]))
        except Exception as err:  # noqa: BLE001 - raised when the segment collects it, as a launched step's is
            step.set_exception(err)
    return Live(trajectory.env, step)
