"""The ``transformers`` engine: the model's own ``generate()``, for any causal LM (the reference behaviour).

Slower than the ``lean`` loop (every sample of a group prefills its prompt again, and the cache grows by
concatenation), but it is exactly what ``transformers`` users know: the same logits processors, the same stopping.
Its random draws come from the caller's generator: ``generate()`` samples from torch's global RNG, so each call
runs under a forked RNG seeded from the generator, and the training run's global stream is left untouched. It
samples from ``SamplingParams`` alone: the model's ``generation_config`` (a repetition penalty, top-k, ...) is
kept out of ``generate()``, so the distribution is the one the loss and π_old model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicLayer

from grpo_lightning.engines.base import (
    Completions,
    RolloutEngine,
    SamplingParams,
    completions_from_tokens,
    concat_completions,
    eval_mode,
)
from grpo_lightning.engines.continuation import GenerationSession, Kept, Resume, kept_after_sampling, real_tokens
from grpo_lightning.engines.model_decoder import cache_kwarg


class StopOnSequences(StoppingCriteria):
    """Ends a row of ``generate()`` once its new tokens end with one of ``sequences`` (token ids) whose last token is
    at index ``min_new_tokens`` or later (the rule of ``engines.base.stop_lengths``)."""

    def __init__(self, sequences: tuple[tuple[int, ...], ...], prompt_length: int, min_new_tokens: int = 0) -> None:
        self.sequences, self.prompt_length = [s for s in sequences if s], prompt_length
        self.min_new_tokens = min_new_tokens

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: object) -> Tensor:
        done = torch.zeros(input_ids.size(0), dtype=torch.bool, device=input_ids.device)
        new = input_ids.size(1) - self.prompt_length
        if new <= self.min_new_tokens:  # the last token's index is new - 1
            return done
        for sequence in self.sequences:
            if new >= len(sequence):
                target = torch.tensor(sequence, device=input_ids.device)
                done |= (input_ids[:, -len(sequence) :] == target).all(-1)
        return done


@contextmanager
def without_model_defaults(model: nn.Module) -> Iterator[None]:
    """The model's ``generation_config`` replaced by an empty one for the block.

    transformers 5 fills every field a ``GenerationConfig`` passed to ``generate()`` leaves unset from the model's
    own (Qwen2.5-Instruct ships ``repetition_penalty``, ``top_k``, ``top_p`` and ``temperature``), and which fields
    change the distribution grows with every release (``min_p``, ``no_repeat_ngram_size``, ``sequence_bias``, ...):
    with nothing to fill from, only what the engine sets applies.
    """
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


class TransformersEngine(RolloutEngine):
    """``model.generate(do_sample=True, num_return_sequences=G, ...)`` on the policy module itself."""

    name = "transformers"
    shares_weights = True
    takes_images = True  # generate(vision=...): a vision-language model's images (its modality's inputs)
    takes_row_inputs = True  # any modality's: Modality.generation_inputs
    supports_continuation = True
    supports_partial_rollouts = True
    follows_token_types = True  # generate() makes them as the passes do (the image modality's generation_inputs)

    def generation_config(self, params: SamplingParams, group_size: int) -> GenerationConfig:
        """The whole sampling distribution, from ``params`` only: the model's ``generation_config`` never adds to it
        (see ``without_model_defaults``)."""
        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p}
        return GenerationConfig(
            do_sample=not params.greedy,
            top_k=0 if params.greedy else params.top_k,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0 if params.greedy else params.min_new_tokens,
            num_return_sequences=group_size,
            eos_token_id=list(self.eos_token_ids or [self.eos_token_id]),
            pad_token_id=self.pad_token_id,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            **sampling,
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
        session: GenerationSession | None = None,
        vision: Sequence[Mapping[str, Tensor]] | None = None,
    ) -> Completions:
        """``RolloutEngine.generate``; with a ``session`` (``open_session``), each row continues from the cache kept
        at the session's previous call (``generate()`` given the kept cache prefills only the new tokens), and this
        call's cache is kept for the next. ``vision``: each prompt's inputs beyond its ids (a vision-language model's
        images), given with its chunk of prompts as the engine's ``modality`` says (``Modality.generation_inputs``)."""
        group_size = 1 if params.greedy else params.group_size
        config = self.generation_config(params, group_size)
        modality = self.modality
        if vision is not None:  # e.g. a vision-language model's image placeholders are never a completion's tokens
            self.check_row_inputs()
            config.suppress_tokens = modality.suppressed_tokens(self.policy)
        prompts_per_chunk = max(1, params.batch_size // group_size)
        device = prompt_ids.device
        chunks, kept = [], []
        if session is not None:
            session.check_call(prompt_ids.size(0), group_size)
        for start in range(0, prompt_ids.size(0), prompts_per_chunk):
            ids, mask = prompt_ids[start : start + prompts_per_chunk], prompt_mask[start : start + prompts_per_chunk]
            resume = (
                session.resume(start, start + prompts_per_chunk, ids, mask, room=None) if session is not None else None
            )
            inputs = continued_inputs(resume, self.policy) if resume is not None else {}
            rows_per_prompt = group_size  # what generate() expands each prompt into
            if vision is not None:  # the chunk's own prompts' images, each prompt's G rows expanded here (how
                # generate() expands image inputs is the model's: Idefics3's tiles went to the wrong rows)
                ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
                rows_per_prompt = 1
                chunk_vision = modality.repeat_rows(vision[start : start + prompts_per_chunk], group_size)
                inputs = {
                    **inputs,
                    **modality.generation_inputs(self.policy, chunk_vision, ids),
                    "num_return_sequences": 1,
                }
            context = inputs.get("input_ids", ids)
            seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device)) if generator else 0
            devices = [device] if device.type == "cuda" else []
            min_new = config.min_new_tokens
            with torch.random.fork_rng(devices=devices), eval_mode(self.policy), without_model_defaults(self.policy):
                torch.manual_seed(seed)
                stopping = StoppingCriteriaList([StopOnSequences(params.stop_sequences, context.size(1), min_new)])
                out = self.policy.generate(
                    **{"input_ids": ids, "attention_mask": mask, **inputs},
                    generation_config=config,
                    stopping_criteria=stopping,
                )
            tokens = out.sequences[:, context.size(1) :]
            logprobs = policy_logprobs = None
            if return_logprobs:
                # ``scores`` are each step's logits after the processors that sampled it (the EOS ban, temperature,
                # top-k, top-p; none when greedy): the distribution the token was drawn from. ``logits`` are the
                # raw ones: tempered, the policy's (what the trainer's forward computes).
                scores = torch.stack(out.scores, dim=1).float()
                logprobs = scores.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
                raw = torch.stack(out.logits, dim=1).float()
                raw = raw / params.temperature if params.temperature != 1.0 and not params.greedy else raw
                policy_logprobs = raw.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
            chunks.append(
                completions_from_tokens(
                    ids,
                    mask,
                    tokens,
                    group_size=rows_per_prompt,
                    eos_token_id=self.eos_token_ids or self.eos_token_id,
                    pad_token_id=self.pad_token_id,
                    max_new_tokens=params.max_new_tokens,
                    logprobs=logprobs,
                    stop_sequences=params.stop_sequences,
                    min_new_tokens=min_new,
                    policy_logprobs=policy_logprobs,
                )
            )
            if session is not None:
                contexts = resume.contexts if resume is not None else None
                columns = inputs["attention_mask"] if resume is not None else mask.repeat_interleave(group_size, dim=0)
                kept.append(kept_cache(out, columns, contexts, chunks[-1]))
        if session is not None:
            session.store(Kept.join(kept))
        return concat_completions(chunks, self.pad_token_id)


def _cache_of(out: object) -> object:
    # transformers 5 renamed the output's ``past_key_values`` to ``cache``.
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def continued_inputs(resume: Resume, model: nn.Module) -> dict[str, object]:
    """``generate()``'s inputs to continue from a kept cache: the kept columns (their ids do not matter: they are
    not computed again, and no processor here reads them) and the new tokens, their mask (holes where a kept
    column holds padding or tokens decoded after a turn's end: position ids are counted over it), the cache."""
    kept = resume.kept
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(kept.keys, kept.values)):
        cache.update(k, v, layer)
    filler = torch.zeros(kept.valid.shape, dtype=torch.long, device=resume.new_ids.device)
    return {
        "input_ids": torch.cat([filler, resume.new_ids], dim=1),
        "attention_mask": torch.cat([kept.valid.long(), resume.new_mask], dim=1),
        cache_kwarg(model): cache,
    }


def kept_cache(
    out: object,
    mask: Tensor,
    contexts: list[list[int]] | None,
    completions: Completions,
) -> Kept | None:
    """What a ``generate()`` call keeps for the next: its cache, when every layer is a plain ``DynamicLayer``
    (``mask``: which of the input columns hold the rows' tokens; ``contexts``: the rows' whole contexts, None: the
    prompts of ``completions``)."""
    layers = getattr(_cache_of(out), "layers", None)
    if not layers or not all(type(layer) is DynamicLayer for layer in layers):
        return None
    if contexts is None:
        contexts = real_tokens(completions.prompt_ids, completions.prompt_mask)
    width = layers[0].keys.size(-2)
    valid = torch.cat(
        [mask.bool(), torch.ones(mask.size(0), width - mask.size(1), dtype=torch.bool, device=mask.device)], 1
    )
    lengths = completions.completion_mask.sum(-1)
    keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
    return Kept.whole(
        kept_after_sampling(keys, values, valid, mask.size(1), contexts, completions.completion_ids, lengths)
    )
