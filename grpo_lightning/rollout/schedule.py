"""``RolloutSchedule``: asynchronous rollouts at a fixed lag, deterministic by construction
(``data.schedule.rollout_lag``).

At lag L the rollout trained on in round k was sampled by the policy as it was after round k − L (after none,
for the first L rounds): its weights *version* is max(0, k − L), fixed by the schedule and never by timing. While
round k updates, the rollouts of the next rounds are sampled in the background (``rollout/worker.py``):

    round k starts:  drain     collect every round the worker has been given (it sampled them during the
                               previous update: a wait only when it is slower than the update)
                     push      the current weights (version k) to the worker
                     launch    round k + L (at round 0: rounds 0 … L, all from version 0)
                     train     on round k's rollout, sampled from version max(0, k − L)

The worker samples one round at a time, in order, so at most the newest round is in flight. A checkpoint is taken
at a round boundary after a drain: it holds the finished rollouts of rounds k … k + L − 1 and where the prompt
stream stands, which is everything a resumed run needs to train on exactly what an uninterrupted one would.

``PartialSchedule`` is the schedule of ``data.schedule.partial_rollouts`` (``rollout/partial.py``): sequences that
continue across pushes, and groups admitted into a round by their age.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.engines.base import RolloutEngine
from grpo_lightning.engines.weights import policy_weights
from grpo_lightning.modality import TEXT, Modality, modality_class
from grpo_lightning.rollout.partial import (
    PartialSettings,
    Pool,
    ReadyGroups,
    SegmentPlan,
    admit,
    discard_stale,
    plain_pool,
    plain_ready,
    pool_from_plain,
    queued_groups,
    ready_from_plain,
)
from grpo_lightning.rollout.round import SampledRound
from grpo_lightning.rollout.stream import PromptStream
from grpo_lightning.rollout.worker import RolloutWorker, WorkerSpec

log = logging.getLogger(__name__)


class RolloutSchedule:
    """The lag's bookkeeping: what is ready, what is in flight, what comes next (see the module docstring)."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.ready: dict[int, SampledRound] = {}  # sampled, not trained yet: round → rollout
        self.pending: list[int] = []  # given to the worker, not collected yet (in order)
        self.next_launch = 0  # the first round not yet given to the worker
        self.position: int | None = None  # the prompt stream after the last collected round (None: not started)
        self.worker: RolloutWorker | None = None

    def take(
        self,
        round_index: int,
        *,
        start_worker: Callable[[int | None], RolloutWorker],
        weights: Callable[[], dict[str, Tensor]],
    ) -> SampledRound:
        """Round ``round_index``'s rollout; round ``round_index + L`` is launched on the current weights first.

        ``start_worker(position)`` starts the background process with the prompt stream at ``position`` (None:
        where the DataModule's stream is); ``weights()`` the policy's current weights, copied for sending.
        """
        self.drain()
        if self.worker is None:
            self.worker = start_worker(self.position)
        self.next_launch = max(self.next_launch, round_index)
        self.worker.push(weights(), round_index)
        # In a run that keeps its lag, every round launched here is sampled from its own version (round k + L
        # from version k; rounds 0 … L from version 0); a run resumed with another lag launches what it lacks
        # from the current weights, and ``rollout/lag`` says so.
        for launch in range(self.next_launch, round_index + self.lag + 1):
            self.worker.submit(launch)
            self.pending.append(launch)
        # never lowered: a run resumed with a shorter lag holds rounds sampled further ahead, each to train once
        self.next_launch = max(self.next_launch, round_index + self.lag + 1)
        while round_index not in self.ready:  # round 0 (or a run resumed without a queue): sampled now
            self._collect_one()
        return self.ready.pop(round_index)

    def drain(self) -> None:
        """Wait for every round given to the worker (each wait bounded by the worker)."""
        while self.pending:
            self._collect_one()

    def _collect_one(self) -> None:
        if self.worker is None or not self.pending:
            raise RuntimeError("the rollout schedule waits for a round it never launched")
        finished = self.worker.collect()
        expected = self.pending.pop(0)
        if finished.round != expected:
            raise RuntimeError(f"the rollout worker finished round {finished.round}, round {expected} was due")
        self.ready[finished.round] = finished.sampled
        self.position = finished.position

    def close(self) -> None:
        """Stop the worker; what it had in flight is lost (a checkpoint drains first, so it never needs it)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self.pending = []

    def reset(self) -> None:
        """Forget the rounds sampled ahead (the run is over: its checkpoint holds what a resume needs)."""
        self.close()
        self.ready, self.next_launch, self.position = {}, 0, None

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self, modality: Modality = TEXT) -> dict[str, Any]:
        """The finished rollouts not trained yet, the next round to launch and the stream position (after a
        drain: nothing is in flight in a checkpoint); ``modality``: the policy's, which made the rows' inputs."""
        self.drain()
        return {
            "lag": self.lag,
            "ready": {k: _plain(v, modality) for k, v in sorted(self.ready.items())},
            "next_launch": self.next_launch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s output; a worker already running is stopped (it holds other state)."""
        self.close()
        if state.get("partial"):
            log.warning("the checkpoint's rollouts were partial: its groups in flight and queued are dropped")
        self.ready = {int(k): _sampled(v) for k, v in state.get("ready", {}).items()}
        self.next_launch = int(state.get("next_launch", 0))
        self.position = state.get("position")


class PartialSchedule:
    """Partial rollouts' bookkeeping (``data.schedule.partial_rollouts``, ``rollout/partial.py``): the pool in flight,
    the queue of scored groups, the one segment the worker runs at a time. The same surface as ``RolloutSchedule``.

    Round k: collect the segment in flight (launched at round k − 1), push version k, drop (or resample) the groups
    too stale for round k, run further segments under version k while fewer than N groups wait (the trainer waits
    on each), admit the first N, and launch the next segment under version k (it runs during round k's update).
    A checkpoint, at a round boundary, collects the segment in flight first and holds the pool, the queue, the next
    segment's index and the stream position: a resumed run then runs the very segments an uninterrupted one does.
    """

    def __init__(self, settings: PartialSettings) -> None:
        self.settings = settings
        self.pool = Pool()
        self.queue: list[ReadyGroups] = []
        self.segment = 0  # the next segment's index: its seed (``worker.round_seed``)
        self.pending: list[int] = []  # the segment in flight (at most one)
        self.position: int | None = None  # the prompt stream after the last collected segment
        self.worker: RolloutWorker | None = None
        self._counts = _SegmentCounts()

    def take(
        self,
        round_index: int,
        *,
        start_worker: Callable[[int | None], RolloutWorker],
        weights: Callable[[], dict[str, Tensor]],
    ) -> SampledRound:
        """Round ``round_index``'s rollout (the class docstring); ``start_worker`` and ``weights`` as for
        ``RolloutSchedule.take``."""
        self.drain()
        if self.worker is None:
            self.worker = start_worker(self.position)
        self.worker.push(weights(), round_index)
        self._counts.stale += discard_stale(self.pool, self.queue, round_index, self.settings)
        while queued_groups(self.queue) < self.settings.groups_per_round:  # the trainer waits for these
            self._launch(round_index)
            self.drain()
            self._counts.waited += 1
        sampled, _ = admit(self.queue, round_index, self.settings)
        sampled.metrics.update(self._counts.metrics(self.pool, self.queue))
        sampled.timings.update(self._counts.timings)
        self._counts = _SegmentCounts()
        self._launch(round_index)
        return sampled

    def _launch(self, version: int) -> None:
        plan = SegmentPlan(self.segment, version, queued_groups(self.queue), self.settings)
        self.worker.submit_segment(plan, self.pool)
        self.pending.append(self.segment)
        self.segment += 1

    def drain(self) -> None:
        """Wait for the segment in flight (bounded by the worker) and take in what it left; with ``interrupt:
        clock``, after telling the worker to stop at the end of the segment it is decoding."""
        if self.pending and self.settings.clock:
            self.worker.interrupt()
        while self.pending:
            finished = self.worker.collect()
            expected = self.pending.pop(0)
            if finished.index != expected:
                raise RuntimeError(f"the rollout worker finished segment {finished.index}, segment {expected} was due")
            self.pool, self.position = finished.pool, finished.position
            self.segment = max(self.segment, finished.index + finished.segments)  # clock mode: several
            self._counts.segments += finished.segments
            self._counts.steps += sum(s.stepping for g in finished.pool.groups for s in g.samples)
            for phase, seconds in finished.timings.items():  # every segment's, whether it ended groups or not
                self._counts.timings[phase] = self._counts.timings.get(phase, 0.0) + seconds
            self.queue += finished.ready

    def close(self) -> None:
        """Stop the worker; the segment in flight is lost (a checkpoint collects it first)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self.pending = []

    def reset(self) -> None:
        """Forget the pool and the queue (the run is over: its checkpoint holds what a resume needs)."""
        self.close()
        self.pool, self.queue, self.segment, self.position = Pool(), [], 0, None

    def state_dict(self, modality: Modality = TEXT) -> dict[str, Any]:
        """The pool, the queue, the next segment and the stream position, after collecting the segment in flight."""
        self.drain()
        return {
            "partial": True,
            "pool": plain_pool(self.pool),
            "queue": [plain_ready(ready, lambda sampled: _plain(sampled, modality)) for ready in self.queue],
            "segment": self.segment,
            "position": self.position,
            "counts": asdict(self._counts),  # what the next round logs of the segments before it
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s output (a checkpoint of a fixed lag, or none: afresh from the stream)."""
        self.close()
        if state and not state.get("partial"):
            log.warning("the checkpoint's rollouts were sampled at a fixed lag: partial rollouts start afresh")
            state = {"position": state.get("position")}
        self.pool = pool_from_plain(state.get("pool", {}))
        self.queue = [ready_from_plain(plain, _sampled) for plain in state.get("queue", [])]
        self.segment = int(state.get("segment", 0))
        self.position = state.get("position")
        self._counts = _SegmentCounts(**state.get("counts", {}))


@dataclass
class _SegmentCounts:
    """What happened between two rounds: segments collected, those the trainer waited for, groups too stale, the
    environment steps the segments left running in the background (counted in their pools: deterministic), the
    segments' generation, scoring and environment-wait seconds."""

    segments: int = 0
    waited: int = 0
    stale: int = 0
    steps: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def metrics(self, pool: Pool, queue: list[ReadyGroups]) -> dict[str, float]:
        return {
            "rollout/segments": float(self.segments),
            "rollout/segments_waited": float(self.waited),
            "rollout/stale_groups": float(self.stale),
            "rollout/environment_steps": float(self.steps),
            "rollout/groups_in_flight": float(len(pool.groups)),
            "rollout/groups_queued": float(queued_groups(queue)),
        }


def _plain(sampled: SampledRound, modality: Modality) -> dict[str, Any]:
    """A ``SampledRound`` as plain data (dicts, lists, tensors, bytes) that ``torch.load(weights_only=True)`` reads:
    the rows' inputs and images too, as their ``modality`` writes them (``Modality.plain_rows``), named beside."""
    batch = sampled.batch
    plain = asdict(replace(sampled, batch=replace(batch, vision=[], images=[])))
    plain["batch"].update(modality.plain_rows(batch.vision, batch.images))
    plain["modality"] = modality.name
    return plain


def _sampled(plain: dict[str, Any]) -> SampledRound:
    from grpo_lightning.rollout.batch import RolloutBatch

    plain, batch = dict(plain), dict(plain["batch"])
    # The modality that wrote the rows (``Modality.rows_from_plain``); a checkpoint from before it was named holds
    # image rows or none.
    name = plain.pop("modality", "image" if batch.get("vision") else TEXT.name)
    batch.update(modality_class(name).rows_from_plain(batch))
    return SampledRound(**{**plain, "batch": RolloutBatch(**batch)})


# ------------------------------------------------------------------------------- the collector's side
class BackgroundRollouts:
    """What ``RolloutCollector`` holds at a lag: the schedule, the worker it starts, the CPU threads it splits.

    On the CPU the background process and the update each get their own threads, so that the overlap is real on
    a small machine: ``rollout_threads`` for the worker (default half of this process's), the rest (at least one)
    for the update, put back when the run ends. On a GPU both sides run on the device; the threads matter little.
    """

    def __init__(
        self,
        lag: int,
        engine: RolloutEngine,
        threads: int | None,
        timeout_s: float,
        partial: PartialSettings | None = None,
    ) -> None:
        """``partial``: partial rollouts' settings (``data.schedule.partial_rollouts``; None: a fixed lag)."""
        self.schedule = RolloutSchedule(lag) if partial is None else PartialSchedule(partial)
        self.engine = copy.deepcopy(engine)  # a fresh one for the worker, set up there (never here)
        self.threads, self.timeout_s = threads, timeout_s
        self._threads_before: int | None = None

    def take(
        self,
        round_index: int,
        *,
        worker_spec: Callable[[int | None, int], WorkerSpec],
        weights: Callable[[], dict[str, Tensor]],
    ) -> SampledRound:
        """Round ``round_index``'s rollout (see ``RolloutSchedule.take``). ``worker_spec(position, threads)``: what
        the worker is started from; ``weights()``: what it is pushed at the round boundary. ``time/wait``: how
        long the trainer waited for it (the generation the update did not hide)."""
        start = time.perf_counter()
        try:
            sampled = self.schedule.take(
                round_index, start_worker=lambda position: self._start(worker_spec, position), weights=weights
            )
        except BaseException:
            self.close()  # a failed or stuck worker is stopped here: Lightning runs no teardown after an error
            raise
        sampled.timings["wait"] = time.perf_counter() - start
        return sampled

    def state_dict(self, stream: PromptStream, modality: Modality = TEXT) -> dict[str, Any]:
        """The schedule's queue, after waiting for the round in flight; ``stream`` then follows the worker's;
        ``modality``: the policy's, which writes its rows' inputs."""
        try:
            state = self.schedule.state_dict(modality)  # waits for the round in flight
        except BaseException:
            self.close()
            raise
        if self.schedule.position is not None:
            stream.position = self.schedule.position
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's queue (None: a checkpoint without one; the schedule starts afresh from its stream)."""
        self.schedule.load_state_dict(state or {})

    def close(self) -> None:
        """The run is over (or failed): stop the worker, forget what it sampled ahead, give the threads back."""
        self.schedule.reset()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _start(self, worker_spec: Callable[[int | None, int], WorkerSpec], position: int | None) -> RolloutWorker:
        total = torch.get_num_threads()
        threads = self.threads or max(1, total // 2)
        spec = worker_spec(position, threads)
        if torch.device(spec.device).type == "cpu" and self._threads_before is None:
            self._threads_before = total
            torch.set_num_threads(max(1, total - threads))
        return RolloutWorker(spec, timeout_s=self.timeout_s)


def policy_state(policy: torch.nn.Module) -> dict[str, Tensor]:
    """The policy's weights as a plain model has them (LoRA merged, FSDP2 gathered), copied to the CPU for the
    worker: the copies go to shared memory, never the trainer's own tensors, which the update goes on changing."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in policy_weights(policy)}
