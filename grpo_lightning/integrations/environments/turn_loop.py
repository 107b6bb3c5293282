"""The turn loop of multi-turn rollouts: policy turns sampled from the trajectories' token ids, environments stepped
when a turn ends, observations appended; one loop for a whole rollout and for a segment of partial rollouts.

``run_turns`` is what ``multiturn.generate_trajectories`` runs for a round (no budget: every trajectory to its end)
and what ``partial_turns.decode_segment`` runs for one segment of ``data.schedule.partial_rollouts`` (a budget of
model tokens per trajectory: ``tokens_per_push``). A trajectory that reaches the budget mid-turn is *paused*: its
tokens so far stay in its context, it stays active and is not stepped; the next segment continues the turn under
the new weights (the turn's text, stop texts and length limit then count the whole turn). Without a budget the loop
makes exactly the engine calls of the round's rollout (the module docstring of ``multiturn.py``).

Where a turn that ends is stepped: by default (``TurnLoop.steps`` None: a round, or a segment whose budget covers
``max_new_tokens``) inside the loop, the turn's trajectories together (``step_environments``), their observations
appended before the next engine call. With ``TurnLoop.steps`` (a segment of partial rollouts whose budget is below
``max_new_tokens``) the step is *launched* there (``launch_steps``: a future in that thread pool) and the trajectory
*parked* (``Trajectory.pending``): it draws no more tokens in this segment, which goes on with the others and ends
without waiting for the step; the next segment collects it (``partial_turns``), in trajectory order. Both apply a
step by one function (``apply_steps``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

import grpo_lightning.integrations.environments.stops as stops
from grpo_lightning.engines.base import RolloutEngine, SamplingParams
from grpo_lightning.engines.continuation import GenerationSession
from grpo_lightning.integrations.environments.turn_tokens import TurnEnvironment, left_padded, observations_ids

NO_VERSION = -1
"""The version of an observation's tokens: the environment's, drawn by no policy."""


@dataclass
class Trajectory:
    """One trajectory as far as it has gone: its environment copy, prompt ids, tokens after the prompt (the policy's
    and the observations', ``action`` 1 on the policy's), each token's log-probs and the weights version that drew
    it, and what its turns earned."""

    env: TurnEnvironment
    prompt: list[int]
    source: Any  # the prompt before tokens: the row's, or the environment's (``trajectory_prompt``)
    vision: dict[str, Tensor] | None = None  # its row's image inputs (a vision-language model's prompt)
    ids: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    final_text: str = ""
    turns: int = 0
    active: bool = True
    truncated: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    turn: int = 0
    """Tokens of the current turn already in ``ids`` (a turn paused at a segment's budget; 0 between turns)."""
    steps: list[str] = field(default_factory=list)
    """Each stepped turn's text, in order: what replays the environment into a fresh copy (``partial_turns``)."""
    observations: list[str | None] = field(default_factory=list)
    """Each step's observation text (None: none), to check a replay against."""
    spent: int = 0
    """Model tokens drawn in the current segment (``run_turns``'s budget)."""
    pending: tuple[str, bool, bool] | None = None
    """A turn that ended and whose environment step runs in the background (``TurnLoop.steps``): its text, whether
    it ended at an end token, whether at a stop text. Plain data: a checkpoint holds it, and a resumed run replays
    the step. The trajectory is neither ended nor continued until the step is applied (``apply_steps``)."""
    step: Future | None = None
    """The pending turn's step, running (never recorded: the background process keeps it between segments)."""

    def append(
        self,
        ids: list[int],
        policy: bool,
        logprobs: list[float] | None = None,
        policy_logprobs: list[float] | None = None,
        version: int = 0,
    ) -> None:
        self.ids += ids
        self.action += [int(policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.policy_logprobs += policy_logprobs if policy_logprobs is not None else [0.0] * len(ids)
        self.versions += [version if policy else NO_VERSION] * len(ids)


@dataclass
class TurnLoop:
    """What every turn of a rollout (or segment) shares: the engine and its call's settings, the limits and ends."""

    engine: RolloutEngine
    environment: TurnEnvironment
    tokenizer: Any
    params: SamplingParams
    generator: Any
    return_logprobs: bool
    device: Any
    ends: tuple[int, ...]
    stop_ids: tuple[tuple[int, ...], ...]
    scanner: stops.StopScanner
    session: GenerationSession | None = None
    version: int = 0
    """The weights version the engine holds: recorded on every token it draws."""
    steps: ThreadPoolExecutor | None = None
    """Where a turn that ends is stepped in the background (the module docstring); None: inside the loop."""

    @property
    def total_limit(self) -> int:
        return self.params.max_new_tokens

    @property
    def turn_limit(self) -> int:
        return min(self.environment.max_turn_tokens or self.total_limit, self.total_limit)


def turn_loop(
    engine: RolloutEngine,
    environment: TurnEnvironment,
    tokenizer: Any,
    params: SamplingParams,
    *,
    generator: Any,
    return_logprobs: bool,
    device: Any,
    session: GenerationSession | None,
    version: int = 0,
    steps: ThreadPoolExecutor | None = None,
) -> TurnLoop:
    """The ``TurnLoop`` of ``environment`` (set up) on ``engine``: its end ids, stop sequences and stop scanner."""
    ends, stop_ids = end_token_ids(engine, tokenizer), stop_sequences(environment, tokenizer)
    scanner = stops.StopScanner(environment.stop_texts, tokenizer)  # one per rollout: its turns repeat the same windows
    return TurnLoop(
        engine, environment, tokenizer, params, generator, return_logprobs, device, ends, stop_ids, scanner, session,
        version, steps,
    )  # fmt: skip


def stop_sequences(environment: TurnEnvironment, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The token sequences of the environment's stop texts, for the engine's early stop (``stops.stop_sequences``:
    alone and in context; the text rule stays the rule)."""
    return stops.stop_sequences(environment.stop_texts, tokenizer)


def end_token_ids(engine: RolloutEngine, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a turn: the engine's ``eos_token_ids`` (set by its ``setup``), else the tokenizer's EOS."""
    return tuple(engine.eos_token_ids) or (tokenizer.eos_token_id,)


def open_session(engine: RolloutEngine, encoder: Any) -> GenerationSession | None:
    """The KV-cache session of one rollout (or one segment: never across a weight push), where the engine keeps a
    cache (``supports_continuation``) and the encoder's turns continue token for token (a vision-language model's
    are prefilled whole, with their images: its cache holds M-RoPE offsets); None otherwise."""
    keeps = engine.supports_continuation and encoder.continues_token_exact
    return engine.open_session() if keeps else None


def step_environments(environments: list[TurnEnvironment], turns: list[str], max_workers: int = 1) -> list[Any]:
    """``environments[i].step(turns[i])`` for each i, in order. One at a time in this thread when ``max_workers`` is
    1 (an environment that times its calls with SIGALRM, ``ToolEnvironment``, needs the main thread); else at most
    ``max_workers`` at once in a thread pool (``launch_steps``), for environments that wait on a server or a process
    (an environment's ``max_concurrency``). The same steps either way: each trajectory's copy steps only itself, and
    the results keep the trajectories' order (the first exception, in that order, is raised once every step has
    ended: ``step_results``)."""
    if max_workers <= 1 or len(environments) <= 1:
        return [env.step(turn) for env, turn in zip(environments, turns)]
    workers = min(max_workers, len(environments))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="environment-step") as pool:
        futures = launch_steps(pool, environments, turns)
    return step_results(futures)  # the pool has waited for every step


def launch_steps(pool: ThreadPoolExecutor, environments: list[TurnEnvironment], turns: list[str]) -> list[Future]:
    """``environments[i].step(turns[i])`` for each i, launched in ``pool`` (at most its workers at once): the
    futures, in order. Each trajectory's copy steps only itself, so the steps may run in any order."""
    return [pool.submit(env.step, turn) for env, turn in zip(environments, turns)]


def step_results(futures: list[Future]) -> list[Any]:
    """The steps of ``futures``, in order, each waited for: the first exception, in that order, is raised."""
    return [future.result() for future in futures]


def apply_steps(loop: TurnLoop, stepped: list[tuple[Trajectory, str, bool, bool, Any]]) -> None:
    """Each ended turn's step applied to its trajectory, in order: ``(trajectory, turn text, ended at an end token,
    ended at a stop text, step)``. The turn and its observation are recorded (what a replay steps and checks), the
    step's rewards and metrics added; the trajectory ends (its turn cut by a length limit, ``done``, out of turns, or
    no room for the observation and a next turn) or its observation is appended (the turn's observations tokenized
    in one call). The one rule of a step, whether it ran inside the loop or in the background."""
    environment, tokenizer, total_limit = loop.environment, loop.tokenizer, loop.total_limit
    going_on: list[tuple[Trajectory, str | None]] = []  # trajectories that go on, and their observations
    for trajectory, text, ended, stopped, step in stepped:
        trajectory.pending, trajectory.step = None, None
        trajectory.steps.append(text)
        trajectory.observations.append(step.observation)
        for name, value in step.rewards.items():
            trajectory.rewards[name] = trajectory.rewards.get(name, 0.0) + float(value)
        for name, value in step.metrics.items():
            trajectory.metrics[name] = trajectory.metrics.get(name, 0.0) + float(value)
        if not ended and not stopped:  # cut by a length limit: the policy did not finish its turn
            trajectory.active, trajectory.truncated = False, True
            continue
        if step.done or trajectory.turns == environment.max_turns:  # the final answer, or out of turns
            trajectory.active = False
            continue
        going_on.append((trajectory, step.observation))
    observed_ids = iter(observations_ids(environment, [text for _, text in going_on if text], tokenizer))
    for trajectory, text in going_on:
        observed = next(observed_ids) if text else []
        if len(trajectory.ids) + len(observed) >= total_limit:  # no room for the answer and a next turn
            trajectory.active, trajectory.truncated = False, True
            continue
        trajectory.append(observed, policy=False)
        trajectory.segments.append(tokenizer.decode(observed))


def unpadded(tokenizer: Any) -> None:
    """Put the tokenizer in the state an observation is encoded in (no padding, no truncation: ``observations_ids``,
    ``Environment.count_tokens``), in this thread, before environment steps run in others. A fast tokenizer keeps
    that state in Rust and refuses to change it while another thread encodes ("Already borrowed"); the prompts'
    encoding (padded) leaves it changed, and steps that each changed it back at once could collide."""
    tokenizer("", add_special_tokens=False)


def collect_steps(loop: TurnLoop, trajectories: list[Trajectory]) -> int:
    """The steps the trajectories' pending turns were launched for (``Trajectory.step``), waited for and applied in
    trajectory order (``apply_steps``; the first exception, in that order, is raised). Returns how many."""
    parked = [t for t in trajectories if t.pending is not None]
    steps = step_results([t.step for t in parked])
    apply_steps(loop, [(t, *t.pending, step) for t, step in zip(parked, steps)])
    return len(parked)


def run_turns(
    trajectories: list[Trajectory],
    loop: TurnLoop,
    *,
    group_prompts: tuple[Tensor, Tensor, Any] | None = None,
    budget: int | None = None,
) -> tuple[bool, float]:
    """Turns of the active ``trajectories`` until each has ended or (``budget``) drawn ``budget`` model tokens.

    ``group_prompts``: ``(ids, mask, vision)`` of each group's shared prompt, given when every trajectory is fresh
    and a group's share their prompt: their first turn is then sampled with the engine's group sampling (one
    prefill per prompt). Returns whether every engine call gave the policy's log-probs beside the sampler's, and
    the seconds spent in the environments' steps."""
    params, tokenizer, environment = loop.params, loop.tokenizer, loop.environment
    total_limit, turn_limit = loop.total_limit, loop.turn_limit
    with_policy_logprobs, env_seconds = loop.return_logprobs, 0.0
    for trajectory in trajectories:
        trajectory.spent = 0
    if loop.steps is not None or environment.max_concurrency > 1:
        unpadded(tokenizer)  # steps will run in threads beside this one

    def going(t: Trajectory) -> bool:  # neither ended, nor parked on its step, nor out of budget
        return t.active and t.pending is None and (budget is None or t.spent < budget)

    called: list[Trajectory] = []  # the rows of the engine's last call, whose keys and values it keeps
    first = True
    while True:
        active = [t for t in trajectories if going(t)]
        if not active:
            break
        limits = [
            min(turn_limit - t.turn, total_limit - len(t.ids), budget - t.spent if budget is not None else total_limit)
            for t in active
        ]
        turn_params = params.with_(max_new_tokens=max(limits), stop_sequences=loop.stop_ids)
        continuing: dict[str, Any] = {}
        if loop.session is not None:  # the trajectories that go on keep their cache; only new tokens are prefilled
            loop.session.select([i for i, t in enumerate(called) if going(t)])
            continuing, called = {"session": loop.session}, active
        if first and group_prompts is not None and not any(t.ids for t in trajectories):
            # All trajectories of a group share their context: the engine's group sampling, one prefill per prompt.
            prompt_ids, prompt_mask, vision = group_prompts
            continuing.update({} if vision is None else {"vision": vision})
            out = loop.engine.generate(
                prompt_ids, prompt_mask, turn_params, generator=loop.generator, return_logprobs=loop.return_logprobs,
                **continuing,
            )  # fmt: skip
        else:
            ids, mask = left_padded([t.prompt + t.ids for t in active], tokenizer.pad_token_id, loop.device)
            vision = [t.vision for t in active]
            continuing.update({} if all(v is None for v in vision) else {"vision": vision})  # their images
            out = loop.engine.generate(
                ids,
                mask,
                turn_params.with_(group_size=1, min_new_tokens=0),
                generator=loop.generator,
                return_logprobs=loop.return_logprobs,
                **continuing,
            )
        first = False
        lengths = out.completion_mask.sum(-1).tolist()
        generated = out.completion_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        policy_logprobs = out.policy_logprobs.tolist() if out.policy_logprobs is not None else None
        with_policy_logprobs = with_policy_logprobs and policy_logprobs is not None
        sampled = []  # each turn that ended: (trajectory, text, ended, stopped), stepped together below
        for i, (trajectory, limit) in enumerate(zip(active, limits)):
            new = generated[i][: min(lengths[i], limit)]
            new = new[: next((k + 1 for k, token in enumerate(new) if token in loop.ends), len(new))]  # its first end
            before = len(trajectory.ids) - trajectory.turn  # where the turn starts
            turn_ids = trajectory.ids[before:] + new  # a paused turn's tokens, then this call's
            cut, found = loop.scanner.find(turn_ids)
            kept = max(cut, trajectory.turn) - trajectory.turn
            new, turn_ids = new[:kept], turn_ids[: trajectory.turn + kept]
            ended = bool(turn_ids) and turn_ids[-1] in loop.ends
            stopped = found and not ended  # cut right after its stop text
            trajectory.append(
                new,
                policy=True,
                logprobs=logprobs[i][: len(new)] if logprobs else None,
                policy_logprobs=policy_logprobs[i][: len(new)] if policy_logprobs else None,
                version=loop.version,
            )
            trajectory.spent += len(new)
            trajectory.turn += len(new)
            at_limit = trajectory.turn >= turn_limit or len(trajectory.ids) >= total_limit
            if not ended and not stopped and not at_limit and budget is not None and trajectory.spent >= budget:
                continue  # paused at the segment's budget: the next segment continues this turn
            text = tokenizer.decode(turn_ids, skip_special_tokens=True)
            trajectory.segments.append(text)
            trajectory.final_text, trajectory.turns, trajectory.turn = text, trajectory.turns + 1, 0
            sampled.append((trajectory, text, ended, stopped))
        start = time.perf_counter()
        if loop.steps is not None:  # launched; the trajectories parked until the next segment collects them
            futures = launch_steps(loop.steps, [t.env for t, *_ in sampled], [text for _, text, *_ in sampled])
            for (trajectory, text, ended, stopped), future in zip(sampled, futures):
                trajectory.pending, trajectory.step = (text, ended, stopped), future
        else:
            steps = step_environments(
                [t.env for t, *_ in sampled], [t[1] for t in sampled], environment.max_concurrency
            )
            apply_steps(loop, [(*turn, step) for turn, step in zip(sampled, steps)])
        env_seconds += time.perf_counter() - start
    return with_policy_logprobs, env_seconds
