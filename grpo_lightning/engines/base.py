"""The rollout engine interface: sample G completions per prompt, in token space, and take new policy weights.

An engine is given left-padded prompt token ids and a ``SamplingParams``; it returns ``Completions`` (token ids,
masks, truncation flags and, when asked, the sampled tokens' log-probs). It never sees text, rewards or the loss.

Two kinds exist:

- engines that **share the policy's weights** (``shares_weights = True``: ``lean``, ``transformers``) sample from
  the very module the optimizer updates, so they are always current;
- engines that **hold their own copy** (``vllm``) must be given the weights after every update
  (``load_weights``); ``weights_version`` says which optimizer step their copy is from, and the round refuses to
  sample from a stale copy. ``grpo_lightning.callbacks.OldPolicySync`` does the pushing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Completions:
    """Sampled completions, one row per (prompt, sample); the G rows of a prompt are adjacent."""

    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T] right-padded with pad_token_id
    completion_mask: Tensor  # [N, T] 1 for generated tokens up to and including EOS
    truncated: Tensor  # [N] bool: ended by the length limit, not by EOS
    # [N, T] log-probs of the drawn tokens under the sampling policy (temperature applied, before top-k/top-p),
    # 0 on padding; only when asked for (``return_logprobs``).
    logprobs: Tensor | None = None

    def __len__(self) -> int:
        return self.completion_ids.size(0)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample: ``group_size`` completions per prompt, from the tempered and filtered distribution."""

    group_size: int = 1
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    """The most likely token at every step (one completion per prompt); temperature and filters are ignored."""
    batch_size: int = 256
    """Completions decoded at once (engines that schedule their own batches may ignore it)."""
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a completion like EOS does, the sequence kept (a tool call's close tag). An engine
    that does not stop early is cut afterwards (``stop_lengths``): the same tokens either way."""

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


class RolloutEngine(ABC):
    """Generates completions for prompts given as token ids. See the module docstring for the two kinds."""

    name: str = "engine"
    shares_weights: bool = True
    """Samples from the policy module itself; ``load_weights`` is then a no-op."""

    def __init__(self) -> None:
        self.weights_version: int | None = None  # the optimizer step of the weights held (engines with a copy)
        self.eos_token_id: int | None = None
        self.pad_token_id: int | None = None

    def setup(self, policy: nn.Module, tokenizer: Any) -> None:
        """Called once the policy exists (after ``configure_model``), before the first generation."""
        self.policy = policy
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id

    @property
    def is_setup(self) -> bool:
        return getattr(self, "policy", None) is not None

    @abstractmethod
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
    ) -> Completions:
        """``params.group_size`` completions per row of ``prompt_ids`` ``[B, P]`` (left-padded), groups adjacent.

        ``generator`` is the caller's random stream: the same state gives the same completions, so a resumed run
        samples what an uninterrupted one would have. ``return_logprobs`` asks for the sampled tokens' log-probs.
        """

    def logprobs_match_policy(self, policy: nn.Module) -> bool:
        """Whether the log-probs this engine returns equal the trainer's (so they may stand for π_old).

        True for engines that run the policy's own weights in float32; engines with their own kernels or copies
        (vLLM) or lower precision differ from the trainer's forward in the last bits or more.
        """
        return self.shares_weights and next(policy.parameters()).dtype == torch.float32

    def load_weights(self, policy: nn.Module, version: int) -> None:
        """Give the engine the policy's current weights (taken after optimizer step ``version``)."""
        self.weights_version = version

    def offload(self) -> None:
        """Called when the round's update starts: an engine may release memory it needs only to generate."""
        return None

    def is_current(self, version: int) -> bool:
        """Whether the engine samples from the weights of optimizer step ``version``."""
        return self.shares_weights or self.weights_version == version

    def close(self) -> None:
        """Release what the engine holds (memory, processes); it may be set up again afterwards."""
        self.policy = None


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode for the block (dropout off while sampling), its own mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def concat_completions(chunks: list[Completions], pad_token_id: int) -> Completions:
    """Join chunks of completions, padding prompts on the left and completions on the right."""
    if len(chunks) == 1:
        return chunks[0]
    prompt_len = max(c.prompt_ids.size(1) for c in chunks)
    completion_len = max(c.completion_ids.size(1) for c in chunks)

    def pad(t: Tensor, length: int, value: int, left: bool) -> Tensor:
        extra = length - t.size(1)
        return F.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Completions(
        prompt_ids=torch.cat([pad(c.prompt_ids, prompt_len, pad_token_id, True) for c in chunks]),
        prompt_mask=torch.cat([pad(c.prompt_mask, prompt_len, 0, True) for c in chunks]),
        completion_ids=torch.cat([pad(c.completion_ids, completion_len, pad_token_id, False) for c in chunks]),
        completion_mask=torch.cat([pad(c.completion_mask, completion_len, 0, False) for c in chunks]),
        truncated=torch.cat([c.truncated for c in chunks]),
        logprobs=(
            torch.cat([pad(c.logprobs, completion_len, 0, False) for c in chunks])
            if all(c.logprobs is not None for c in chunks)
            else None
        ),
    )


def stop_lengths(tokens: Tensor, stop_sequences: tuple[tuple[int, ...], ...]) -> Tensor:
    """``[N]``: each row's length up to and including its first stop sequence; ``tokens.size(1) + 1`` for none."""
    n, width = tokens.shape
    ends = torch.full((n,), width + 1, dtype=torch.long, device=tokens.device)
    for sequence in stop_sequences:
        k = len(sequence)
        if not k or k > width:
            continue
        target = torch.tensor(sequence, device=tokens.device)
        windows = tokens.unfold(1, k, 1)  # [N, width - k + 1, k]
        hit = (windows == target).all(-1)
        found = hit.any(-1)
        first = hit.float().argmax(-1) + k  # the end of the first match
        ends = torch.where(found, torch.minimum(ends, first), ends)
    return ends


def completions_from_tokens(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    tokens: Tensor,
    *,
    group_size: int,
    eos_token_id: int,
    pad_token_id: int,
    max_new_tokens: int,
    logprobs: Tensor | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
) -> Completions:
    """``Completions`` from raw generated tokens ``[N, T]`` (anything after the first EOS or stop sequence is
    ignored).

    A row is truncated when it has neither EOS nor a stop sequence within ``max_new_tokens`` tokens. The mask
    covers the tokens up to and including the first EOS (or stop sequence); the rest becomes ``pad_token_id`` (and
    log-prob 0), and trailing all-padding columns are cut off.
    """
    n, width = tokens.shape
    is_eos = tokens == eos_token_id
    none = torch.full((n,), width + 1, dtype=torch.long, device=tokens.device)
    first_end = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, none)
    first_end = torch.minimum(first_end, stop_lengths(tokens, stop_sequences))
    ended = first_end <= width
    lengths = torch.where(ended, first_end, torch.full_like(first_end, min(width, max_new_tokens)))
    keep = int(lengths.max()) if n else 0
    mask = (torch.arange(keep, device=tokens.device)[None, :] < lengths[:, None]).long()
    completion_ids = tokens[:, :keep].masked_fill(mask == 0, pad_token_id)
    if logprobs is not None:
        logprobs = logprobs[:, :keep].masked_fill(mask == 0, 0.0)
    return Completions(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=completion_ids,
        completion_mask=mask,
        truncated=~ended,
        logprobs=logprobs,
    )
