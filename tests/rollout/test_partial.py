"""Partial rollouts (``rollout/partial.py``, ``rollout/schedule.py: PartialSchedule``) without a process or a model.

A scripted engine makes every completion's length a function of its prompt and sample (longer than the budget per
push for some), writes the weights version into its tokens and gives each token the log-prob -(version + 1) / 10,
so each test reads directly which version drew which token, what each segment decoded, what a round admitted and
what a checkpoint holds. The schedule runs against an in-process fake of the worker that runs ``run_segment`` on
what it is sent, as the background process does.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from grpo_lightning.config import AdvantageConfig, ConfigError, SamplingConfig, ScheduleConfig
from grpo_lightning.config_checks import check_partial_rollouts
from grpo_lightning.engines.base import Completions, RolloutEngine
from grpo_lightning.losses import grpo_loss
from grpo_lightning.losses.registry import available_policy_losses, get_policy_loss
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.partial import (
    PartialSettings,
    Pool,
    SegmentPlan,
    admit,
    discard_stale,
    pool_size,
    run_segment,
    run_segments,
    staleness_metrics,
)
from grpo_lightning.rollout.round import RoundSettings
from grpo_lightning.rollout.schedule import PartialSchedule
from grpo_lightning.rollout.worker import FinishedSegment

PAD, EOS, G = 0, 2, 2
# A prompt [p, 1] (p = 10, 11, ...): its G samples' lengths, EOS included (max_new_tokens 8 truncates at 8).
LENGTHS = {10: [2, 8], 11: [3, 5], 12: [1, 7], 13: [4, 4], 14: [6, 2], 15: [9, 3]}
MAX_NEW = 8


def mu(version: int) -> float:
    return -(version + 1) / 10


class ScriptedEngine(RolloutEngine):
    """Token 0 of a sample is 20 + its index in the group; later tokens 30 + the version; EOS at its length."""

    name = "scripted"
    supports_partial_rollouts = True

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        self.calls: list[tuple[int, int, int]] = []  # (rows given, group_size, max_new_tokens)

    def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False):
        self.calls.append((prompt_ids.size(0), params.group_size, params.max_new_tokens))
        rows, lengths = [], []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            context = [t for t, m in zip(ids, mask) if m]
            for j in range(params.group_size):
                done = context[2:]  # generated so far (the prompt is 2 tokens)
                sample = done[0] - 20 if done else j
                total = min(LENGTHS[context[0]][sample], MAX_NEW + 1)
                new = []
                for position in range(len(done), len(done) + params.max_new_tokens):
                    new.append(20 + sample if position == 0 else EOS if position == total - 1 else 30 + self.version)
                    if new[-1] == EOS:
                        break
                rows.append(new)
                lengths.append(len(new))
        width = max(lengths)
        ids = torch.full((len(rows), width), PAD)
        for r, new in enumerate(rows):
            ids[r, : len(new)] = torch.tensor(new)
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        logprobs = torch.where(mask.bool(), mu(self.version), 0.0) if return_logprobs else None
        return Completions(
            prompt_ids=prompt_ids.repeat_interleave(params.group_size, 0),
            prompt_mask=prompt_mask.repeat_interleave(params.group_size, 0),
            completion_ids=ids,
            completion_mask=mask,
            truncated=torch.tensor([r[-1] != EOS for r in rows]),
            logprobs=logprobs,
            policy_logprobs=logprobs,
        )


class Tokenizer:
    pad_token_id = PAD


class Encoder:
    """The prompt encoder's surface the segment uses: prompts are token-id lists already."""

    tokenizer = Tokenizer()

    def encode_rows(self, rows, device="cpu"):
        width = max(len(p) for p in rows["prompt"])
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in rows["prompt"]])
        return ids, (ids != PAD).long(), None

    def decode(self, ids, mask):
        return [" ".join(str(t) for t, m in zip(r, k) if m) for r, k in zip(ids.tolist(), mask.tolist())]


@register("partial_token_count")
def token_count(prompts, completions, **_):
    return [float(len(c.split())) for c in completions]


class Stream:
    """``prompts_per_round`` prompts per draw, 10, 11, 12, ... cycling through ``LENGTHS``."""

    def __init__(self, per_draw: int, position: int = 0) -> None:
        self.per_draw, self.position = per_draw, position

    def next_rows(self):
        ids = [10 + (self.position + i) % len(LENGTHS) for i in range(self.per_draw)]
        self.position += self.per_draw
        return {"prompt": [[p, 1] for p in ids], "answer": [str(p) for p in ids]}


def settings(n: int = 2, budget: int = 3, staleness: int = 4, stale: str = "drop", pool: int = 0) -> PartialSettings:
    """A pool of one round's groups (``pool``: another size), so each test reads one draw at a time."""
    return PartialSettings(n, G, budget, staleness, stale, pool or n)


ROUND = RoundSettings(
    sampling=SamplingConfig(group_size=G, max_new_tokens=MAX_NEW),
    advantage=AdvantageConfig(),
    optimizer_steps=1,
    rollout_lag=1,
)


def segment(pool, engine, stream, partial, index, version, waiting=0):
    engine.version = version
    return run_segment(
        pool,
        SegmentPlan(index, version, waiting, partial),
        next_rows=stream.next_rows,
        engine=engine,
        encoder=Encoder(),
        scorer=Scorer([RewardSpec("partial_token_count")]),
        settings=ROUND,
        generator=torch.Generator().manual_seed(index),
    )


# ------------------------------------------------------------------------------------------ the segments
def test_a_sequence_longer_than_the_budget_continues_under_each_new_version_with_its_own_logprobs():
    engine, stream, pool, partial = ScriptedEngine(), Stream(2), Pool(), settings(budget=3)
    assert segment(pool, engine, stream, partial, 0, version=0) is None  # prompts 10, 11: one sample each ends
    assert [len(s.tokens) for g in pool.groups for s in g.samples] == [2, 3, 3, 3]
    ready = segment(pool, engine, stream, partial, 1, version=1)  # prompt 11's second sample ends at 5 tokens
    assert ready.numbers == [1] and ready.oldest == [0] and ready.segments.tolist() == [1, 2]
    row = ready.sampled.batch.completion_ids[1].tolist()
    assert row == [21, 30, 30, 31, EOS]  # tokens 1-2 from version 0, 3-4 from version 1
    assert ready.versions[1].tolist() == [0, 0, 0, 1, 1]
    assert ready.sampled.batch.engine_logprobs[1].tolist() == pytest.approx([mu(0)] * 3 + [mu(1)] * 2)
    assert ready.sampled.batch.rewards.tolist() == [3.0, 5.0]  # scored by the round's one path
    # Segment 2 tops the pool up to a round's groups beside prompt 10 (a whole draw: 12, 13) and ends 10's longest
    # sample (8 tokens: versions 0, 0, 0, 1, 1, 1, 2, 2); 12's and 13's are longer than one budget.
    ready = segment(pool, engine, stream, partial, 2, version=2)
    assert ready.numbers == [0] and [g.number for g in pool.groups] == [2, 3]
    assert ready.versions[1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert ready.sampled.batch.engine_logprobs[1].tolist() == pytest.approx([mu(0)] * 3 + [mu(1)] * 3 + [mu(2)] * 2)
    assert not ready.sampled.batch.truncated[1]  # its EOS is its 8th token


class MuOnlyEngine(ScriptedEngine):
    """Gives the sampler's μ only, as the vLLM engines do (``Completions.policy_logprobs`` None)."""

    def generate(self, *args, **kwargs):
        return dataclasses.replace(super().generate(*args, **kwargs), policy_logprobs=None)


def test_an_engine_that_gives_mu_only_leaves_the_policy_logprobs_unknown_not_mu():
    """With top-p or an EOS ban μ is not the tempered policy: a segment must not record μ as the policy's log-probs
    (it did: ``_record`` fell back to μ), so its groups carry none, as a fixed-lag round of such an engine does."""
    engine, stream, pool, partial = MuOnlyEngine(), Stream(2), Pool(), settings(budget=3)
    segment(pool, engine, stream, partial, 0, version=0)
    ready = segment(pool, engine, stream, partial, 1, version=1)
    assert ready.sampled.batch.engine_logprobs is not None
    assert ready.sampled.batch.policy_logprobs is None
    assert all(not s.policy_logprobs for g in pool.groups for s in g.samples)


def test_a_sequence_without_eos_at_max_new_tokens_ends_truncated():
    engine, stream, pool, partial = ScriptedEngine(), Stream(6), Pool(), settings(n=6, budget=3)
    done = [segment(pool, engine, stream, partial, i, version=i) for i in range(3)]
    last = done[-1]
    row = last.numbers.index(5) * G  # prompt 15's first sample: 9 tokens wanted, 8 allowed
    assert last.sampled.batch.truncated[row] and int(last.sampled.batch.completion_mask[row].sum()) == MAX_NEW
    assert last.versions[row].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]


def test_without_a_sequence_spanning_a_push_each_segment_samples_as_a_round_does():
    engine, stream, pool, partial = ScriptedEngine(), Stream(2), Pool(), settings(budget=MAX_NEW)
    for i in range(3):
        ready = segment(pool, engine, stream, partial, i, version=i)
        assert ready.numbers == [2 * i, 2 * i + 1] and pool.groups == []
        assert (ready.versions[ready.versions >= 0] == i).all()
    assert engine.calls == [(2, G, MAX_NEW)] * 3  # one call per round: G per prompt, the whole length


def test_the_pool_tops_up_by_whole_draws_until_it_holds_a_round_beside_the_groups_waiting():
    engine, stream, pool, partial = ScriptedEngine(), Stream(2), Pool(), settings(budget=3)
    segment(pool, engine, stream, partial, 0, version=0, waiting=2)  # a round already waits: nothing drawn
    assert pool.drawn == 0 and engine.calls == []
    segment(pool, engine, stream, partial, 1, version=0, waiting=1)
    assert pool.drawn == 2 and stream.position == 2


@pytest.mark.parametrize("clock", [False, True])
def test_clock_mode_runs_segments_back_to_back_until_the_push_arrives(clock):
    from dataclasses import replace

    engine, stream, pool = ScriptedEngine(), Stream(2), Pool()
    partial = replace(settings(budget=2, pool=4), clock=clock)
    answers = iter([True, True, False])  # the push arrives during the third segment
    ready, count = run_segments(
        pool, SegmentPlan(0, 0, 0, partial), keep_going=lambda: next(answers), next_rows=stream.next_rows,
        engine=engine, encoder=Encoder(), scorer=Scorer([RewardSpec("partial_token_count")]), settings=ROUND,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert count == (3 if clock else 1)
    tokens = [len(s.tokens) for g in pool.groups for s in g.samples if not s.ended]
    assert max(tokens) == 2 * count  # every unfinished sequence decoded one budget per segment, all under version 0
    assert all(v == 0 for r in ready for v in r.versions[r.versions >= 0].tolist())


def test_clock_mode_stops_when_there_is_nothing_left_to_decode_or_draw():
    from dataclasses import replace

    engine, stream, pool = ScriptedEngine(), Stream(2), Pool()
    partial = replace(settings(budget=MAX_NEW, pool=2), clock=True)  # every sequence ends in its first segment
    ready, count = run_segments(
        pool, SegmentPlan(0, 0, 0, partial), keep_going=lambda: True, next_rows=stream.next_rows, engine=engine,
        encoder=Encoder(), scorer=Scorer([RewardSpec("partial_token_count")]), settings=ROUND,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert count == 1 and [r.numbers for r in ready] == [[0, 1]] and pool.groups == []


# ------------------------------------------------------------------------------------------- admission
def queue_of(budget: int, versions: range, n: int = 2):
    engine, stream, pool, partial = ScriptedEngine(), Stream(n), Pool(), settings(n=n, budget=budget)
    ready = [segment(pool, engine, stream, partial, v, version=v) for v in versions]
    return pool, [r for r in ready if r is not None], partial


def test_a_round_admits_the_first_n_groups_and_logs_their_ages():
    pool, queue, partial = queue_of(3, range(3))
    pool, queue, partial = queue_of(3, range(5))
    assert [r.numbers for r in queue] == [[1], [0], [3], [2]]
    sampled, versions = admit(queue, 5, partial)
    assert sampled.version == 0 and len(sampled.batch) == 2 * G
    assert [r.numbers for r in queue] == [[3], [2]]  # the rest waits
    m = sampled.metrics
    assert m["rollout/staleness_max"] == 5.0 and m["rollout/staleness_groups_4"] == 0.0
    assert m["rollout/interrupted_sequences"] == 2.0  # 11's second and 10's second sample spanned pushes
    tokens = versions[versions >= 0]
    assert m["rollout/tokens_behind_3"] == float((tokens == 2).sum()) == 2.0
    assert m["rollout/staleness_mean"] == pytest.approx((5 - tokens).float().mean().item())


@pytest.mark.parametrize("stale", ["drop", "resample"])
def test_groups_older_than_max_staleness_leave_the_queue_and_the_pool_counted(stale):
    pool, queue, _ = queue_of(3, range(4))
    partial = settings(staleness=1, stale=stale)
    before = [(g.number, g.oldest) for g in pool.groups] + [(n, o) for r in queue for n, o in zip(r.numbers, r.oldest)]
    dropped = discard_stale(pool, queue, 3, partial)  # round 3 admits groups from version 2 on
    stale_groups = [n for n, oldest in before if oldest < 2]
    assert dropped == len(stale_groups) == 2  # 11 and 10, queued; 12 and 13 started at version 2
    assert all(o >= 2 for r in queue for o in r.oldest) and all(g.oldest >= 2 for g in pool.groups)
    assert len(pool.requeued) == (dropped if stale == "resample" else 0)
    if stale == "resample":  # the next segment samples them afresh, before any new prompt
        requeued, pool.groups = [r["prompt"][0] for r in pool.requeued], []
        stream = Stream(2, position=100)
        segment(pool, ScriptedEngine(), stream, partial, 4, version=3)
        assert [g.row["prompt"][0] for g in pool.groups] == requeued[:2] and stream.position == 100


def test_staleness_metrics_name_every_age_up_to_the_bound():
    versions = torch.tensor([[3, 3, 4, -1], [4, 4, 4, 4]])
    m = staleness_metrics(5, [3, 4], versions, torch.tensor([2, 1]), max_staleness=3)
    assert m["rollout/staleness_groups_2"] == 1.0 and m["rollout/staleness_groups_1"] == 1.0
    assert m["rollout/tokens_behind_2"] == 2.0 and m["rollout/tokens_behind_1"] == 5.0
    assert m["rollout/staleness_max"] == 2.0 and m["rollout/interrupted_sequences"] == 1.0
    assert {k for k in m if "behind" in k} == {f"rollout/tokens_behind_{a}" for a in range(4)}


# ------------------------------------------------------------------------------------------- the objective
def two_version_batch():
    """A group whose second sequence's tokens come from versions 0 (3 tokens) and 1 (2), through the pool."""
    engine, stream, pool, partial = ScriptedEngine(), Stream(2), Pool(), settings(budget=3)
    segment(pool, engine, stream, partial, 0, version=0)
    return segment(pool, engine, stream, partial, 1, version=1).sampled.batch


def test_the_behaviour_weight_is_each_tokens_own_prox_over_mu_hand_computed():
    batch = two_version_batch()
    mask = batch.completion_mask.bool()
    prox = torch.full(mask.shape, -0.05)  # π_prox: the policy at the update's start
    logprobs = prox.clone().requires_grad_()
    advantages = torch.tensor([1.0, -1.0])
    loss, _ = grpo_loss(logprobs, prox, None, advantages, mask, engine_logprobs=batch.engine_logprobs, tis_cap=2.0)
    # ratio 1 (π_θ = π_prox): each token's term is -A·w, w = min(π_prox / μ, 2); μ = e^-0.1 (v0), e^-0.2 (v1).
    w = {0: min(torch.exp(torch.tensor(0.05)).item(), 2.0), 1: min(torch.exp(torch.tensor(0.15)).item(), 2.0)}
    row0 = [-1.0 * w[0]] * 3  # sample 0: 3 tokens, all version 0
    row1 = [1.0 * w[0]] * 3 + [1.0 * w[1]] * 2
    expected = (sum(row0) / 3 + sum(row1) / 5) / 2  # grpo: the mean of each sequence's token mean
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("level", "mode"), [("token", "mask"), ("sequence", "truncate"), ("sequence", "mask")])
def test_the_behaviour_weight_per_sequence_or_masked_multiplies_each_tokens_own_ratio(level, mode):
    batch = two_version_batch()
    mask = batch.completion_mask.bool()
    prox = torch.full(mask.shape, -0.05)
    advantages = torch.tensor([1.0, -1.0])
    # Per token: e^0.05 ≈ 1.05 (a version-0 token) is within 1.1, e^0.15 ≈ 1.16 (version 1) is not. Per sequence:
    # e^0.15 (3 version-0 tokens) is within 1.2, e^0.45 (3 + 2 of both versions) is not.
    cap = 1.1 if level == "token" else 1.2
    loss, _ = grpo_loss(
        prox.clone(), prox, None, advantages, mask, engine_logprobs=batch.engine_logprobs, tis_cap=cap,
        tis_level=level, tis_mode=mode,
    )  # fmt: skip
    ratios = [[0.05] * 3, [0.05] * 3 + [0.15] * 2]  # log π_prox − log μ of each token, μ its own version's
    weights = []
    for row in ratios:
        per_token = [torch.tensor(r).exp().item() for r in row]
        if level == "sequence":  # the product of the sequence's token ratios, versions mixed
            per_token = [torch.tensor(sum(row)).exp().item()] * len(row)
        outside = [w > cap or w < 1 / cap for w in per_token]
        weights.append([0.0 if o and mode == "mask" else min(w, cap) for w, o in zip(per_token, outside)])
    expected = (-sum(weights[0]) / 3 + sum(weights[1]) / 5) / 2  # -A·w per token, each sequence's mean, their mean
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_advantages_gdpo_and_the_kl_inputs_do_not_read_the_versions():
    """The trainer's half of the round (``finish_round``) of a batch whose tokens came from two versions: the
    advantages (GDPO's per-reward normalisation too) and π_ref's log-probs are those of the same batch with every
    token's μ from one version; only the behaviour weights' μ differs."""
    from grpo_lightning.rollout.round import SampledRound, finish_round

    settings = RoundSettings(
        sampling=SamplingConfig(group_size=G, max_new_tokens=MAX_NEW),
        advantage=AdvantageConfig(multi_objective_aggregation="normalize_then_sum"),
        optimizer_steps=1,
        rollout_lag=1,
    )
    ref = {}

    def passes(batch, *, old, ref):  # π_ref of the tokens: a function of the tokens only
        return None, batch.completion_ids.float() / -100

    mixed = two_version_batch()
    one = two_version_batch()
    one.engine_logprobs = torch.where(one.completion_mask.bool(), mu(0), 0.0)
    for name, batch in (("mixed", mixed), ("one", one)):
        ref[name] = finish_round(SampledRound(batch), logprobs=passes, settings=settings)
    assert torch.equal(ref["mixed"].advantages, ref["one"].advantages)
    assert torch.equal(ref["mixed"].ref_logprobs, ref["one"].ref_logprobs)
    assert not torch.equal(ref["mixed"].engine_logprobs, ref["one"].engine_logprobs)


@pytest.mark.parametrize("loss_type", available_policy_losses())
def test_every_loss_reads_each_tokens_own_mu(loss_type):
    batch = two_version_batch()
    mask = batch.completion_mask.bool()
    torch.manual_seed(0)
    logprobs = (torch.full(mask.shape, -0.3) + 0.05 * torch.randn(mask.shape)).requires_grad_()
    old = torch.full(mask.shape, -0.25)
    advantages = torch.tensor([1.0, -1.0])
    mixed = batch.engine_logprobs
    by_hand = torch.tensor([[mu(0)] * 3 + [0.0] * 2, [mu(0)] * 3 + [mu(1)] * 2])
    assert torch.equal(mixed, by_hand)

    def loss(engine_logprobs):
        kwargs = {"max_completion_length": MAX_NEW} if get_policy_loss(loss_type).aggregation == "constant" else {}
        kwargs.update(loss_type=loss_type, engine_logprobs=engine_logprobs, tis_cap=10.0)
        value, _ = grpo_loss(logprobs, old, None, advantages, mask, **kwargs)
        return value

    one_version = torch.where(mask, mu(0), 0.0)  # as if the whole sequence came from version 0
    assert torch.isfinite(loss(mixed))
    assert not torch.equal(loss(mixed), loss(one_version))  # the version-1 tokens' own μ changes the loss


# ------------------------------------------------------------------------------------- the schedule
class FakeWorker:
    """``RolloutWorker``'s surface, in this process: ``run_segment`` on what it is sent, from the pushed version."""

    def __init__(self, position, n):
        self.engine, self.stream, self.version = ScriptedEngine(), Stream(n, position or 0), None
        self.interrupted = 0
        self.results: list[FinishedSegment] = []

    def push(self, weights, version):
        self.version = version

    def submit_segment(self, plan, pool):
        assert plan.version == self.version
        import copy

        pool = copy.deepcopy(pool)  # sent to another process: a copy
        ready = segment(pool, self.engine, self.stream, plan.settings, plan.index, self.version, plan.waiting)
        self.results.append(FinishedSegment(plan.index, pool, [ready] if ready else [], self.stream.position))

    def collect(self):
        return self.results.pop(0)

    def interrupt(self):
        self.interrupted += 1

    def close(self):
        pass


def train(schedule: PartialSchedule, rounds: range, n: int) -> dict[int, tuple]:
    out = {}
    for k in rounds:
        sampled = schedule.take(k, start_worker=lambda p: FakeWorker(p, n), weights=lambda: {})
        b = sampled.batch
        out[k] = (b.completion_ids.tolist(), b.engine_logprobs.tolist(), b.rewards.tolist(), dict(sampled.metrics))
    return out


def through_a_checkpoint_file(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


@pytest.mark.parametrize("stale", ["drop", "resample"])
def test_three_rounds_then_three_more_from_a_checkpoint_equal_six_with_sequences_in_flight(stale):
    partial = settings(n=2, budget=3, staleness=3, stale=stale)
    uninterrupted = train(PartialSchedule(partial), range(6), 2)
    first = PartialSchedule(partial)
    trained = train(first, range(3), 2)
    state = through_a_checkpoint_file(first.state_dict())
    assert state["pool"]["groups"] and any(s["tokens"] for g in state["pool"]["groups"] for s in g["samples"])
    resumed = PartialSchedule(partial)
    resumed.load_state_dict(state)
    trained.update(train(resumed, range(3, 6), 2))
    assert trained == uninterrupted
    assert any(m["rollout/interrupted_sequences"] for *_, m in uninterrupted.values())


def test_a_pool_of_as_many_rounds_as_pushes_a_longest_sequence_spans_keeps_the_trainer_from_waiting():
    budget = 3
    rounds = {
        pool: train(PartialSchedule(settings(n=2, budget=budget, pool=pool)), range(8), 2)
        for pool in (2, pool_size(2, MAX_NEW, budget))
    }
    waits = {pool: [m["rollout/segments_waited"] for *_, m in r.values()] for pool, r in rounds.items()}
    assert pool_size(2, MAX_NEW, budget) == 6
    assert sum(waits[6][2:]) < sum(waits[2][2:]), waits


def test_the_schedule_waits_for_further_segments_when_fewer_than_a_round_are_ready():
    metrics = train(PartialSchedule(settings(n=2, budget=2)), range(2), 2)
    assert metrics[0][3]["rollout/segments_waited"] >= 2  # round 0: segments until two groups ended


def test_in_clock_mode_the_schedule_interrupts_the_worker_before_each_wait_for_its_segments():
    from dataclasses import replace

    schedule = PartialSchedule(replace(settings(n=2, budget=3, pool=6), clock=True))
    train(schedule, range(3), 2)
    collected = schedule.segment - len(schedule.pending)  # every segment collected was waited for once
    assert schedule.worker.interrupted == collected >= 3
    tokens = PartialSchedule(settings(n=2, budget=3, pool=6))
    train(tokens, range(3), 2)
    assert tokens.worker.interrupted == 0  # a segment of tokens ends by itself


# ---------------------------------------------------------------------------------------------- refused
class NoPartials(RolloutEngine):
    name = "vllm"

    def generate(self, *args, **kwargs): ...


@pytest.mark.parametrize(
    "schedule,engine,environment,sampling,message",
    [
        ({"rollout_lag": 0}, ScriptedEngine(), None, {}, r"^data.schedule.partial_rollouts .*rollout_lag: 1"),
        ({"rollout_lag": 2}, ScriptedEngine(), None, {}, r"rollout_lag: 1 \(got 2"),
        ({}, NoPartials(), None, {}, r"^data.engine vllm cannot continue .* partial_rollouts"),
        (
            {},
            ScriptedEngine(),
            "agent",
            {},
            r"^data.environment AgentEnvironment does not combine with data.schedule.partial_rollouts: an agent's "
            r"program .* use partial_rollouts: false",
        ),
        (
            {},
            ScriptedEngine(),
            None,
            {"dynamic_sampling": True},
            r"^data.sampling.dynamic_sampling .*partial_rollouts",
        ),
        ({"tokens_per_push": 2}, ScriptedEngine(), None, {}, r"^data.schedule.max_staleness 4 is below the 32"),
    ],
)
def test_what_partial_rollouts_cannot_take_is_refused_in_one_line(schedule, engine, environment, sampling, message):
    config = ScheduleConfig(**{"rollout_lag": 1, "partial_rollouts": True, **schedule})
    if environment == "agent":  # its program's loop cannot be paused at a push: refused, saying why and the fix
        from grpo_lightning.integrations.agents import AgentEnvironment

        environment = AgentEnvironment(agent=lambda *_: None)
    with pytest.raises(ConfigError, match=message):
        check_partial_rollouts(
            config, sampling=SamplingConfig(max_new_tokens=64, **sampling), engine=engine, environment=environment
        )


def test_the_default_budget_is_a_quarter_of_max_new_tokens_within_the_default_staleness():
    assert ScheduleConfig().segment_tokens(64) == 16 and ScheduleConfig().segment_tokens(7) == 2
    check_partial_rollouts(
        ScheduleConfig(rollout_lag=1, partial_rollouts=True),
        sampling=SamplingConfig(max_new_tokens=7),
        engine=ScriptedEngine(),
        environment=None,
    )


def test_the_runs_settings_keep_as_many_rounds_in_flight_as_pushes_a_longest_sequence_spans():
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=3, interrupt="clock")
    partial = PartialSettings.of(schedule, SamplingConfig(group_size=G, max_new_tokens=MAX_NEW), 5)
    assert (partial.tokens_per_push, partial.pool_groups, partial.clock) == (3, 15, True)
    default = PartialSettings.of(ScheduleConfig(), SamplingConfig(max_new_tokens=64), 5)
    assert (default.tokens_per_push, default.pool_groups, default.clock) == (16, 20, False)
    covering = PartialSettings.of(ScheduleConfig(tokens_per_push=64), SamplingConfig(max_new_tokens=64), 5)
    assert covering.pool_groups == 5  # no sequence spans a push: one round in flight, as at lag 1


def test_a_checkpoint_of_the_other_schedule_is_taken_with_a_warning_from_its_stream_position(caplog):
    from grpo_lightning.rollout.schedule import RolloutSchedule

    partial = PartialSchedule(settings())
    train(partial, range(2), 2)
    state = through_a_checkpoint_file(partial.state_dict())
    lag = RolloutSchedule(1)
    with caplog.at_level("WARNING"):
        lag.load_state_dict(state)
        fresh = PartialSchedule(settings())
        fresh.load_state_dict({"lag": 1, "ready": {}, "next_launch": 3, "position": 6})
    assert "the checkpoint's rollouts were partial" in caplog.text and "sampled at a fixed lag" in caplog.text
    assert lag.position == state["position"] and lag.ready == {}
    assert fresh.position == 6 and fresh.pool.groups == [] and fresh.queue == []
