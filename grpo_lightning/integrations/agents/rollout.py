"""A round's agent sessions as a scored ``RolloutBatch``: ``AgentEnvironment``'s rollout (``rollout/kind.py``), what
``sample_and_score`` gives with ``data.environment`` an ``AgentEnvironment``.

1. A gateway opens for the round (``integrations/agents/gateway.py``); every trajectory's agent runs in a session of its
   own while this thread serves their calls with the engine (``integrations/agents/serving.py``); the gateway closes.
2. Each session's calls become rows (``integrations/agents/calls.py``: calls that extend a row's tokens merge into it).
   A session that made no call gets one row of one end token, out of the loss.
3. The rewards score each **session** once: ``data.rewards`` on its last completion's text (with the columns
   ``transcripts``, ``agent_results`` (what the agent returned) and ``agent_calls`` (each call's request, text and
   finish reason)), plus the agent's own reward parts: reward columns of weight 1 under the scorer's rule (None: this
   agent did not return that part; a session no column gives a value is unscorable).
4. The batch holds one row per training row, the rows of a session adjacent and sharing its reward;
   ``RolloutBatch.trajectory`` says which session each row is, so that group statistics and advantages are over
   sessions (``rollout/round.py``), each row taking its session's advantage. A failed session (on_error: skip) or
   an empty one is out of every column (``left_out``), so unscorable: advantage 0, out of its group's baseline
   whichever aggregation, its rows out of the loss.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from grpo_lightning.engines.base import RolloutEngine, SamplingParams
from grpo_lightning.integrations.agents.calls import AgentRow, merge_calls, scored_row
from grpo_lightning.integrations.agents.gateway import Gateway
from grpo_lightning.integrations.agents.serving import CallServer
from grpo_lightning.integrations.agents.sessions import SessionOutcome
from grpo_lightning.models.sources import config_context_length
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.prompts import PromptEncoder

log = logging.getLogger(__name__)


class Agents(Protocol):
    """What a round of agent sessions asks of ``integrations/agents/environment.AgentEnvironment`` (its docstring says
    what each is)."""

    host: str
    port: int
    max_turns: int  # the calls a session may make (``max_calls``)
    max_turn_tokens: int | None  # the tokens one call may generate (``max_call_tokens``)
    chat_template_kwargs: dict[str, Any]

    def run_sessions(self, rows: list[dict[str, Any]], server: CallServer) -> list[SessionOutcome]: ...


def sample_and_score_agents(
    rows: dict[str, list[Any]],
    *,
    agent: Agents,
    engine: RolloutEngine,
    encoder: PromptEncoder,
    scorer: Scorer,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    timings: dict[str, float] | None = None,
) -> RolloutBatch:
    """``params.group_size`` agent sessions (one when greedy) per row of ``rows``, as rows scored per session."""
    tokenizer = encoder.tokenizer
    group = 1 if params.greedy else params.group_size
    jobs = [
        {name: values[b] for name, values in rows.items()} for b in range(len(rows["prompt"])) for _ in range(group)
    ]
    start = time.perf_counter()
    gateway = Gateway(agent.host, agent.port)
    try:
        server = CallServer(
            gateway,
            engine=engine,
            tokenizer=tokenizer,
            params=params,
            generator=generator,
            max_call_tokens=agent.max_turn_tokens or params.max_new_tokens,
            max_calls=agent.max_turns,
            context_limit=context_limit(engine),
            template_kwargs=agent.chat_template_kwargs,
            device=device,
        )
        outcomes = agent.run_sessions(jobs, server)
    finally:
        gateway.close()
    generated = time.perf_counter()

    sessions = [session_rows(outcome, encoder) for outcome in outcomes]
    calls = [outcome.session.calls for outcome in outcomes]
    final_texts = [c[-1].text if c else "" for c in calls]
    columns = {name: [job[name] for job in jobs] for name in rows if name != "prompt"}
    columns["completion_lengths"] = [sum(sum(r.action) for r in s) for s in sessions]
    columns["completion_ids"] = [c[-1].completion_ids if c else [] for c in calls]
    columns["transcripts"] = [tokenizer.decode(s[scored_row(s)].completion_ids) for s in sessions]  # the scored row
    columns["agent_results"] = [outcome.result for outcome in outcomes]
    columns["agent_calls"] = [[{"request": x.request, "text": x.text, "finish_reason": x.finish_reason} for x in c]
                              for c in calls]  # fmt: skip
    prompts = [job["prompt"] for job in jobs]
    # The agent's parts are reward columns (None: this agent did not return it), weighed 1, under the scorer's rule;
    # a failed or empty session is out of every column. Unscorable: no column gives the session a value.
    names = sorted({name for outcome in outcomes for name in outcome.rewards})
    parts = {name: [outcome.rewards.get(name) for outcome in outcomes] for name in names}
    left_out = [outcome.failed or not calls[i] for i, outcome in enumerate(outcomes)]
    scores = scorer(prompts, final_texts, columns, parts=parts, left_out=left_out)

    counts = [len(s) for s in sessions]

    def per_row(values: list[Any]) -> list[Any]:  # a session's value for each of its rows
        return [value for value, count in zip(values, counts) for _ in range(count)]

    flat = [row for s in sessions for row in s]
    batch = rows_batch(flat, tokenizer.pad_token_id, device)
    batch.rewards = torch.tensor(per_row(scores.total), dtype=torch.float32, device=device)
    batch.trajectory = torch.tensor(per_row(list(range(len(sessions)))), device=device)
    batch.scored = torch.tensor([i == scored_row(s) for s in sessions for i in range(len(s))], device=device)
    batch.prompts, batch.completions = per_row(prompts), [row.text for row in flat]
    batch.reward_columns = {name: per_row(values) for name, values in scores.per_function.items()}
    batch.reward_weights = dict(scores.weights)
    batch.correct = per_row(scores.correct) if scores.correct is not None else None
    batch.unscorable = torch.tensor(per_row(scores.unscorable), dtype=torch.bool, device=device)
    batch.temperature, batch.max_new_tokens = params.temperature, params.max_new_tokens
    batch.reward_log = dict(scores.metrics)
    batch.extra_columns = {n: per_row(v) for n, v in scores.extra_columns.items() if len(v) == len(sessions)}
    batch.transcripts = [tokenizer.decode(row.completion_ids) for row in flat]
    batch.turn_stats = {
        "turns": [float(row.calls) for row in flat],
        "policy_tokens": [float(sum(row.action)) for row in flat],
        "env_tokens": [float(len(row.action) - sum(row.action)) for row in flat],
    }
    batch.agent_log = session_metrics(outcomes, counts, gateway, server)
    if batch.agent_log["split_sessions"]:
        log.info(
            "%d of %d agent sessions made more than one training row (a call whose prompt did not extend the "
            "previous prompt + completion: a chat template that rewrites history, or re-tokenized text)",
            int(batch.agent_log["split_sessions"]),
            len(sessions),
        )
    if timings is not None:
        timings["generate"] = timings.get("generate", 0.0) + generated - start
        timings["environment"] = timings.get("environment", 0.0) + generated - start - server.engine_s
        timings["score"] = timings.get("score", 0.0) + time.perf_counter() - generated
    return batch


def session_rows(outcome: SessionOutcome, encoder: PromptEncoder) -> list[AgentRow]:
    """The session's training rows (``merge_calls``); a failed session's out of the loss; one placeholder row (an
    end token after the row's prompt, out of the loss) for a session without calls."""
    rows = merge_calls(outcome.session.calls)
    if not rows:
        end = encoder.tokenizer.eos_token_id
        prompt = encoder.token_ids([outcome.row["prompt"]])[0]
        rows = [AgentRow(prompt, [end], [0], [0.0], [0.0])]
    if outcome.failed:
        for row in rows:
            row.action = [0] * len(row.action)
    return rows


def rows_batch(rows: list[AgentRow], pad: int, device: torch.device | str) -> RolloutBatch:
    """The tensors of ``rows``: prompts left-padded, completions right-padded; rewards still to be set."""
    n, prompt_width = len(rows), max(len(r.prompt_ids) for r in rows)
    width = max(max(len(r.completion_ids) for r in rows), 1)
    prompt_ids = torch.full((n, prompt_width), pad, dtype=torch.long)
    prompt_mask = torch.zeros((n, prompt_width), dtype=torch.long)
    completion_ids = torch.full((n, width), pad, dtype=torch.long)
    completion_mask, action = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width))
    with_policy = all(r.policy_logprobs is not None for r in rows)
    policy = torch.zeros((n, width)) if with_policy else None
    for i, row in enumerate(rows):
        p, c = len(row.prompt_ids), len(row.completion_ids)
        prompt_ids[i, prompt_width - p :], prompt_mask[i, prompt_width - p :] = torch.tensor(row.prompt_ids), 1
        completion_ids[i, :c], completion_mask[i, :c] = torch.tensor(row.completion_ids), 1
        action[i, :c], logprobs[i, :c] = torch.tensor(row.action), torch.tensor(row.logprobs)
        if policy is not None:
            policy[i, :c] = torch.tensor(row.policy_logprobs)
    batch = RolloutBatch(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        truncated=torch.tensor([r.truncated for r in rows], device=device),
        rewards=torch.zeros(n, device=device),
        engine_logprobs=logprobs.to(device),
        policy_logprobs=policy.to(device) if policy is not None else None,
    )
    batch.action_mask = action.to(device)
    return batch


def session_metrics(
    outcomes: list[SessionOutcome], counts: list[int], gateway: Gateway, server: CallServer
) -> dict[str, float]:
    """The round's ``agent/`` counts: rows and calls per session, sessions split or failed, requests refused."""
    sessions = len(outcomes)
    calls = sum(len(o.session.calls) for o in outcomes)
    return {
        "sessions": float(sessions),
        "rows_per_session": sum(counts) / sessions,
        "split_sessions": float(sum(count > 1 for count in counts)),
        "calls_per_session": calls / sessions,
        "empty_sessions": float(sum(not o.session.calls for o in outcomes)),
        "failed_sessions": float(sum(o.error is not None and not o.timed_out for o in outcomes)),
        "timed_out_sessions": float(sum(o.timed_out for o in outcomes)),
        "refused_requests": float(gateway.refused + sum(o.session.refused for o in outcomes)),
        "bad_requests": float(server.bad_requests),
        "abandoned_calls": float(server.abandoned),  # their clients had gone (timed out): not recorded
        "calls_per_generate": server.served / max(server.generate_calls, 1),
    }


def context_limit(engine: RolloutEngine) -> int | None:
    """The longest prompt + completion the engine generates for its policy (None: unknown)."""
    config = engine.policy_config
    return engine.max_context(config_context_length(config) if config is not None else None)
