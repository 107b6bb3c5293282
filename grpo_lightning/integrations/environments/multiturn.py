"""Multi-turn rollouts in token space: policy turns and environment observations, concatenated as token ids.

``environment_rollout`` is an environment's rollout kind (``Environment.rollout``, ``rollout/kind.py``): the
trajectories below, scored on their final turns through the core's ``score_completions`` with the environment's
reward parts as reward columns. What it asks of an environment is ``turn_tokens.TurnEnvironment``.

``generate_trajectories`` runs G trajectories per prompt against copies of ``data.environment``:

    1. the first turn is sampled from the prompts with the engine's group sampling (one prefill per prompt);
    2. each later turn is sampled from the trajectory's own token ids so far (prompt + earlier turns +
       observations), never from re-tokenized text: a token the policy drew stays that token (TRL #5224, verl
       #3960 are the drift this avoids);
    3. a turn ends at an end token (any of ``engine.eos_token_ids``: the tokenizer's EOS and the model's
       ``generation_config`` EOS ids), at a stop text of the environment or at its length limit. Stop texts follow
       ``integrations/environments/stops.py``: the turn is cut after the first token at which its text (special tokens
       kept) holds one, found in one linear scan, and ``SamplingParams.stop_sequences`` (every tokenization of the stop
       texts) lets the engine stop there early; the kept tokens are the same either way;
    4. the environment answers the turn's text (``step``): ``done`` ends the trajectory (the turn was the final
       answer); otherwise its observation is tokenized on its own and appended, and the next turn follows. An
       environment fits its observations to ``max_observation_tokens`` (``Environment.fit_observation``: the text
       cut, its frame kept); the rollout cuts an oversize one's tokens only as a last resort, with a warning.
       The active trajectories' environments answer a turn one at a time, or up to the environment's
       ``max_concurrency`` at once in threads (``turn_loop.step_environments``: the same answers, in the same order).

An environment may choose a trajectory's prompt after ``reset``: the function schemas the chat template lists
(``prompt_tools``) and the prompt itself (``trajectory_prompt``: TRL's classes append reset's text to its last
message); it is rendered and tokenized once, and a group whose trajectories share it still samples its first turn
with one prefill. ``final_rewards`` is asked once per trajectory when it ends (TRL's ``get_reward``).

The whole trajectory after the prompt is the "completion" of the rest of the pipeline: ``completion_mask`` = every
token (all are context for the log-prob passes), ``action_mask`` = the policy's tokens only, which becomes the
round's ``loss_mask``: environment tokens are in the context but out of the loss, the KL and every loss metric.
The engine's log-probs of environment tokens are 0 (never used: masked).

Limits: ``environment.max_turns`` policy turns, ``environment.max_turn_tokens`` per turn, and
``params.max_new_tokens`` for everything after the prompt. A trajectory cut by a length limit (a turn without EOS
or stop, or no room left for an observation and a next turn) is ``truncated``, as a single-turn completion cut
by ``max_new_tokens`` is.

Each turn after the first continues from the engine's KV cache where the engine keeps one (``lean``,
``transformers``: ``supports_continuation``, ``engines/continuation.py``): the engine prefills only what the
trajectory added since its last call (the observation, and the turn's last token if it was never fed back), and
the trajectories that ended drop out of its batch, their cache with them. The cache lives for one call of
``generate_trajectories`` (closed when it returns, so it never meets the next round's weights); other engines
prefill every turn's whole context (vLLM's prefix cache finds the shared prefix itself). The kept keys and values
were computed in other matrix shapes than a full prefill's, so later turns' logits differ from it in the last bits.

The turns themselves (sample, cut at an end or stop text, step, append the observation) are ``turn_loop.run_turns``,
which a segment of partial rollouts runs too, with a budget of model tokens (``partial_turns.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import grpo_lightning.integrations.environments.stops as stops
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.engines.continuation import GenerationSession
from grpo_lightning.integrations.environments.turn_loop import Trajectory, open_session, run_turns, turn_loop
from grpo_lightning.integrations.environments.turn_loop import end_token_ids as end_token_ids  # named here as before
from grpo_lightning.integrations.environments.turn_loop import stop_sequences as stop_sequences
from grpo_lightning.integrations.environments.turn_tokens import (
    TurnEnvironment,
    left_padded,
    observation_ids,
    right_padded,
)
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.sample_and_score import score_completions


@dataclass
class Trajectories:
    """G trajectories per prompt (groups adjacent), as ``Completions`` plus what the turns add."""

    completions: Completions  # completion_* = the whole trajectory after the prompt
    action_mask: Tensor  # [N, T] 1 on the policy's tokens (0 on observations and padding)
    final_texts: list[str]  # the last policy turn's text: what the rewards score
    transcripts: list[str]  # every turn and observation, as text
    # per trajectory, summed over its turns; None where it earned no part of that name ("not applicable")
    env_rewards: dict[str, list[float | None]] = field(default_factory=dict)
    stats: dict[str, list[float]] = field(default_factory=dict)  # turns, policy/env tokens, environment metrics
    environment_s: float = 0.0  # seconds spent in the environment (its steps and resets)
    prompts: list[Any] = field(default_factory=list)  # each trajectory's prompt (``Environment.trajectory_prompt``)
    environments: list[Any] = field(default_factory=list)  # each trajectory's ``Environment.reward_view()``
    vision: list[dict[str, Tensor]] | None = None  # a vision-language model's: each trajectory's image inputs


def environment_rollout(
    environment: TurnEnvironment,
    rows: dict[str, list[Any]],
    *,
    engine: RolloutEngine,
    encoder: PromptEncoder,
    scorer: Scorer,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    device: torch.device | str = "cpu",
    timings: dict[str, float] | None = None,
) -> RolloutBatch:
    """An environment's rollout (``Environment.rollout``, ``rollout/kind.py``): ``generate_trajectories``, scored
    through ``score_completions`` on each trajectory's final turn, with the environment's reward parts as reward
    columns (each weighed by ``reward_weights``); the rows keep which tokens were the policy's (``action_mask``),
    the transcripts and the turns' counts."""
    start = time.perf_counter()
    trajectories = generate_trajectories(
        rows,
        engine=engine,
        encoder=encoder,
        environment=environment,
        params=params,
        generator=generator,
        return_logprobs=return_logprobs,
        device=device,
    )
    if timings is not None:
        timings["generate"] = timings.get("generate", 0.0) + time.perf_counter() - start
        timings["environment"] = timings.get("environment", 0.0) + trajectories.environment_s
    return score_trajectories(
        environment, rows, trajectories, encoder=encoder, scorer=scorer, params=params, timings=timings
    )


def score_trajectories(
    environment: TurnEnvironment,
    rows: dict[str, list[Any]],
    trajectories: Trajectories,
    *,
    encoder: PromptEncoder,
    scorer: Scorer,
    params: SamplingParams,
    timings: dict[str, float] | None = None,
) -> RolloutBatch:
    """``trajectories`` (G per row of ``rows``, groups adjacent) scored through ``score_completions`` on each one's
    final turn, the environment's reward parts as reward columns: the one scoring of a round's trajectories and of
    the groups a segment of partial rollouts ended (``partial_turns.score_segment``)."""
    batch = score_completions(
        rows,
        trajectories.completions,
        trajectories.final_texts,
        encoder=encoder,
        scorer=scorer,
        params=params,
        policy_lengths=trajectories.action_mask.sum(-1).tolist(),
        # An environment may have changed a trajectory's prompt (TRL's: reset's text in its last message): the
        # rewards see each trajectory's own, as TRL's do.
        scored_prompts=trajectories.prompts,
        columns={
            "transcripts": trajectories.transcripts,  # every turn, for rewards that judge the tool use
            "environments": trajectories.environments,  # each trajectory's environment, as TRL passes them
        },
        parts={f"env_{name}": values for name, values in trajectories.env_rewards.items()},
        part_weights={f"env_{name}": weight for name, weight in environment.reward_weights().items()},
        vision=trajectories.vision,
        timings=timings,
    )
    batch.action_mask = trajectories.action_mask
    batch.transcripts, batch.turn_stats = trajectories.transcripts, trajectories.stats
    return batch


def setup_environment(environment: TurnEnvironment, tokenizer: Any) -> None:
    """``environment.setup(tokenizer)`` unless it was set up with this tokenizer already."""
    if environment.tokenizer is not tokenizer:
        environment.setup(tokenizer)


def cut_at_stop_text(ids: list[int], stop_texts: tuple[str, ...], tokenizer: Any) -> int:
    """The shortest prefix of ``ids`` whose text (special tokens kept) holds a stop text (``len(ids)`` when none
    does); ``stops.find_stop`` also says whether one was found."""
    return stops.find_stop(ids, stop_texts, tokenizer)[0]


def generate_trajectories(
    rows: dict[str, list[Any]],
    *,
    engine: RolloutEngine,
    encoder: PromptEncoder,
    environment: TurnEnvironment,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    device: torch.device | str = "cpu",
) -> Trajectories:
    """``params.group_size`` trajectories (one when greedy) per prompt of ``rows``; see the module docstring."""
    # An engine that continues from its kept KV cache does so across this rollout's turns, and only here: the
    # session is closed when the rollout ends, before any weight update (``engines/continuation.py``).
    # A vision-language model's turns are prefilled whole, with their images (its cache holds M-RoPE offsets): its
    # encoder says so (``PromptEncoder.continues_token_exact``).
    session = open_session(engine, encoder)
    try:
        return _generate(rows, engine, encoder, environment, params, generator, return_logprobs, device, session)
    finally:
        if session is not None:
            session.close()


def _generate(
    rows: dict[str, list[Any]],
    engine: RolloutEngine,
    encoder: PromptEncoder,
    environment: TurnEnvironment,
    params: SamplingParams,
    generator: torch.Generator | None,
    return_logprobs: bool,
    device: torch.device | str,
    session: GenerationSession | None,
) -> Trajectories:
    tokenizer = encoder.tokenizer
    setup_environment(environment, tokenizer)
    group = 1 if params.greedy else params.group_size
    prompt_ids, prompt_mask, vision = encoder.encode_rows(rows, device)  # vision: per prompt, a VLM's (else None)
    started = time.perf_counter()
    trajectories = []
    rendered = False  # an environment chose a trajectory's prompt: its tools listed, or reset's text inside
    for b in range(prompt_ids.size(0)):
        prompt = prompt_ids[b][prompt_mask[b].bool()].tolist()
        row = {name: values[b] for name, values in rows.items()}
        for _ in range(group):
            trajectory = Trajectory(environment.spawn(), prompt, row["prompt"], None if vision is None else vision[b])
            rendered |= start_trajectory(trajectory, row, environment, encoder, params.max_new_tokens)
            trajectories.append(trajectory)
    env_seconds = time.perf_counter() - started
    pad = tokenizer.pad_token_id
    # A group samples its first turn with one prefill while its trajectories share their prompt (a deterministic
    # reset); a prompt of a trajectory's own is sampled on its own, as later turns are.
    grouped = all(t.prompt == trajectories[i - i % group].prompt for i, t in enumerate(trajectories))
    if rendered and grouped:
        prompt_ids, prompt_mask = left_padded([t.prompt for t in trajectories[::group]], pad, device)
    group_vision = None if vision is None else [t.vision for t in trajectories[::group]]
    loop = turn_loop(
        engine, environment, tokenizer, params, generator=generator, return_logprobs=return_logprobs, device=device,
        session=session,
    )  # fmt: skip
    group_prompts = (prompt_ids, prompt_mask, group_vision) if grouped else None
    with_policy_logprobs, stepped = run_turns(trajectories, loop, group_prompts=group_prompts)
    env_seconds += stepped
    start = time.perf_counter()
    for trajectory in trajectories:  # what the environment scores once per trajectory (TRL's get_reward)
        add_final_rewards(trajectory)
    env_seconds += time.perf_counter() - start
    if rendered:  # each trajectory's own prompt
        prompt_ids, prompt_mask = left_padded([t.prompt for t in trajectories], pad, device)
    else:
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
    logprob_kinds = (return_logprobs, with_policy_logprobs)
    assembled = assemble(trajectories, prompt_ids, prompt_mask, pad, env_seconds, device, logprob_kinds)
    assembled.vision = None if vision is None else [t.vision for t in trajectories]
    return assembled


def start_trajectory(
    trajectory: Trajectory, row: dict[str, Any], environment: TurnEnvironment, encoder: PromptEncoder, limit: int
) -> bool:
    """``reset`` the trajectory's environment on ``row``; the prompt it chose (its tools listed, or reset's text
    inside) rendered, and its first observation appended (the trajectory ends truncated when that leaves no room
    for a turn within ``limit`` tokens). Returns whether the environment chose the prompt."""
    tokenizer = encoder.tokenizer
    first = trajectory.env.reset(row)
    own, tools = trajectory.env.trajectory_prompt(row["prompt"]), trajectory.env.prompt_tools(row)
    if tools or own is not row["prompt"]:
        # A vision-language model's: its images' tokens too, and image inputs that know this prompt (vLLM is given
        # it unexpanded); a text model's: the ids alone (its inputs None: the row's kept).
        trajectory.prompt, inputs = encoder.trajectory_inputs(own, tools, row)
        trajectory.vision = trajectory.vision if inputs is None else inputs
        trajectory.source = own
    if first:
        observed = observation_ids(environment, first, tokenizer)
        trajectory.append(observed, policy=False)
        trajectory.segments.append(tokenizer.decode(observed))
        if len(observed) >= limit:  # no room for a turn
            trajectory.active, trajectory.truncated = False, True
    return bool(tools) or own is not row["prompt"]


def add_final_rewards(trajectory: Trajectory) -> None:
    """What the environment scores once per trajectory when it has ended (TRL's ``get_reward``)."""
    for name, value in trajectory.env.final_rewards().items():
        trajectory.rewards[name] = trajectory.rewards.get(name, 0.0) + float(value)


def assemble(
    trajectories: list[Trajectory],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    pad_token_id: int,
    env_seconds: float,
    device: torch.device | str,
    logprob_kinds: tuple[bool, bool],
) -> Trajectories:
    ids = right_padded([t.ids for t in trajectories], pad_token_id, torch.long, device)
    mask = right_padded([[1] * len(t.ids) for t in trajectories], 0, torch.long, device)
    completions = Completions(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        truncated=torch.tensor([t.truncated for t in trajectories], device=ids.device),
        logprobs=right_padded([t.logprobs for t in trajectories], 0.0, torch.float32, device)
        if logprob_kinds[0]
        else None,
        policy_logprobs=right_padded([t.policy_logprobs for t in trajectories], 0.0, torch.float32, device)
        if logprob_kinds[1]
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
        action_mask=right_padded([t.action for t in trajectories], 0, torch.long, device),
        final_texts=[t.final_text for t in trajectories],
        transcripts=["".join(t.segments) for t in trajectories],
        env_rewards={name: [t.rewards.get(name) for t in trajectories] for name in names},
        stats=stats,
        environment_s=env_seconds,
        prompts=[t.source for t in trajectories],
        environments=[t.env.reward_view() for t in trajectories],
    )
