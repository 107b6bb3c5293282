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
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.engines.base import RolloutEngine
from grpo_lightning.engines.weights import policy_weights
from grpo_lightning.modality import TEXT, Modality, modality_class
from grpo_lightning.rollout.round import SampledRound
from grpo_lightning.rollout.stream import PromptStream
from grpo_lightning.rollout.worker import RolloutWorker, WorkerSpec


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
        self.ready = {int(k): _sampled(v) for k, v in state.get("ready", {}).items()}
        self.next_launch = int(state.get("next_launch", 0))
        self.position = state.get("position")


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

    def __init__(self, lag: int, engine: RolloutEngine, threads: int | None, timeout_s: float) -> None:
        self.schedule = RolloutSchedule(lag)
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
