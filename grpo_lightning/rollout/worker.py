"""The background rollout process of ``data.schedule.rollout_lag`` > 0: it samples and scores rounds while the trainer
updates.

One process per rank, spawned, so that it has its own global RNGs, its own main thread (where the SIGALRM time
limits of rewards and tools work) and its own torch thread count. It holds

- a copy of the policy, given to it at each round boundary (``push``: every weight under its Hugging Face name,
  LoRA merged, FSDP2 gathered; for an engine with its own copy, vLLM, that copy is what it pushes on), and
- the prompt stream, the scorer, the environment and the engine of ``data``,

and runs ``rollout.round.sample_round`` (generate, score, filter: DAPO's refill draws included) for one round at a
time, in the order they were submitted. Round j is sampled from (the weights it was last pushed, the stream where
the previous round left it, round j's own seed: ``round_seed``), so two runs give the same rollouts whatever the
machine's load, and a resumed run the same as an uninterrupted one. With ``data.schedule.partial_rollouts`` it runs
segments instead of rounds (``rollout/partial.py: run_segment``): the pool it is sent, decoded one token budget
further under the weights it was last pushed, from the segment's own seed; a multi-turn kind's live environments stay
here between segments (``held``: never sent, never checkpointed; a resumed run replays them), with the steps a segment
launched in its thread pool and left running for the next one to collect (``integrations/environments/partial_turns``).

Every wait of the trainer on it is bounded and checks that it is alive; an exception in it is raised in the
trainer (the same exception where it can be sent, with the worker's traceback). It ends with the trainer, also
when the trainer is killed (``PR_SET_PDEATHSIG``; its reads time out and check the parent too).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import queue
import random
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import RolloutEngine
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.partial import Pool, ReadyGroups, SegmentPlan, run_segments
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, SampledRound, sample_round
from grpo_lightning.rollout.stream import PromptStream


@dataclass
class WorkerSpec:
    """Everything the worker builds its side from (pickled into the new process once)."""

    engine: RolloutEngine
    """A fresh engine of ``data.engine`` (not set up: the worker sets it up on its own model)."""
    model_config: Any
    """The policy's (base model's) config: the worker builds the same architecture, then takes pushed weights."""
    generation_config: Any
    """The policy's ``generation_config``: its EOS ids end completions here too (``engines.base.end_token_ids``)."""
    dtype: torch.dtype
    tokenizer: Any
    encoder: PromptEncoder
    """The trainer's prompt encoder (its chat template settings: ``use_chat_template``, ``system_prompt``,
    ``chat_template_kwargs``), so the worker renders every prompt as the trainer does."""
    scorer: Scorer
    settings: RoundSettings
    data: Any
    """The training prompts (a ``datasets.Dataset``)."""
    stream: PromptStream
    rank: int
    world_size: int
    seed: int
    device: str
    threads: int
    autocast: torch.dtype | None = None
    """Generation under ``torch.autocast`` with this dtype (the trainer's ``bf16-mixed``)."""


@dataclass
class Finished:
    """A round the worker sampled: its rollout, and the stream position it left."""

    round: int
    sampled: SampledRound
    position: int


@dataclass
class FinishedSegment:
    """A segment of partial rollouts the worker ran (``rollout/partial.py``), or several with ``interrupt: clock``:
    the pool after them, the groups that ended (one entry per segment that ended some), the stream position."""

    index: int
    pool: Pool
    ready: list[ReadyGroups]
    position: int
    segments: int = 1
    """Segments run (more than one with ``interrupt: clock``), from ``index`` on."""
    timings: dict[str, float] = field(default_factory=dict)
    """Their seconds, by phase (``run_segment``'s ``counters``: ``generate``, ``score``, ..., ``environment_wait``),
    whether they ended groups or not; the round logs them as ``time/<phase>``."""


def round_seed(seed: int, rank: int, round_index: int) -> int:
    """The seed of round ``round_index`` on ``rank``: its sampling generator and the worker's global RNGs during
    it (rewards may draw from them). A function of the round alone: no round's draws depend on another's."""
    return (seed * 1_000_003 + rank * 7_919 + round_index * 104_729) % (2**63 - 1)


class RolloutWorker:
    """The trainer's side of the background process (see the module docstring)."""

    START_TIMEOUT_S = 600.0  # the shortest bound of a start: a model to build, vLLM to start (minutes on a GPU)

    def __init__(self, spec: WorkerSpec, *, timeout_s: float) -> None:
        """Start the process and wait until it has built its model and engine (at most ``timeout_s``, or
        ``START_TIMEOUT_S`` if longer); later waits for a round are bounded by ``timeout_s``."""
        context = torch.multiprocessing.get_context("spawn")
        self.timeout_s = timeout_s
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_serve, args=(spec, self.requests, self.results, os.getpid()), daemon=True, name="grpo-rollouts"
        )
        try:
            self.process.start()
        except Exception as err:  # the spec did not pickle: a lambda reward, an engine holding a live handle, ...
            raise ConfigError(
                f"data.schedule.rollout_lag: the rollout settings cannot be sent to the background process ({err}); "
                "reward functions, tools and engines must be importable objects (no lambdas)"
            ) from None
        self._receive("ready", max(timeout_s, self.START_TIMEOUT_S))

    def push(self, weights: dict[str, Tensor], version: int) -> None:
        """The policy's weights (taken after ``version`` rounds) for the rounds submitted from now on."""
        self.requests.put(("weights", version, weights))

    def submit(self, round_index: int) -> None:
        """Sample and score round ``round_index`` after the rounds submitted before it."""
        self.requests.put(("sample", round_index))

    def submit_segment(self, plan: SegmentPlan, pool: Pool) -> None:
        """Run one segment of partial rollouts on ``pool`` (``rollout/partial.py: run_segment``), after the requests
        before it; its ``FinishedSegment`` is collected like a round."""
        self.requests.put(("segment", plan, pool))

    def interrupt(self) -> None:
        """End a clock-mode run of segments (``interrupt: clock``) after the segment it is decoding: a request in the
        queue is what it waits for. Nothing else reads it."""
        self.requests.put(("interrupt",))

    def collect(self) -> Any:
        """The next finished round (``Finished``) or segment (``FinishedSegment``), in submission order."""
        return self._receive("done", self.timeout_s)

    def close(self) -> None:
        """Stop the process: asked to (it reads the request between rounds), then killed if still there after 3 s
        (a round in flight is not worth waiting for: a checkpoint never needs it)."""
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.requests.put(("stop",))
            self.process.join(timeout=3)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        for q in (self.requests, self.results):
            q.cancel_join_thread()
            q.close()

    def _receive(self, expected: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                kind, packed = self.results.get(timeout=1.0)
                payload = _unpack(packed)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the rollout worker process died (exit code {self.process.exitcode}) while the trainer "
                        f"waited for it: see its output above"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the rollout worker gave no result in {timeout_s:g} s (data.schedule.rollout_timeout_s): it "
                        "is stuck or too slow"
                    ) from None
                continue
            if kind == "error":
                error, trace = payload
                raise error from WorkerTraceback(trace)
            if kind != expected:
                raise RuntimeError(f"the rollout worker answered {kind!r} where {expected!r} was due")
            return payload


class WorkerTraceback(Exception):
    """The worker's own traceback, as the cause of the exception it raised."""

    def __str__(self) -> str:
        return "in the rollout worker:\n" + str(self.args[0])


# ------------------------------------------------------------------------------------------- the process
def _serve(spec: WorkerSpec, requests: Any, results: Any, parent: int) -> None:
    _die_with_parent()
    # A SIGTERM or Ctrl-C for the whole job (SLURM's, a terminal's) is the trainer's to handle: it finishes its
    # round, waits for this process's round in flight, saves and stops it. (SIGALRM stays: the time limits.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(spec.threads)
        model = _build_model(spec)
        spec.engine.setup(model, spec.tokenizer, spec.encoder.modality)
        encoder = spec.encoder
        held: dict[Any, Any] = {}  # partial rollouts of a multi-turn kind: its live environments between segments
        results.put(("ready", _pack(None)))
    except BaseException as err:  # noqa: BLE001 - reported to the trainer, which raises it
        results.put(("error", _pack(_sendable(err))))
        return
    while True:
        try:
            message = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the trainer is gone
            continue
        try:
            if message[0] == "stop":
                return
            if message[0] == "interrupt":  # it ended a clock-mode run of segments by being in the queue
                continue
            if message[0] == "weights":
                _, version, weights = message
                if spec.engine.remote:  # the trainer pushed these weights to the servers itself, as this version
                    spec.engine.follow(version, int(weights["pushed_version"]))
                else:
                    model.load_state_dict(weights)
                    spec.engine.load_weights(model, version)
            elif message[0] == "sample":
                results.put(("done", _pack(_sample(spec, encoder, message[1]))))
            elif message[0] == "segment":
                keep_going = requests.empty  # clock: until the next push (or stop) is in the queue
                results.put(("done", _pack(_segment(spec, encoder, message[1], message[2], keep_going, held))))
        except BaseException as err:  # noqa: BLE001 - reported to the trainer, which raises it
            results.put(("error", _pack(_sendable(err))))
            return


def _build_model(spec: WorkerSpec) -> torch.nn.Module:
    # The policy's architecture, as its modality builds it (a vision-language model's with its vision tower: the
    # encoder sent in the spec holds the modality and its processor, so each row's images are encoded here as in the
    # trainer).
    # An engine with its own copy (vLLM) keeps the weights on its device; the model here only carries them. A
    # remote engine (vLLM servers) needs only the model's shape: no memory at all.
    device = "meta" if spec.engine.remote else spec.device if spec.engine.shares_weights else "cpu"
    with torch.device(device):  # initialised where it runs (on a GPU: seconds, not minutes); weights come pushed
        model = spec.encoder.modality.model_from_config(spec.model_config, spec.dtype)
    model.generation_config = spec.generation_config
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _seeded(spec: WorkerSpec, index: int) -> Iterator[torch.Generator]:
    """Round (or segment) ``index``'s draws: the global RNGs seeded and its sampling generator (``round_seed``), the
    scorer's trainer state at the version sampled from, generation under the trainer's autocast."""
    seed = round_seed(spec.seed, spec.rank, index)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    generator = torch.Generator(device=spec.device).manual_seed(seed)
    autocast = (
        torch.autocast(torch.device(spec.device).type, dtype=spec.autocast)
        if spec.autocast is not None
        else contextlib.nullcontext()
    )
    version = int(spec.engine.weights_version or 0)  # the rounds the sampling policy was trained for
    spec.scorer.trainer_state.update(version * spec.settings.optimizer_steps, version)
    with autocast:
        yield generator


def _sample(spec: WorkerSpec, encoder: PromptEncoder, round_index: int) -> Finished:
    with _seeded(spec, round_index) as generator:
        sampled = sample_round(
            lambda: spec.stream.next_rows(spec.data, spec.rank, spec.world_size),
            engine=spec.engine,
            encoder=encoder,
            scorer=spec.scorer,
            settings=spec.settings,
            generator=generator,
            device=spec.device,
        )
    sampled.version = int(spec.engine.weights_version or 0)
    sampled.batch = sampled.batch.to("cpu")
    return Finished(round_index, sampled, spec.stream.position)


def _segment(
    spec: WorkerSpec,
    encoder: PromptEncoder,
    plan: SegmentPlan,
    pool: Pool,
    keep_going: Callable[[], bool],
    held: dict[Any, Any],
) -> FinishedSegment:
    timings: dict[str, float] = {}
    with _seeded(spec, plan.index) as generator:  # clock mode's later segments continue this generator
        ready, segments = run_segments(
            pool,
            plan,
            keep_going=keep_going,
            next_rows=lambda: spec.stream.next_rows(spec.data, spec.rank, spec.world_size),
            engine=spec.engine,
            encoder=encoder,
            scorer=spec.scorer,
            settings=spec.settings,
            generator=generator,
            device=spec.device,
            held=held,
            counters=timings,
        )
    return FinishedSegment(plan.index, pool, ready, spec.stream.position, segments, timings)


def _pack(payload: Any) -> bytes:
    """``payload`` as bytes. Results go by value, not as shared tensors: a tensor shared by file descriptor needs
    its sender alive when it is received, and a worker may die right after sending (weights go the other way
    shared: the trainer outlives its worker)."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _unpack(packed: bytes) -> Any:
    return torch.load(io.BytesIO(packed), weights_only=False)  # from the worker this run started: trusted


def _sendable(err: BaseException) -> tuple[BaseException, str]:
    """``err`` and its traceback, as the trainer can receive them (an exception that does not pickle becomes a
    RuntimeError with its message)."""
    import pickle

    trace = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001
        err = RuntimeError(f"{type(err).__name__}: {err}")
    return err, trace


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the trainer dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
