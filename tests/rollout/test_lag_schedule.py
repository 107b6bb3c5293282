"""``RolloutSchedule`` on its own (drain → push → launch → take), against an in-process fake of the rollout worker.

The background process only samples what it is given, in order; which round is sampled from which weights is the
schedule's doing. The fake samples a round when it is submitted, from the weights pushed last (what the real worker
does with its requests, in order), and records it, so each test reads the schedule's decisions directly: the
weights version each round trains on, what was launched when, what was in flight, what a checkpoint holds and how a
resumed run continues. No process, no model.
"""

from __future__ import annotations

import io

import pytest
import torch

from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.round import SampledRound
from grpo_lightning.rollout.schedule import RolloutSchedule
from grpo_lightning.rollout.worker import Finished

PROMPTS = 2  # prompts a round takes from the stream


class FakeWorker:
    """``RolloutWorker``'s surface (``push``, ``submit``, ``collect``, ``close``), in this process.

    ``submitted``: (round, weights version current when it was submitted) in submission order; ``in_flight``: the
    rounds submitted and not collected; ``peak``: the most ever in flight at once. A round's rollout says where it
    came from: its ``version``, and as prompts the stream positions it took (the stream starts at ``position``).
    """

    def __init__(self, position: int | None) -> None:
        self.started_at = position
        self.position = position or 0
        self.version: int | None = None
        self.submitted: list[tuple[int, int]] = []
        self.in_flight: list[Finished] = []
        self.peak = 0
        self.closed = False

    def push(self, weights: dict[str, torch.Tensor], version: int) -> None:
        assert int(weights["version"]) == version, "the schedule pushes the weights of the round it names"
        self.version = version

    def submit(self, round_index: int) -> None:
        assert self.version is not None, "a round submitted before any weights"
        self.submitted.append((round_index, self.version))
        prompts = torch.arange(self.position, self.position + PROMPTS).unsqueeze(1)
        self.position += PROMPTS
        self.in_flight.append(Finished(round_index, rollout(prompts, self.version), self.position))
        self.peak = max(self.peak, len(self.in_flight))

    def collect(self) -> Finished:
        return self.in_flight.pop(0)

    def close(self) -> None:
        self.closed = True


def rollout(prompts: torch.Tensor, version: int) -> SampledRound:
    empty = torch.zeros(len(prompts), 0, dtype=torch.long)
    batch = RolloutBatch(
        prompt_ids=prompts,
        prompt_mask=torch.ones_like(prompts),
        completion_ids=empty,
        completion_mask=empty,
        truncated=torch.zeros(len(prompts), dtype=torch.bool),
        rewards=torch.full((len(prompts),), float(version)),
    )
    return SampledRound(batch=batch, version=version)


class Run:
    """A training loop's side of the schedule: round k takes its rollout with the policy at version k (trained for
    k rounds); it records what each round trained on (version, prompts) and every worker it started."""

    def __init__(self, lag: int) -> None:
        self.schedule = RolloutSchedule(lag)
        self.workers: list[FakeWorker] = []
        self.trained: dict[int, tuple[int, list[int]]] = {}

    def start(self, position: int | None) -> FakeWorker:
        self.workers.append(FakeWorker(position))
        return self.workers[-1]

    def train(self, rounds: range) -> None:
        for k in rounds:
            sampled = self.schedule.take(k, start_worker=self.start, weights=lambda k=k: {"version": torch.tensor(k)})
            self.trained[k] = (sampled.version, sampled.batch.prompt_ids.flatten().tolist())

    @property
    def worker(self) -> FakeWorker:
        return self.workers[-1]


def versions(run: Run) -> list[int]:
    return [run.trained[k][0] for k in sorted(run.trained)]


def through_a_checkpoint_file(state: dict) -> dict:
    """``state`` saved and loaded as a checkpoint is (``torch.load(weights_only=True)``)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


# ------------------------------------------------------------------------------------------------ the lag
@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_round_k_trains_on_the_rollout_sampled_from_version_k_minus_lag(lag: int) -> None:
    run = Run(lag)
    run.train(range(8))
    assert versions(run) == [max(0, k - lag) for k in range(8)]
    # Each round sampled once, in order, from its own version; the stream read once, in order.
    assert run.worker.submitted == [(j, max(0, j - lag)) for j in range(8 + lag)]
    assert [run.trained[k][1] for k in range(8)] == [[PROMPTS * k, PROMPTS * k + 1] for k in range(8)]
    assert len(run.workers) == 1


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_round_0_launches_rounds_0_to_lag_from_the_first_weights(lag: int) -> None:
    run = Run(lag)
    run.train(range(1))
    assert run.worker.submitted == [(j, 0) for j in range(lag + 1)]
    assert run.schedule.pending == list(range(1, lag + 1)) and run.schedule.ready == {}
    assert run.schedule.next_launch == lag + 1
    assert [r.round for r in run.worker.in_flight] == run.schedule.pending


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_after_round_0_only_the_newest_round_is_in_flight(lag: int) -> None:
    run = Run(lag)
    run.train(range(1))
    for k in range(1, 6):
        run.train(range(k, k + 1))
        # Round k's take drained rounds k … k + L − 1 and launched round k + L only.
        assert run.schedule.pending == [k + lag] and [r.round for r in run.worker.in_flight] == [k + lag]
        assert sorted(run.schedule.ready) == list(range(k + 1, k + lag))
    assert run.worker.peak == lag + 1  # at round 0: rounds 0 … L


def test_at_lag_0_nothing_is_left_in_flight() -> None:
    run = Run(0)
    for k in range(4):
        run.train(range(k, k + 1))
        assert run.schedule.pending == [] and run.worker.in_flight == [] and run.schedule.ready == {}
    assert run.worker.peak == 1


# -------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("lag", [1, 2])
def test_a_checkpoint_drains_first_and_holds_the_rounds_sampled_ahead(lag: int) -> None:
    run = Run(lag)
    run.train(range(3))
    assert run.worker.in_flight  # round 2 + L is being sampled
    state = run.schedule.state_dict()
    assert run.worker.in_flight == [] and run.schedule.pending == []
    assert list(state["ready"]) == list(range(3, 3 + lag)) and state["next_launch"] == 3 + lag
    assert state["lag"] == lag and state["position"] == PROMPTS * (3 + lag)  # after the newest round collected
    assert [state["ready"][j]["version"] for j in state["ready"]] == [max(0, j - lag) for j in range(3, 3 + lag)]


@pytest.mark.parametrize("lag", [1, 2])
def test_a_resumed_schedule_continues_exactly(lag: int) -> None:
    uninterrupted = Run(lag)
    uninterrupted.train(range(8))

    first = Run(lag)
    first.train(range(4))
    state = through_a_checkpoint_file(first.schedule.state_dict())
    resumed = Run(lag)
    resumed.schedule.load_state_dict(state)
    resumed.train(range(4, 8))

    assert {**first.trained, **resumed.trained} == uninterrupted.trained  # the same rounds, from the same versions
    assert resumed.worker.started_at == PROMPTS * (4 + lag)  # its stream where the saved rounds left it
    # Nothing sampled twice or skipped: the resumed worker samples from round 4 + L on, each from its own version.
    assert resumed.worker.submitted == [(j, j - lag) for j in range(4 + lag, 8 + lag)]
    assert first.worker.submitted + resumed.worker.submitted == uninterrupted.worker.submitted


def test_loading_a_checkpoint_stops_the_running_worker_and_drops_what_it_had_in_flight() -> None:
    run = Run(1)
    run.train(range(2))
    state = through_a_checkpoint_file(run.schedule.state_dict())
    run.train(range(2, 3))  # round 3 in flight
    run.schedule.load_state_dict(state)
    assert run.worker.closed and run.schedule.worker is None and run.schedule.pending == []
    run.train(range(2, 4))  # rounds 2 and 3 again, as after round 1
    assert len(run.workers) == 2 and versions(run) == [0, 0, 1, 2]
    assert run.workers[1].submitted == [(3, 2), (4, 3)]


@pytest.mark.parametrize(
    ("saved_lag", "lag", "expected"),
    [
        # Rounds 4 … 3 + saved_lag come from the checkpoint; a longer lag launches the rounds it lacks from the
        # current weights (version 4), then keeps its own lag.
        pytest.param(1, 3, {4: 3, 5: 4, 6: 4, 7: 4, 8: 5, 9: 6}, id="longer"),
        # A shorter lag launches nothing until it has used up the saved rounds.
        pytest.param(3, 1, {4: 1, 5: 2, 6: 3, 7: 6, 8: 7, 9: 8}, id="shorter"),
    ],
)
def test_a_resume_with_another_lag_launches_what_it_lacks(saved_lag: int, lag: int, expected: dict) -> None:
    first = Run(saved_lag)
    first.train(range(4))
    resumed = Run(lag)
    resumed.schedule.load_state_dict(through_a_checkpoint_file(first.schedule.state_dict()))
    resumed.train(range(4, 10))
    assert {k: version for k, (version, _) in resumed.trained.items()} == expected
    launched = [j for j, _ in first.worker.submitted + resumed.worker.submitted]
    assert launched == list(range(10 + lag))  # every round once, none skipped


def test_a_checkpoint_without_a_queue_samples_the_round_now() -> None:
    run = Run(2)
    run.schedule.load_state_dict({})
    run.train(range(5, 7))
    assert run.worker.started_at is None  # the DataModule's own stream
    assert run.worker.submitted == [(5, 5), (6, 5), (7, 5), (8, 6)] and versions(run) == [5, 5]


# ---------------------------------------------------------------------------------------------- errors
class OutOfOrderWorker(FakeWorker):
    """Finishes the newest round first."""

    def collect(self) -> Finished:
        return self.in_flight.pop()


def test_a_worker_that_finishes_the_wrong_round_is_an_error() -> None:
    schedule = RolloutSchedule(2)
    with pytest.raises(RuntimeError, match=r"^the rollout worker finished round 2, round 0 was due$"):
        schedule.take(0, start_worker=OutOfOrderWorker, weights=lambda: {"version": torch.tensor(0)})


def test_waiting_for_a_round_never_launched_is_an_error() -> None:
    schedule = RolloutSchedule(1)
    schedule.load_state_dict({"ready": {}, "next_launch": 5, "position": 0})  # rounds 2 … 4 are not in it
    with pytest.raises(RuntimeError, match="waits for a round it never launched"):
        schedule.take(2, start_worker=FakeWorker, weights=lambda: {"version": torch.tensor(2)})
    with pytest.raises(RuntimeError, match="waits for a round it never launched"):
        RolloutSchedule(1)._collect_one()  # no worker at all
