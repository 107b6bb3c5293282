"""The ``lean`` engine: our own sampling loop, on the lean forward of ``grpo_lightning.models.lean_forward``.

Instead of ``generate()``: each prompt is prefilled once and its keys and values shared by the G samples of its
group (written into buffers sized for the whole completion); each decoding step computes logits for the last
position only; once at most half of the batch still decodes its finished rows leave it, and the loop stops as
soon as every sequence has ended. Prompts are left-padded, so position ids come from the attention mask. Llama,
Qwen2, Qwen3 and Mistral run on the lean forward; any other causal LM (and LoRA, FSDP2 shards) runs the same loop
on its own forward (``engines/model_decoder.py``), step by step. In a multi-turn rollout the engine keeps every
row's keys and values between turns (``open_session``, ``engines/continuation.py``): a later turn prefills only its
new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams, concat_completions, eval_mode
from grpo_lightning.engines.continuation import GenerationSession, Kept, Resume, kept_after_sampling, real_tokens
from grpo_lightning.engines.model_decoder import ModelDecoder
from grpo_lightning.engines.token_sampling import draw, filter_logits
from grpo_lightning.models.lean_decoder import LeanDecoder
from grpo_lightning.models.lean_forward import lean_unsupported

# The fewest rows a decoding batch is cut to when its finished rows leave it. Why not fewer: on CPU a matrix product
# of a few rows runs other kernels, whose sums round differently (MKL at one thread: up to 3 rows); above it, at one
# thread, each row's logits are bit for bit those of the uncut batch, so the cut changes no sample. (With several
# threads, torch's CPU attention for one query rounds a row differently depending on the thread that computes it,
# measured on torch 2.13, and the cut moves rows between threads: logits then move by ~1e-6, and a sample flips
# where a draw lands that close to the edge of a token's interval.)
MIN_BATCH_ROWS = 32


@torch.no_grad()
def sample_completions(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    group_size: int,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    min_new_tokens: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    lean: bool = True,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    resume: Resume | None = None,
    keep: list[Kept | None] | None = None,
) -> Completions:
    """Sample ``group_size`` completions for each left-padded prompt in ``prompt_ids`` ``[B, P]``.

    With ``return_logprobs``, ``Completions.logprobs`` holds each drawn token's log-probability under the
    distribution it was drawn from (``engines/base.py``: tempered, EOS banned before ``min_new_tokens``, top-k and
    top-p applied, renormalised; the model's own at temperature 1 when ``greedy``), and ``policy_logprobs`` those
    of the tempered policy, unfiltered (the trainer's π_old on the same weights). With ``lean`` (and a model it
    supports, see ``grpo_lightning.models.lean_forward``), the steps run on the lean forward. A sequence ends at any of
    ``eos_token_id`` (one id or several) or after any of ``stop_sequences`` (token ids, kept in the completion),
    neither before ``min_new_tokens`` tokens. Once at most half of the batch still decodes, its finished rows leave
    it (down to ``MIN_BATCH_ROWS``); every step still draws one random number per row, as if none had left.

    ``resume`` (``engines/continuation.py``): the rows' earlier keys and values are kept, and only the tokens of
    their contexts (``prompt_ids``) after them are prefilled (``group_size`` 1). ``keep``: a list to which what the
    rows keep (``Kept``; None where this cache cannot be kept) is appended after sampling, for a later ``resume``.
    """
    decoder = LeanDecoder(model) if lean and lean_unsupported(model) is None else ModelDecoder(model)
    device = prompt_ids.device
    if resume is None:
        # The prompt is prefilled once; its keys and values are then repeated for the G samples of its group.
        logits = decoder.prefill(prompt_ids, prompt_mask, group_size, max_new_tokens)
        logits = logits.repeat_interleave(group_size, dim=0)
    else:
        kept = resume.kept
        logits = decoder.resume(kept.keys, kept.values, kept.valid, resume.new_ids, resume.new_mask, resume.positions)
    first_generated = decoder.filled  # the column of the first generated token, once it is fed back
    n = prompt_ids.size(0) * group_size

    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    logprobs = torch.zeros(n, max_new_tokens, device=device) if return_logprobs else None
    filtered = not greedy and (top_k > 0 or top_p < 1.0 or min_new_tokens > 0)
    policy_logprobs = torch.zeros(n, max_new_tokens, device=device) if return_logprobs and filtered else None
    ends = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    stops = [torch.tensor(s, device=device) for s in stop_sequences if s]
    batch = torch.arange(n, device=device)  # the rows the decoder computes (finished rows leave it)
    dropped: list[tuple[Tensor, tuple[list[Tensor], list[Tensor], Tensor] | None]] = []  # their kept state

    def spread(values: Tensor, fill: float | int) -> Tensor:  # the batch's values at their rows, ``fill`` elsewhere
        return values if values.size(0) == n else values.new_full((n,), fill).index_copy_(0, batch, values)

    for step in range(max_new_tokens):
        if policy_logprobs is not None:  # the tempered policy's, before the EOS ban and the filters
            tempered = logits.float() / temperature if temperature != 1.0 else logits.float()
            policy_all = tempered.log_softmax(-1)
        if step < min_new_tokens:
            logits[:, ends] = float("-inf")
        if greedy:
            drawn = logits.argmax(-1)
            scores = logits.float() if logprobs is not None else None  # the model's own distribution
        else:
            scores = filter_logits(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p)
            uniform = torch.rand(n, 1, device=device, generator=generator)  # every row's, as if none had left
            drawn = draw(scores, uniform=uniform if batch.numel() == n else uniform[batch])
        token = spread(drawn, pad_token_id).masked_fill(finished, pad_token_id)
        tokens[:, step] = token
        if logprobs is not None:  # of the distribution the token was drawn from
            logprobs[:, step] = spread(scores.log_softmax(-1).gather(-1, drawn[:, None]).squeeze(-1), 0.0)
            logprobs[:, step].masked_fill_(finished, 0.0)
        if policy_logprobs is not None:
            policy_logprobs[:, step] = spread(policy_all.gather(-1, drawn[:, None]).squeeze(-1), 0.0)
            policy_logprobs[:, step].masked_fill_(finished, 0.0)
        if step >= min_new_tokens:  # earlier steps cannot draw EOS: no bookkeeping, no host sync
            just_ended = ~finished & torch.isin(token, ends)
            for stop in stops:  # a tool call's close tag: the turn ends, the tag kept
                if step + 1 >= len(stop):
                    just_ended |= ~finished & (tokens[:, step + 1 - len(stop) : step + 1] == stop).all(-1)
            lengths = torch.where(just_ended, step + 1, lengths)
            finished |= just_ended
            remaining = int((~finished).sum())
            if remaining == 0:
                break
            if remaining <= batch.numel() // 2 and batch.numel() > MIN_BATCH_ROWS and decoder.selectable:
                batch = _drop_finished(decoder, batch, finished, dropped if keep is not None else None)
        if step + 1 == max_new_tokens:
            break
        logits = decoder.decode(token if batch.numel() == n else token[batch])

    if keep is not None:
        dropped.append((batch, decoder.kept()))
        contexts = resume.contexts if resume is not None else _prompt_contexts(prompt_ids, prompt_mask, group_size)
        keep.append(_kept(dropped, first_generated, contexts, tokens, lengths))
    completion_len = int(lengths.max()) if bool(finished.all()) else max_new_tokens
    tokens = tokens[:, :completion_len]
    completion_mask = (torch.arange(completion_len, device=device)[None, :] < lengths[:, None]).long()
    return Completions(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=tokens,
        completion_mask=completion_mask,
        truncated=~finished,
        logprobs=logprobs[:, :completion_len] if logprobs is not None else None,
        # unfiltered: the same tensor (the sampling distribution is the tempered policy)
        policy_logprobs=(policy_logprobs if policy_logprobs is not None else logprobs)[:, :completion_len]
        if logprobs is not None
        else None,
    )


def _drop_finished(
    decoder: LeanDecoder | ModelDecoder,
    batch: Tensor,
    finished: Tensor,
    dropped: list[tuple[Tensor, tuple[list[Tensor], list[Tensor], Tensor] | None]] | None,
) -> Tensor:
    """Cut the decoder's batch to its unfinished rows, and finished ones as ballast up to ``MIN_BATCH_ROWS`` rows
    (the first ones); returns the rows it keeps. ``dropped`` (when a cache is kept) receives the leaving rows'
    keys and values.

    Why: a finished row's decoding step is wasted work (attention over its whole context), and in a multi-turn
    rollout many turns end early (an answer without a tool call).
    """
    done = finished[batch]
    stay = (~done).nonzero().squeeze(1)
    if stay.numel() < MIN_BATCH_ROWS:
        stay = torch.cat([stay, done.nonzero().squeeze(1)[: MIN_BATCH_ROWS - stay.numel()]]).sort().values
    leave = torch.ones_like(done).index_fill_(0, stay, False).nonzero().squeeze(1)
    if dropped is not None:
        state = decoder.kept()
        if state is not None:
            keys, values, valid = state
            width = valid.size(1)
            state = [k[leave, :, :width] for k in keys], [v[leave, :, :width] for v in values], valid[leave]
        dropped.append((batch[leave], state))
    decoder.select(stay)
    return batch[stay]


def _prompt_contexts(prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> list[list[int]]:
    return [prompt for prompt in real_tokens(prompt_ids, prompt_mask) for _ in range(group_size)]


def _kept(
    parts: list[tuple[Tensor, tuple[list[Tensor], list[Tensor], Tensor] | None]],
    first_generated: int,
    contexts: list[list[int]],
    tokens: Tensor,
    lengths: Tensor,
) -> Kept | None:
    """What ``sample_completions`` keeps (``keep``): the keys and values of each group of rows that left the batch
    together (and of those that stayed to the end), each row's tokens, where each row is."""
    pieces, index = [], [(0, 0)] * len(contexts)
    for rows, state in parts:
        if rows.numel() == 0:
            continue
        if state is None:  # a cache the decoder cannot hand over (sliding-window layers, ...)
            return None
        listed = rows.tolist()
        for j, row in enumerate(listed):
            index[row] = (len(pieces), j)
        part = [contexts[row] for row in listed]
        pieces.append(kept_after_sampling(*state, first_generated, part, tokens[rows], lengths[rows]))
    return Kept(pieces, index)


class LeanEngine(RolloutEngine):
    """Samples with ``sample_completions`` from the policy module itself (shares its weights).

    ``lean_forward: false`` runs the loop on the model's own forward even where the lean forward applies.
    """

    name = "lean"
    shares_weights = True
    supports_continuation = True
    supports_partial_rollouts = True

    def __init__(self, lean_forward: bool = True) -> None:
        """
        Args:
            lean_forward: decode on ``grpo_lightning.models.lean_forward`` where the model supports it.
        """
        super().__init__()
        self.lean_forward = lean_forward

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
    ) -> Completions:
        """``RolloutEngine.generate``; with a ``session`` (``open_session``), each row continues from the keys and
        values kept at the session's previous call, and this call's are kept for the next."""
        group_size = 1 if params.greedy else params.group_size
        per_chunk = max(1, params.batch_size // group_size)
        kept: list[Kept | None] | None = None
        if session is not None:
            session.check_call(prompt_ids.size(0), group_size)
            kept = []
        chunks = []
        with eval_mode(self.policy):
            for start in range(0, prompt_ids.size(0), per_chunk):
                ids, mask = prompt_ids[start : start + per_chunk], prompt_mask[start : start + per_chunk]
                # The buffers get room for the turn's decoding steps: they are written in place.
                resume = (
                    session.resume(start, start + per_chunk, ids, mask, room=params.max_new_tokens)
                    if session is not None
                    else None
                )
                chunks.append(
                    sample_completions(
                        self.policy,
                        ids,
                        mask,
                        group_size=group_size,
                        max_new_tokens=params.max_new_tokens,
                        min_new_tokens=0 if params.greedy else params.min_new_tokens,
                        eos_token_id=self.eos_token_ids or self.eos_token_id,
                        pad_token_id=self.pad_token_id,
                        temperature=params.temperature,
                        top_k=params.top_k,
                        top_p=params.top_p,
                        greedy=params.greedy,
                        generator=generator,
                        return_logprobs=return_logprobs,
                        lean=self.lean_forward,
                        stop_sequences=params.stop_sequences,
                        resume=resume,
                        keep=kept,
                    )
                )
        if session is not None:
            session.store(Kept.join(kept))
        return concat_completions(chunks, self.pad_token_id)


def supports_lean(model: nn.Module) -> bool:
    """Whether ``model`` decodes on the lean forward (else the loop runs on the model's own forward)."""
    return lean_unsupported(model) is None
