"""The rollout engine interface: sample G completions per prompt, in token space, and take new policy weights.

An engine is given left-padded prompt token ids and a ``SamplingParams``; it returns ``Completions`` (token ids,
masks, truncation flags and, when asked, the sampled tokens' log-probs). It never sees text, rewards or the loss.

Two kinds exist:

- engines that **share the policy's weights** (``shares_weights = True``: ``lean``, ``transformers``) sample from
  the very module the optimizer updates, so they are always current;
- engines that **hold their own copy** (``vllm``) must be given the weights after every update
  (``load_weights``); ``weights_version`` says which optimizer step their copy is from. The round pushes them
  before it samples, and evaluation before it generates (``rollout/collector.py: RolloutCollector.push_weights``).

What every engine samples, and what its log-probs mean (the same for all; ``tests/engine_contract.py`` checks it):

- **The distribution is ``SamplingParams`` and nothing else**: the logits divided by ``temperature``, every EOS id
  banned for the first ``min_new_tokens`` tokens, top-k, then top-p (nucleus), renormalised; ``greedy`` takes the
  argmax of the logits. Nothing of the model's own ``generation_config`` (Qwen2.5-Instruct ships a repetition
  penalty, top-k, top-p and a temperature) reaches the sampler: the loss and π_old model this distribution only.
- **Every EOS id ends a completion**: the tokenizer's and each of the model's ``generation_config``
  (``RolloutEngine.eos_token_ids``). A completion cut by a length limit is ``truncated``, and its mask never covers
  padding.
- **``Completions.logprobs`` are the drawn tokens' log-probs under that same distribution** (the behaviour policy
  μ; for ``greedy``, the model's own at temperature 1). vLLM can return no other (its ``processed_logprobs``), and
  it is the distribution the tokens really came from. Without filtering (``SamplingParams.filtered`` false) μ is
  the tempered policy; with top-k, top-p or a minimum length μ renormalises over the kept tokens. Engines that
  have the full logits at hand (lean, transformers) also return ``Completions.policy_logprobs``, the tempered,
  unfiltered log-probs the trainer's forward computes: on the trainer's float32 weights they are π_old exactly
  (``data.update.old_logprobs: auto`` takes them, saving a forward pass). For an engine with its own copy (vLLM), which
  gives μ only, π_old is recomputed and the truncated importance-sampling weight π_old / μ
  (``loss.truncated_importance_weights``) then corrects for both the engine's rounding and the filter: with
  top-p < 1 a kept token has μ ≥ π_old, so token weights are ≤ 1 and a sequence-level weight, their product,
  decays with the completion's length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_lightning.config import SamplingConfig
from grpo_lightning.engines.continuation import GenerationSession, weights_stamp
from grpo_lightning.modality import TEXT, Modality


@dataclass
class Completions:
    """Sampled completions, one row per (prompt, sample); the G rows of a prompt are adjacent."""

    prompt_ids: Tensor
    """``[N, P]`` each row's prompt, left-padded (a prompt repeated for each of its group's rows)."""
    prompt_mask: Tensor
    """``[N, P]`` 1 on the prompt tokens."""
    completion_ids: Tensor
    """``[N, T]`` the sampled tokens, right-padded with ``pad_token_id``."""
    completion_mask: Tensor
    """``[N, T]`` 1 for generated tokens up to and including the end (EOS id or stop sequence), never on padding."""
    truncated: Tensor
    """``[N]`` bool: ended by the length limit, not by an end token."""
    logprobs: Tensor | None = None
    """``[N, T]`` log-probs of the drawn tokens under the distribution each was drawn from (the module docstring),
    0 on padding; only when asked for (``return_logprobs``)."""
    policy_logprobs: Tensor | None = None
    """``[N, T]`` the same tokens' log-probs under the tempered policy, unfiltered (what the trainer's forward
    computes): from engines that have the full logits at hand (lean, transformers), with ``return_logprobs``; equal
    to ``logprobs`` when the sampling is not filtered. None from an engine that cannot give them (vLLM)."""

    def __len__(self) -> int:
        return self.completion_ids.size(0)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample: ``group_size`` completions per prompt, from the tempered and filtered distribution."""

    group_size: int = 1
    """Completions per prompt (``data.sampling.group_size``); ignored when ``greedy``."""
    max_new_tokens: int = 64
    """The most tokens a completion may have; one without an end by then is ``truncated``."""
    min_new_tokens: int = 0
    """Every EOS id is banned for the first ``min_new_tokens`` tokens (stop sequences count from there too)."""
    temperature: float = 1.0
    """The logits are divided by it."""
    top_p: float = 1.0
    """Nucleus filter: the smallest set of most likely tokens whose probabilities reach ``top_p`` is kept (1: off)."""
    top_k: int = 0
    """The ``top_k`` most likely tokens are kept (0: off); applied before ``top_p``."""
    greedy: bool = False
    """The most likely token at every step (one completion per prompt); temperature and filters are ignored."""
    batch_size: int = 256
    """Completions decoded at once (engines that schedule their own batches may ignore it)."""
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a completion like EOS does, the sequence kept (a tool call's close tag), once the
    completion has ``min_new_tokens`` tokens before its last one (as for EOS). An engine that does not stop early is
    cut afterwards (``stop_lengths``): the same tokens either way."""

    @property
    def filtered(self) -> bool:
        """Whether the sampling distribution differs from the tempered policy's: top-k, top-p or a minimum length
        (the EOS ban). Then the engine's log-probs are not the trainer's, even on the trainer's own weights."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_new_tokens > 0)

    @classmethod
    def from_config(cls, sampling: SamplingConfig, **changes: Any) -> SamplingParams:
        """``data.sampling`` as an engine's parameters, with ``changes`` (``group_size``, ``greedy``, ...)."""
        values = {
            "group_size": sampling.group_size,
            "max_new_tokens": sampling.max_new_tokens,
            "min_new_tokens": sampling.min_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "batch_size": sampling.generation_batch_size,
        }
        return cls(**{**values, **changes})

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


class RolloutEngine(ABC):
    """Generates completions for prompts given as token ids (the module docstring says what every engine samples).

    To add an engine: subclass it, set ``name``, declare what it can do with the class attributes below (their
    defaults describe an engine that samples from the policy module itself, text only) and implement ``generate``.
    An engine that holds its own copy of the weights sets ``shares_weights = False`` and overrides ``load_weights``
    (and ``offload`` and ``close`` to free what it holds). Its ``__init__`` arguments are its settings
    (``data.engine: {class_path: my_pkg.MyEngine, init_args: {...}}``); ``register_engine`` gives it a name.

    What the core does with an engine, in order: builds it when the config is read (before any model loads), calls
    ``setup`` once the policy exists, then each round ``load_weights`` when ``is_current`` is false, ``generate``
    (once or more) and ``offload`` when the update starts; ``close`` when the run ends. At a rollout lag an engine
    not yet set up is deep-copied and pickled into the background process, which sets it up on its own model: its
    settings must pickle. ``tests/engine_contract.py`` checks an engine against this contract.
    """

    name: str = "engine"
    """The engine's name in messages and logs (``data.engine``'s name for it)."""
    shares_weights: bool = True
    """Samples from the policy module itself; ``load_weights`` is then a no-op."""
    remote: bool = False
    """Generates in other processes that the trainer pushes to directly (``vllm_server``): at a rollout lag the
    trainer, not the background process, pushes the weights, and the background process holds no model copy."""
    policy: nn.Module | None = None
    """The policy it samples from (or whose architecture it copies), once ``setup``."""
    supports_continuation: bool = False
    """``generate`` takes ``session=`` (from ``open_session``): each row then continues from the keys and values
    kept at the session's previous call, prefilling only its new tokens (``engines/continuation.py``)."""
    supports_partial_rollouts: bool = False
    """An unfinished sequence can continue under new weights (``data.schedule.partial_rollouts``): ``generate`` from
    its prompt + tokens so far prefills that prefix on the weights it holds now, never on keys and values an earlier
    version computed. ``lean`` and ``transformers`` keep no cache between calls; the vLLM engines keep a prefix cache
    (keyed by token ids alone) and clear it at every push (``load_weights``), so a context longer than a KV block
    is recomputed on the new weights too."""
    takes_images: bool = False
    """``generate`` takes ``vision=``: a vision-language model's images for each prompt (``grpo_lightning/vision``)."""
    takes_row_inputs: bool = False
    """``generate`` takes ``vision=`` rows of any modality: each prompt's inputs beyond its ids, given to the model as
    the engine's ``modality`` says (``Modality.generation_inputs``: ``grpo_lightning/modality.py``)."""
    follows_token_types: bool = False
    """A vision-language model whose forward reads ``token_type_ids`` (Gemma 3's bidirectional attention within an
    image, PaliGemma's prefix: ``integrations/vision/inputs.py: TOKEN_TYPE_RULES``) samples with them as its own forward
    reads them, checked against that forward (``tests/vision/test_vision_families.py``)."""
    eos_token_ids: tuple[int, ...] = ()
    """The ids that end a completion (the tokenizer's EOS and the model's ``generation_config`` ones), set by
    ``setup``; none before (a multi-turn rollout then ends a turn at the tokenizer's EOS)."""

    @property
    def policy_config(self) -> Any:
        """The configuration of the policy it samples from (a transformers ``PretrainedConfig``: its context length,
        its vocabulary); None before ``setup`` or for a module without one."""
        return getattr(self.policy, "config", None)

    def __init__(self) -> None:
        self.weights_version: int | None = None  # the optimizer step of the weights held (engines with a copy)
        self.eos_token_id: int | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.pad_token_id: int | None = None
        self.modality: Modality = TEXT  # the policy's (``setup``): what its rows' inputs are

    def setup(self, policy: nn.Module, tokenizer: Any, modality: Modality = TEXT) -> None:
        """Called once the policy exists (after ``configure_model``), before the first generation; ``modality``:
        the policy's (``grpo_lightning/modality.py``), which gives ``generate(vision=...)``'s rows to the
        model."""
        self.policy, self.modality = policy, modality
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.eos_token_ids = end_token_ids(policy, tokenizer)

    def check_row_inputs(self) -> None:
        """Refuse ``generate(vision=...)`` rows when the engine was set up with a modality that has none to give."""
        if not self.modality.has_row_inputs:
            raise ValueError(f"the {self.name} engine was given rows with inputs but set up with the text modality")

    @property
    def is_setup(self) -> bool:
        return self.policy is not None

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
        """``params.group_size`` completions per row of ``prompt_ids`` (one per row when ``params.greedy``).

        An engine with ``supports_continuation`` also takes ``session=`` (``open_session``): the same samples, each
        row continuing from the keys and values kept at the session's previous call; one with ``takes_images`` or
        ``takes_row_inputs`` takes ``vision=``, each prompt's inputs beyond its ids.

        Args:
            prompt_ids: ``[B, P]`` prompt token ids, left-padded with the tokenizer's pad id.
            prompt_mask: ``[B, P]`` 1 on the prompts' tokens, 0 on the padding.
            params: what to sample (the module docstring: the distribution is this and nothing else).
            generator: the caller's random stream: the same state must give the same completions, so that a
                resumed run samples what an uninterrupted one would have. None: torch's global one.
            return_logprobs: also return the drawn tokens' log-probs (``Completions.logprobs``; and
                ``policy_logprobs`` where the engine has the full logits).

        Returns:
            ``B × params.group_size`` rows, a prompt's ``group_size`` rows adjacent, in the prompts' order;
                each ends at its first EOS id or stop sequence (kept, in the mask) or is ``truncated`` at
                ``params.max_new_tokens``.
        """

    def open_session(self) -> GenerationSession:
        """A session for consecutive ``generate(..., session=...)`` calls that continue from the kept KV cache (the
        turns of one rollout; engines with ``supports_continuation``). Close it when the rollout ends: it holds
        every continuing row's keys and values until then, and never serves weights other than those that filled
        it."""
        if not self.supports_continuation:
            raise NotImplementedError(f"the {self.name} engine does not continue from a kept cache")
        return GenerationSession(lambda: (self.weights_version, weights_stamp(self.policy)))

    context_name: str = "the model's context"
    """What ``max_context`` is called in an error, with the setting that raises it."""

    def max_context(self, model_context: int | None) -> int | None:
        """The longest prompt + completion this engine generates, for a model whose own context is
        ``model_context`` (None: unknown). Checked against the data before training."""
        return model_context

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


def end_token_ids(policy: nn.Module | None, tokenizer: Any) -> tuple[int, ...]:
    """Every token id that ends a completion: the tokenizer's EOS first, then each EOS id of the model's
    ``generation_config`` (Qwen2.5-Instruct lists ``<|im_end|>`` and ``<|endoftext|>``, Llama-3.1-Instruct three).

    vLLM and ``generate()`` stop at all of them; so does every engine here, and a row ending on any of them is
    ended, not truncated.
    """
    ids = [tokenizer.eos_token_id]
    base = policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy
    generation = getattr(base, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids += [extra] if isinstance(extra, int) else list(extra or [])
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


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
        policy_logprobs=(
            torch.cat([pad(c.policy_logprobs, completion_len, 0, False) for c in chunks])
            if all(c.policy_logprobs is not None for c in chunks)
            else None
        ),
    )


def stop_lengths(tokens: Tensor, stop_sequences: tuple[tuple[int, ...], ...], min_new_tokens: int = 0) -> Tensor:
    """``[N]``: each row's length up to and including its first stop sequence; ``tokens.size(1) + 1`` for none.

    A stop sequence counts where its last token is at index ``min_new_tokens`` or later (the rule EOS follows under
    a minimum length), so that every engine ends a completion at the same token.
    """
    n, width = tokens.shape
    ends = torch.full((n,), width + 1, dtype=torch.long, device=tokens.device)
    for sequence in stop_sequences:
        k = len(sequence)
        if not k or k > width:
            continue
        target = torch.tensor(sequence, device=tokens.device)
        windows = tokens.unfold(1, k, 1)  # [N, width - k + 1, k]
        hit = (windows == target).all(-1)
        hit[:, : max(0, min_new_tokens - k + 1)] = False  # ends before index min_new_tokens
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
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    max_new_tokens: int,
    logprobs: Tensor | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    lengths: Tensor | None = None,
    min_new_tokens: int = 0,
    policy_logprobs: Tensor | None = None,
) -> Completions:
    """``Completions`` from raw generated tokens ``[N, T]`` (anything after the first end is ignored).

    A row ends at its first token among ``eos_token_id`` (one id or every EOS id of the model) or its first stop
    sequence (``stop_lengths``), and is truncated when it has neither within ``max_new_tokens`` tokens. ``lengths``
    ``[N]`` says how many of a row's tokens were generated (the rest is padding; default: all): a row the engine
    stopped short of ``max_new_tokens`` without an end (vLLM at its ``max_model_len``) is truncated there, and the
    padding after it is never taken for tokens or an EOS. The mask covers the tokens up to and including the end;
    the rest becomes ``pad_token_id`` (and log-prob 0), and trailing all-padding columns are cut off.
    """
    n, width = tokens.shape
    positions = torch.arange(width, device=tokens.device)
    generated = torch.full((n,), width, dtype=torch.long, device=tokens.device) if lengths is None else lengths
    real = positions[None, :] < generated[:, None]
    ends = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=tokens.device)
    is_eos = torch.isin(tokens, ends) & real & (positions[None, :] >= min_new_tokens)
    none = torch.full((n,), width + 1, dtype=torch.long, device=tokens.device)
    first_end = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, none)
    stops = stop_lengths(tokens.masked_fill(~real, -1), stop_sequences, min_new_tokens)
    first_end = torch.minimum(first_end, stops)
    ended = first_end <= width
    lengths = torch.where(ended, first_end, generated.clamp(max=max_new_tokens))
    keep = int(lengths.max()) if n else 0
    mask = (torch.arange(keep, device=tokens.device)[None, :] < lengths[:, None]).long()
    completion_ids = tokens[:, :keep].masked_fill(mask == 0, pad_token_id)
    if logprobs is not None:
        logprobs = logprobs[:, :keep].masked_fill(mask == 0, 0.0)
    if policy_logprobs is not None:
        policy_logprobs = policy_logprobs[:, :keep].masked_fill(mask == 0, 0.0)
    return Completions(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=completion_ids,
        completion_mask=mask,
        truncated=~ended,
        logprobs=logprobs,
        policy_logprobs=policy_logprobs,
    )


def completions_from_rows(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    rows: Sequence[Sequence[int]],
    logprob_rows: Sequence[Sequence[float]] | None,
    params: SamplingParams,
    *,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
) -> Completions:
    """``Completions`` from an engine's per-row token ids (and their log-probs) as lists, rows of a prompt's group
    adjacent: vLLM's outputs, in-process or from a server. ``params`` as requested (greedy: one row per prompt,
    no minimum length)."""
    width = max((len(ids) for ids in rows), default=1) or 1
    tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(rows), width) if logprob_rows is not None else None
    for i, ids in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        if logprobs is not None:
            logprobs[i, : len(ids)] = torch.tensor(list(logprob_rows[i]), dtype=torch.float32)
    device = prompt_ids.device
    return completions_from_tokens(
        prompt_ids,
        prompt_mask,
        tokens.to(device),
        group_size=1 if params.greedy else params.group_size,
        eos_token_id=eos_token_ids,
        pad_token_id=pad_token_id,
        max_new_tokens=params.max_new_tokens,
        logprobs=None if logprobs is None else logprobs.to(device),
        stop_sequences=params.stop_sequences,
        lengths=torch.tensor([len(ids) for ids in rows], dtype=torch.long, device=device),
        min_new_tokens=0 if params.greedy else params.min_new_tokens,
    )
