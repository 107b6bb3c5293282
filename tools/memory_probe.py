"""Peak tensor memory of a block of code, on any device (CPU included), for benchmarks and tests.

``torch.cuda.max_memory_allocated`` has no CPU counterpart, and process-level numbers (RSS) mix in the Python
heap, allocator caching and other threads. ``PeakMemory`` counts what a tensor program controls: the bytes of
every tensor storage created inside the block, from the operation that creates it until the storage is freed.
It is a ``TorchDispatchMode``: every ATen operation (forward and backward, inside activation checkpointing
too) passes through it, and each new output storage is recorded with a ``weakref`` finaliser that subtracts its
size when the storage dies. Views share their base's storage and in-place results are the same storage, so
neither counts twice. Not counted: tensors that existed before the block (their frees are not subtracted
either) and scratch buffers a kernel allocates and frees internally, which never reach Python.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as m: ...`` then ``m.peak`` (bytes): the most tensor memory alive at once in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = weakref.WeakKeyDictionary()

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        known = self._sizes.get(storage)
        if known is None:
            self._sizes[storage] = nbytes
            weakref.finalize(storage, self._release, nbytes)
            self.current += nbytes
        elif known != nbytes:  # resized in place (``out=`` operations): count the new size from now on
            self._sizes[storage] = nbytes
            self.current += nbytes - known
            weakref.finalize(storage, self._release, nbytes - known)
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                self._track(value)
        return out


def peak_bytes(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """Run ``fn(*args, **kwargs)`` under ``PeakMemory``; its peak in bytes and its result."""
    with PeakMemory() as tracker:
        result = fn(*args, **kwargs)
    return tracker.peak, result


def update_peak_bytes(
    build: Any, *, rows: int, prompt_len: int, completion_len: int, chunk_size: int | None = 1024, seed: int = 0
) -> int:
    """Peak tensor memory of a module's life through one GRPO update on a random rollout, in bytes.

    ``build()`` returns an unbuilt ``GRPOModule``; inside the measured block it is built (``configure_model``:
    policy, reference), gets its optimizer, computes the rollout's reference log-probs, then one forward and
    backward of the GRPO loss and one optimizer step: weights, reference, gradients and optimizer state all count.
    """
    from grpo_lightning.losses import grpo_loss
    from grpo_lightning.models.logprobs import completion_logprobs
    from grpo_lightning.rollout.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    module = build()
    vocab = len(module.tokenizer)

    def update() -> None:
        module.configure_model()
        optimizer = module.configure_optimizers()["optimizer"]
        batch = RolloutBatch(
            prompt_ids=torch.randint(3, vocab, (rows, prompt_len), generator=generator),
            prompt_mask=torch.ones(rows, prompt_len, dtype=torch.long),
            completion_ids=torch.randint(3, vocab, (rows, completion_len), generator=generator),
            completion_mask=torch.ones(rows, completion_len, dtype=torch.long),
            truncated=torch.zeros(rows, dtype=torch.bool),
            rewards=torch.randn(rows, generator=generator),
        )
        _, ref = module.rollout_logprobs(batch, old=False, ref=True)
        inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        logprobs, _ = completion_logprobs(module.policy, *inputs, chunk_size=chunk_size)
        loss, _ = grpo_loss(logprobs, None, ref, batch.rewards, batch.completion_mask, beta=module.objective.beta)
        loss.backward()
        optimizer.step()

    return peak_bytes(update)[0]
