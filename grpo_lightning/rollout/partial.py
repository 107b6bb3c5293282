"""Partial rollouts (``data.schedule.partial_rollouts``): sequences that continue across weight pushes, and groups
admitted into a round by their age. Reproducible: sequences are interrupted by a token budget, never by the clock.

The background process keeps a *pool* of groups in flight. After the push of weights version v it runs exactly one
*segment* (``run_segment``), from the segment's own seed:

1. top-up: while the groups in flight plus the finished groups waiting for the trainer are fewer than
   N × ⌈max_new_tokens / tokens_per_push⌉ (N = ``prompts_per_round``; ``pool_size``), a whole draw of N prompts
   joins the pool (the rows of groups sent back as stale first, with ``stale_groups: resample``). A longest
   sequence needs that many pushes: with fewer groups in flight a round of long ones would make the trainer wait;
   with more, groups would wait longer in the queue (and grow staler) for nothing;
2. decode: every unfinished sequence decodes at most ``tokens_per_push`` more tokens under v, continuing from its
   prompt + its tokens so far (the engine prefills that prefix again on v: the "cache recomputed" of AReaL; nothing
   is kept between segments, so a resumed run equals an uninterrupted one). Each token records its behaviour
   log-prob μ and v. Sequences that need the same call (the same length budget and EOS ban) decode in one
   ``generate``, the fresh groups in a call of their own, sampled as a round samples them (one prefill per prompt,
   and no padding to the longer contexts of the continued sequences);
3. score: the groups whose G sequences have all ended (EOS, or ``max_new_tokens`` in all) are scored by the round's
   one path (``score_completions``) and queued, in pool order.

The trainer's round k then admits the first ``prompts_per_round`` queued groups whose oldest token was drawn by
version k − η or later (``max_staleness`` η); older groups, queued or still in flight, are dropped or resampled
(``stale_groups``), counted (``admit``, ``discard_stale``). With ``tokens_per_push`` ≥ ``max_new_tokens`` no
sequence spans a push, and the run samples and trains exactly what ``rollout_lag: 1`` does.

A multi-turn kind (``data.environment``: an ``Environment``) decodes and scores its own trajectories in step 2 and 3
(``RolloutKind.decode_segment``, ``score_segment``: ``integrations/environments/partial_turns.py``): the budget
counts model tokens, observations carry no version (-1), a turn that ends is stepped in the background and its
observation joins in the next segment (``settle_segment``, the segment's first act, waits for those steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.config import SamplingConfig, ScheduleConfig, pushes_per_sequence
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.engines.continuation import real_tokens
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, SampledRound
from grpo_lightning.rollout.sample_and_score import rollout_kind, score_completions


@dataclass
class PartialSettings:
    """What the schedule of partial rollouts needs (from ``data.schedule`` and ``data.sampling``)."""

    groups_per_round: int
    """N: the groups a round trains on (``prompts_per_round``), and the pool's top-up target."""
    group_size: int
    tokens_per_push: int
    """The most tokens a sequence decodes under one weights version (``ScheduleConfig.segment_tokens``)."""
    max_staleness: int
    stale_groups: str
    pool_groups: int
    """The groups kept in flight or waiting: a segment draws (whole draws of N) while there are fewer; the run's is
    ``pool_size``'s, N when no sequence can span a push (then the segments are exactly the fixed lag's rounds)."""
    clock: bool = False
    """``interrupt: clock``: the background process runs segments back to back until the next push arrives
    (``run_segments``); not reproducible."""

    @classmethod
    def of(cls, schedule: ScheduleConfig, sampling: SamplingConfig, groups_per_round: int) -> PartialSettings:
        """The settings of ``data.schedule`` and ``data.sampling`` for ``groups_per_round`` prompts a round."""
        budget = schedule.segment_tokens(sampling.max_new_tokens)
        return cls(
            groups_per_round=groups_per_round,
            group_size=sampling.group_size,
            tokens_per_push=budget,
            max_staleness=schedule.max_staleness,
            stale_groups=schedule.stale_groups,
            pool_groups=pool_size(groups_per_round, sampling.max_new_tokens, budget),
            clock=schedule.interrupt == "clock",
        )


def pool_size(groups_per_round: int, max_new_tokens: int, tokens_per_push: int) -> int:
    """The groups a pool keeps in flight or waiting (``PartialSettings.pool_groups``): N × the pushes a longest
    sequence spans."""
    return groups_per_round * pushes_per_sequence(max_new_tokens, tokens_per_push)


@dataclass
class Sample:
    """One sequence of a group, as far as it is decoded: every token with its μ (``logprobs``), the tempered policy's
    log-prob of the version that drew it (``policy_logprobs``) and that version."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    """Segments it was decoded in (more than one: it spanned a push, "interrupted")."""
    ended: bool = False
    truncated: bool = False
    stepping: bool = False
    """Its turn ended and the environment's step runs in the background: not ended (``rollout/environment_steps``)."""
    state: dict[str, Any] = field(default_factory=dict)
    """A multi-turn kind's own record of it, plain data (``RolloutKind.decode_segment``; observations' version -1)."""


@dataclass
class Group:
    """A prompt's G samples in flight: ``number`` (the order groups were drawn), its row of the training data and
    its prompt's token ids."""

    number: int
    row: dict[str, Any]
    prompt: list[int]
    samples: list[Sample]

    @property
    def done(self) -> bool:
        return all(s.ended for s in self.samples)

    @property
    def oldest(self) -> int | None:
        """The version of its oldest model token (None before its first segment; observations have none: -1)."""
        return min((v for s in self.samples for v in s.versions if v >= 0), default=None)


@dataclass
class Pool:
    """What is in flight: the unfinished groups (in draw order), the rows to sample afresh, the groups drawn so far.
    Sent with each segment and returned after it; a checkpoint holds it (``plain``, ``pool_from_plain``)."""

    groups: list[Group] = field(default_factory=list)
    requeued: list[dict[str, Any]] = field(default_factory=list)
    drawn: int = 0


def pool_from_plain(plain: dict[str, Any]) -> Pool:
    """A ``Pool`` from ``asdict(pool)`` (what a checkpoint holds)."""
    groups = [
        Group(g["number"], dict(g["row"]), list(g["prompt"]), [Sample(**s) for s in g["samples"]])
        for g in plain.get("groups", [])
    ]
    return Pool(groups, [dict(r) for r in plain.get("requeued", [])], int(plain.get("drawn", 0)))


@dataclass
class ReadyGroups:
    """Scored groups waiting for a round: the rows (G per group, adjacent), each group's number, oldest version and
    row of the training data, each completion token's version (``versions`` ``[rows, T]``, -1 on padding), each
    row's segments, and the pad id their tensors are padded with."""

    sampled: SampledRound
    numbers: list[int]
    oldest: list[int]
    rows: list[dict[str, Any]]
    versions: Tensor
    segments: Tensor
    pad_token_id: int

    def take(self, groups: list[int], group_size: int) -> ReadyGroups:
        """The groups at positions ``groups`` (in order)."""
        rows = torch.tensor([g * group_size + i for g in groups for i in range(group_size)], dtype=torch.long)
        whole = len(groups) == len(self.numbers)  # every group, in order: the very same batch
        batch = self.sampled.batch if whole else self.sampled.batch.select(rows)
        sampled = SampledRound(batch, len(rows), 1, dict(self.sampled.timings), min(self.oldest[g] for g in groups))
        return ReadyGroups(
            sampled,
            [self.numbers[g] for g in groups],
            [self.oldest[g] for g in groups],
            [self.rows[g] for g in groups],
            self.versions[rows],
            self.segments[rows],
            self.pad_token_id,
        )


# ------------------------------------------------------------------------------------ the background side
@dataclass
class SegmentPlan:
    """One segment's request: its index (its seed), the version it decodes under, the groups already waiting."""

    index: int
    version: int
    waiting: int
    settings: PartialSettings


def run_segment(
    pool: Pool,
    plan: SegmentPlan,
    *,
    next_rows: Callable[[], dict[str, list[Any]]],
    engine: RolloutEngine,
    encoder: PromptEncoder,
    scorer: Scorer,
    settings: RoundSettings,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    held: dict[Any, Any] | None = None,
    counters: dict[str, float] | None = None,
) -> ReadyGroups | None:
    """One segment (the module docstring): top up ``pool``, decode every unfinished sequence up to the budget under
    ``plan.version``, score and return the groups that ended (None: none did). ``pool`` is updated in place.
    ``held``: a multi-turn kind's live environments between segments (None: none kept); ``counters``: where its
    seconds are added, whether it ended groups or not (``generate``, ``score``, ...; ``environment_wait``: waiting,
    first, for the steps of a multi-turn kind's last segment)."""
    kind, held = rollout_kind(settings.environment), {} if held is None else held
    waited = kind.settle_segment(held)  # first: nothing of the last segment runs beside this one
    timings: dict[str, float] = {"environment_wait": waited} if kind.multi_turn else {}
    params = SamplingParams.from_config(settings.sampling)
    partial, pad = plan.settings, encoder.tokenizer.pad_token_id
    while len(pool.groups) + plan.waiting < partial.pool_groups:  # 1. top-up, by whole draws
        rows = pool.requeued[: partial.groups_per_round] or None
        pool.requeued = pool.requeued[len(rows or []) :]
        columns = next_rows() if rows is None else {k: [r[k] for r in rows] for k in rows[0]}
        prompt_ids, prompt_mask, _ = encoder.encode_rows(columns, device)
        for i, prompt in enumerate(real_tokens(prompt_ids, prompt_mask)):
            row = {k: v[i] for k, v in columns.items()}
            samples = [Sample() for _ in range(partial.group_size)]
            pool.groups.append(Group(pool.drawn, row, prompt, samples))
            pool.drawn += 1
    start = time.perf_counter()  # 2. decode: fresh groups in one call, continued sequences in one per budget
    if kind.multi_turn:
        timings["environment"] = kind.decode_segment(
            pool.groups, engine=engine, encoder=encoder, params=params, budget=partial.tokens_per_push,
            version=plan.version, generator=generator, return_logprobs=settings.engine_logprobs, device=device,
            held=held,
        )  # fmt: skip
    else:
        _decode(pool.groups, plan, params, engine, pad, generator, settings.engine_logprobs, device)
    timings["generate"] = time.perf_counter() - start
    finished = [g for g in pool.groups if g.done]  # 3. score the groups that ended, in pool order
    pool.groups = [g for g in pool.groups if not g.done]
    ready = None
    if finished:
        batch = (
            kind.score_segment(
                finished, encoder=encoder, scorer=scorer, params=params, device=device, held=held, timings=timings
            )
            if kind.multi_turn
            else _scored(finished, params, encoder, scorer, pad, device, timings)
        )
        ready = _ready(finished, batch, pad, timings, plan.version)
    for phase, seconds in timings.items() if counters is not None else ():
        counters[phase] = counters.get(phase, 0.0) + seconds
    return ready


def _decode(
    groups: list[Group],
    plan: SegmentPlan,
    params: SamplingParams,
    engine: RolloutEngine,
    pad: int,
    generator: torch.Generator,
    logprobs: bool,
    device: torch.device | str,
) -> None:
    """Single-turn sampling's step 2: the fresh groups in one call, the continued sequences in one per budget."""
    partial = plan.settings
    calls: dict[tuple[bool, int, int], list[tuple[Group, Sample]]] = {}
    for group in groups:
        for sample in group.samples:
            if not sample.ended:
                done = len(sample.tokens)
                budget = min(partial.tokens_per_push, params.max_new_tokens - done)
                key = (done > 0, budget, max(0, params.min_new_tokens - done))
                calls.setdefault(key, []).append((group, sample))
    for (_, budget, min_new), entries in sorted(calls.items(), key=lambda item: item[0]):
        call = params.with_(max_new_tokens=budget, min_new_tokens=min_new)
        out = _generate(engine, entries, call, partial.group_size, pad, generator, logprobs, device)
        for i, (_, sample) in enumerate(entries):
            _record(sample, out, i, plan.version, params.max_new_tokens)


def run_segments(
    pool: Pool, plan: SegmentPlan, *, keep_going: Callable[[], bool], **segment: Any
) -> tuple[list[ReadyGroups], int]:
    """``run_segment`` once, then (``interrupt: clock``) again under the same version, each from the next index's
    seed, while ``keep_going()`` (no push has arrived) and the pool has something to decode or draw. Returns the
    groups that ended, one entry per segment that ended some, and the segments run."""
    ready, count = [], 0
    while True:
        step = replace(plan, index=plan.index + count, waiting=plan.waiting + sum(len(r.numbers) for r in ready))
        ended = run_segment(pool, step, **segment)
        count += 1
        ready += [ended] if ended is not None else []
        waiting = step.waiting + (len(ended.numbers) if ended is not None else 0)
        idle = not pool.groups and waiting >= plan.settings.pool_groups  # nothing to decode, nothing to draw
        if not plan.settings.clock or idle or not keep_going():
            return ready, count


def _generate(
    engine: RolloutEngine,
    entries: list[tuple[Group, Sample]],
    params: SamplingParams,
    group_size: int,
    pad: int,
    generator: torch.Generator,
    logprobs: bool,
    device: torch.device | str,
) -> Completions:
    """One ``generate`` for ``entries``: whole fresh groups are sampled as a round samples them (G per prompt, one
    prefill each: the same draws as ``rollout_lag: 1``); otherwise each sequence continues from its prompt + its
    tokens so far, one row each (its prefix prefilled on the weights the engine holds now)."""
    groups = _fresh_groups(entries, group_size)
    contexts = [g.prompt for g in groups] if groups else [g.prompt + s.tokens for g, s in entries]
    ids, mask = left_padded(contexts, pad, device)
    call = params if groups else params.with_(group_size=1)
    return engine.generate(ids, mask, call, generator=generator, return_logprobs=logprobs)


def _fresh_groups(entries: list[tuple[Group, Sample]], group_size: int) -> list[Group] | None:
    """The groups of ``entries`` when they are whole groups, in order, none decoded yet; else None."""
    groups = [g for g, _ in entries[::group_size]]
    expected = [(g, s) for g in groups for s in g.samples]
    whole = len(expected) == len(entries) and all(a is c and b is d for (a, b), (c, d) in zip(expected, entries))
    return groups if whole and not any(s.tokens for _, s in entries) else None


def _record(sample: Sample, out: Completions, row: int, version: int, max_new_tokens: int) -> None:
    n = int(out.completion_mask[row].sum())
    sample.tokens += out.completion_ids[row, :n].tolist()
    if out.logprobs is not None:
        sample.logprobs += out.logprobs[row, :n].tolist()
    if out.policy_logprobs is not None:  # none from an engine that cannot give them (vLLM): μ is not π, none kept
        sample.policy_logprobs += out.policy_logprobs[row, :n].tolist()
    sample.versions += [version] * n
    sample.segments += 1
    at_limit = len(sample.tokens) >= max_new_tokens
    sample.ended = not bool(out.truncated[row]) or at_limit
    sample.truncated = bool(out.truncated[row]) and at_limit


def left_padded(contexts: list[list[int]], pad: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """Token lists as left-padded ``(ids, mask)`` ``[B, P]``, as the tokenizer pads prompts."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, context in enumerate(contexts):
        if context:
            ids[i, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[i, width - len(context) :] = 1
    return ids.to(device), mask.to(device)


def _right_padded(values: list[list[Any]], fill: Any, dtype: torch.dtype) -> Tensor:
    width = max(len(v) for v in values)
    out = torch.full((len(values), width), fill, dtype=dtype)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(v, dtype=dtype)
    return out


def _scored(
    groups: list[Group],
    params: SamplingParams,
    encoder: PromptEncoder,
    scorer: Scorer,
    pad: int,
    device: torch.device | str,
    timings: dict[str, float],
) -> RolloutBatch:
    """The ended ``groups`` as sampled completions, scored by the round's one path (``score_completions``)."""
    samples = [s for g in groups for s in g.samples]
    group_size = len(groups[0].samples)
    prompt_ids, prompt_mask = left_padded([g.prompt for g in groups], pad, device)
    completion_ids = _right_padded([s.tokens for s in samples], pad, torch.long).to(device)
    mask = _right_padded([[1] * len(s.tokens) for s in samples], 0, torch.long).to(device)
    logged = all(len(s.logprobs) == len(s.tokens) for s in samples)
    policy = all(len(s.policy_logprobs) == len(s.tokens) for s in samples)  # every token's, from every segment
    completions = Completions(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=completion_ids,
        completion_mask=mask,
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool, device=device),
        logprobs=_right_padded([s.logprobs for s in samples], 0.0, torch.float32).to(device) if logged else None,
        policy_logprobs=(
            _right_padded([s.policy_logprobs for s in samples], 0.0, torch.float32).to(device) if policy else None
        ),
    )
    rows = {k: [g.row[k] for g in groups] for k in groups[0].row}
    texts = encoder.decode(completions.completion_ids, completions.completion_mask)
    return score_completions(rows, completions, texts, encoder=encoder, scorer=scorer, params=params, timings=timings)


def _ready(groups: list[Group], batch: RolloutBatch, pad: int, timings: dict[str, float], version: int) -> ReadyGroups:
    """The ended ``groups``, scored into ``batch``, with each token's version (-1: padding, observations) and each
    sequence's segments. A group without a model token counts as drawn by ``version`` (the segment's)."""
    samples = [s for g in groups for s in g.samples]
    oldest = [version if g.oldest is None else g.oldest for g in groups]
    sampled = SampledRound(batch.to("cpu"), len(batch), 1, timings, min(oldest))
    return ReadyGroups(
        sampled,
        [g.number for g in groups],
        oldest,
        [g.row for g in groups],
        _right_padded([s.versions for s in samples], -1, torch.long),
        torch.tensor([s.segments for s in samples], dtype=torch.long),
        pad,
    )


# -------------------------------------------------------------------------------------- the trainer's side
def discard_stale(pool: Pool, queue: list[ReadyGroups], round_index: int, settings: PartialSettings) -> int:
    """Take out of ``pool`` and ``queue``, in place, every group whose oldest token is older than version
    ``round_index`` − η: too stale for this round and every later one. With ``resample`` its row goes back to be
    sampled afresh (first in the next top-up). Returns how many groups left."""
    floor = round_index - settings.max_staleness
    stale = [g for g in pool.groups if g.oldest is not None and g.oldest < floor]
    pool.groups = [g for g in pool.groups if g.oldest is None or g.oldest >= floor]
    rows = [g.row for g in stale]
    kept: list[ReadyGroups] = []
    for ready in queue:
        fresh = [j for j, oldest in enumerate(ready.oldest) if oldest >= floor]
        rows += [ready.rows[j] for j, oldest in enumerate(ready.oldest) if oldest < floor]
        if fresh:
            kept.append(ready if len(fresh) == len(ready.oldest) else ready.take(fresh, settings.group_size))
    queue[:] = kept
    if settings.stale_groups == "resample":
        pool.requeued += rows
    return len(rows)


def queued_groups(queue: list[ReadyGroups]) -> int:
    """The groups waiting in ``queue``."""
    return sum(len(ready.numbers) for ready in queue)


def admit(queue: list[ReadyGroups], round_index: int, settings: PartialSettings) -> tuple[SampledRound, Tensor]:
    """Round ``round_index``'s rollout: the first N queued groups (taken out of ``queue``, which holds at least N,
    every one admissible after ``discard_stale``), with its staleness metrics; and each row's token versions."""
    parts, need = [], settings.groups_per_round
    while need:
        ready = queue[0]
        count = min(need, len(ready.numbers))
        parts.append(ready.take(list(range(count)), settings.group_size))
        rest = list(range(count, len(ready.numbers)))
        queue[:1] = [ready.take(rest, settings.group_size)] if rest else []
        need -= count
    pad = parts[0].pad_token_id
    batch = RolloutBatch.concat([p.sampled.batch for p in parts], pad)
    width = max(p.versions.size(1) for p in parts)
    versions = torch.cat(
        [torch.nn.functional.pad(p.versions, (0, width - p.versions.size(1)), value=-1) for p in parts]
    )
    segments = torch.cat([p.segments for p in parts])
    oldest = [v for p in parts for v in p.oldest]
    sampled = SampledRound(batch, len(batch), 1, {}, min(oldest))
    sampled.metrics = staleness_metrics(round_index, oldest, versions, segments, settings.max_staleness)
    return sampled, versions


def staleness_metrics(
    round_index: int, oldest: list[int], versions: Tensor, segments: Tensor, max_staleness: int
) -> dict[str, float]:
    """A round's ages: per group (its oldest token) and per token, as counts for each age 0 … η (a fixed set of
    names, so every round logs the same ones), their mean and max; and the sequences that spanned a push."""
    tokens = round_index - versions[versions >= 0]
    groups = torch.tensor([round_index - v for v in oldest])
    metrics = {
        "rollout/staleness_mean": tokens.float().mean().item(),
        "rollout/staleness_max": float(groups.max()),
        "rollout/interrupted_sequences": float((segments > 1).sum()),
    }
    for age in range(max_staleness + 1):
        metrics[f"rollout/staleness_groups_{age}"] = float((groups == age).sum())
        metrics[f"rollout/tokens_behind_{age}"] = float((tokens == age).sum())
    return metrics


def plain_ready(ready: ReadyGroups, plain_sampled: Callable[[SampledRound], dict[str, Any]]) -> dict[str, Any]:
    """``ready`` as plain data for a checkpoint; ``plain_sampled`` writes its rows (``schedule._plain``)."""
    return {**vars(ready), "sampled": plain_sampled(ready.sampled)}  # every field; the rows as plain data


def ready_from_plain(plain: dict[str, Any], sampled: Callable[[dict[str, Any]], SampledRound]) -> ReadyGroups:
    """``plain_ready``'s inverse; ``sampled`` reads its rows (``schedule._sampled``)."""
    return ReadyGroups(
        sampled(plain["sampled"]),
        list(plain["numbers"]),
        list(plain["oldest"]),
        [dict(r) for r in plain["rows"]],
        plain["versions"],
        plain["segments"],
        int(plain["pad_token_id"]),
    )


def plain_pool(pool: Pool) -> dict[str, Any]:
    """``pool`` as plain data (``pool_from_plain`` reads it back)."""
    return asdict(pool)
