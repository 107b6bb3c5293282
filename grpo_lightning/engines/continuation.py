"""Continuing from a kept KV cache: the later turns of a multi-turn rollout prefill only their new tokens.

A multi-turn rollout (``integrations/environments/multiturn.py``) calls the engine once per turn, each time with every
active trajectory's whole context (prompt + earlier turns + observations). An engine with ``supports_continuation``
(``lean``, ``transformers``) keeps in a ``GenerationSession`` the keys and values of the rows of its last call, and
the next call prefills only what each row's cache lacks: the observation, and the turn's last token where the
engine never fed it back. vLLM needs none of this: its prefix cache finds the shared prefix itself.

What is kept, and for how long:

- the rows of the last call, until ``GenerationSession.select`` keeps those whose trajectories go on (in the order
  the next call passes them): an ended trajectory drops out of the next batch, its keys and values with it;
- a row's cache is reused up to the longest prefix its tokens share with the row's new context (a turn the
  rollout cut before the engine's own end keeps the tokens before the cut), always leaving one new token at
  least, whose logits start the next turn;
- one rollout at most: ``generate_trajectories`` closes its session when it returns (or raises), so no cache
  outlives the round and meets the next round's weights. Besides, a session stamps the weights that filled it
  (``weights_stamp``: every parameter's storage and in-place version counter, which an optimizer step and
  ``load_state_dict`` advance) and drops its cache, prefilling in full, when they changed: keys and values of old
  weights never serve new ones.

The continuation computes what a full prefill computes, but not bit for bit: the kept keys and values were
computed in other matrix shapes (one decoding step at a time, or a narrower batch), so logits differ in the last
bits (``docs/benchmarks.md``, "Multi-turn KV reuse", for the calculator demo's figures).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class KeptRows:
    """What an engine keeps of a batch of rows after a call: each layer's keys and values, which columns hold the
    row's tokens (not padding, not what was decoded after its end) and those tokens, in order."""

    keys: list[Tensor]  # per layer [rows, kv heads, >= width, head dim]: columns [0, width) filled
    values: list[Tensor]
    valid: Tensor  # [rows, width] bool
    tokens: list[list[int]]  # each row's tokens in its valid columns, in order: their position ids are 0, 1, ...

    def __len__(self) -> int:
        return self.valid.size(0)

    @property
    def width(self) -> int:
        return self.valid.size(1)


@dataclass
class Kept:
    """What an engine keeps of one call's rows: pieces of keys and values (rows that left the decoding batch
    together are one piece), and where each row of the call is."""

    pieces: list[KeptRows]
    index: list[tuple[int, int]]  # per row of the call, in order: (piece, row in the piece)

    @staticmethod
    def whole(piece: KeptRows) -> Kept:
        """One piece holding every row, in order."""
        return Kept([piece], [(0, row) for row in range(len(piece))])

    @staticmethod
    def join(parts: Sequence[Kept | None]) -> Kept | None:
        """The parts of consecutive chunks of a call as one (None if one part was not kept)."""
        if any(part is None for part in parts):
            return None
        pieces: list[KeptRows] = []
        index: list[tuple[int, int]] = []
        for part in parts:
            index += [(len(pieces) + p, row) for p, row in part.index]
            pieces += part.pieces
        return Kept(pieces, index)


@dataclass
class Resume:
    """How a batch of rows continues from its kept cache: the cache cut to the reused prefix of every row, and the
    tokens to prefill after it."""

    kept: KeptRows  # keys and values with the free columns asked for after ``width``
    new_ids: Tensor  # [rows, C] each row's tokens after the reused prefix, left-padded
    new_mask: Tensor  # [rows, C]
    positions: Tensor  # [rows, C] their position ids (padding: 0)
    contexts: list[list[int]]  # each row's whole context, as the call gave it


def weights_stamp(module: nn.Module) -> Hashable:
    """What identifies the weights ``module`` holds now: each parameter's storage and its in-place version counter
    (advanced by optimizer steps and ``load_state_dict``; not by writes through ``.data``)."""

    def storage(p: Tensor) -> int:
        local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard: its local tensor
        return local.data_ptr()

    return tuple((storage(p), p._version) for p in module.parameters())


def real_tokens(ids: Tensor, mask: Tensor) -> list[list[int]]:
    """Each row's tokens of left-padded ``ids`` (``mask`` 1 on them), as lists."""
    width, lengths = ids.size(1), mask.sum(-1).tolist()
    return [row[width - length :] for row, length in zip(ids.tolist(), lengths)]


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class GenerationSession:
    """The kept KV cache of one multi-turn rollout, from ``RolloutEngine.open_session``; see the module docstring.

    The engine fills it (``store``) at every call that is given it and reads it (``resume``) at the next one;
    the rollout says which rows go on (``select``) and closes it at the end (``close``, or ``with``).
    ``reused_tokens`` and ``prefilled_tokens`` count the context tokens read from the cache and computed again.
    """

    def __init__(self, stamp: Callable[[], Hashable]) -> None:
        """
        Args:
            stamp: the current weights' identity (``weights_stamp`` of the engine's policy).
        """
        self._stamp_now = stamp
        self._stamp: Hashable = None
        self._pieces: list[KeptRows | None] = []  # the last call's (None: no row needs it any more)
        self._rows: list[tuple[int, int]] = []  # (piece, row) of each row the next call passes
        self.reused_tokens = self.prefilled_tokens = 0
        self.closed = False

    def __enter__(self) -> GenerationSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def holds(self) -> bool:
        """Whether keys and values are kept."""
        return any(piece is not None for piece in self._pieces)

    def rows(self) -> int:
        """How many rows the next call continues (the last call's, or those ``select`` kept)."""
        return len(self._rows)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the rows the next call would continue), in that order: the next call
        passes exactly these rows' contexts. Rows left out drop out of the next batch; a piece no row needs any
        more is released now."""
        if self.holds:
            self._rows = [self._rows[i] for i in rows]
            needed = {p for p, _ in self._rows}
            self._pieces = [piece if p in needed else None for p, piece in enumerate(self._pieces)]

    def store(self, kept: Kept | None) -> None:
        """After a call: what the engine kept of its rows, stamped with the weights that computed them. None (a
        cache it cannot hand over: sliding-window layers, ...): nothing is kept, the next call prefills in full."""
        if self.closed:
            raise RuntimeError("the generation session is closed")
        if kept is None:
            self.drop()
        else:
            self._pieces, self._rows, self._stamp = list(kept.pieces), list(kept.index), self._stamp_now()

    def drop(self) -> None:
        """Forget every kept key and value (the next call prefills in full)."""
        self._pieces, self._rows, self._stamp = [], [], None

    def close(self) -> None:
        """Release the cache; the session keeps nothing from now on."""
        self.drop()
        self.closed = True

    def check_call(self, rows: int, group_size: int) -> None:
        """Raise unless a call of ``rows`` contexts sampled ``group_size`` times each may continue the kept rows."""
        if not self.holds:
            return
        if group_size != 1:
            raise ValueError(f"a call continuing kept rows samples one completion per row (group_size {group_size})")
        if rows != self.rows():
            raise ValueError(f"the call passes {rows} contexts for {self.rows()} kept rows (GenerationSession.select)")

    def resume(self, start: int, stop: int, prompt_ids: Tensor, prompt_mask: Tensor, room: int | None) -> Resume | None:
        """How rows ``start:stop`` of the call (their whole contexts in ``prompt_ids``/``prompt_mask``,
        left-padded) continue from the cache; None when they cannot (nothing kept, the weights changed, or a row
        shares no token with its cache). ``room``: free columns the keys and values get after
        the new tokens' (an engine that writes into them); None: exactly the kept columns (one that appends)."""
        if not self.holds:
            return None
        if self._stamp != self._stamp_now():  # computed by other weights: never reused
            self.drop()
            return None
        chosen = self._rows[start:stop]
        contexts = real_tokens(prompt_ids, prompt_mask)
        # Every row keeps one token at least to prefill: its logits start the turn.
        reuse = [
            min(common_prefix(self._pieces[p].tokens[r], context), len(context) - 1)
            for (p, r), context in zip(chosen, contexts)
        ]
        if min(reuse) < 1:
            return None
        device = prompt_ids.device
        new = [context[n:] for context, n in zip(contexts, reuse)]
        chunk = max(len(ids) for ids in new)
        new_ids = torch.tensor([[0] * (chunk - len(ids)) + ids for ids in new])  # padding: any id will do (masked)
        new_mask = torch.tensor([[0] * (chunk - len(ids)) + [1] * len(ids) for ids in new])
        counts = torch.tensor(reuse)
        positions = (counts[:, None] + new_mask.cumsum(-1) - 1).clamp(min=0) * new_mask
        kept = self._gather(chosen, None if room is None else chunk + room)
        # A row cut before the end of what was kept reuses its first tokens only.
        kept.valid &= kept.valid.cumsum(-1) <= counts.to(kept.valid.device)[:, None]
        self.reused_tokens += sum(reuse)
        self.prefilled_tokens += sum(len(ids) for ids in new)
        return Resume(kept, new_ids.to(device), new_mask.to(device), positions.to(device), contexts)

    def _gather(self, chosen: list[tuple[int, int]], room: int | None) -> KeptRows:
        """The ``chosen`` rows' keys and values in one batch, columns from 0, with ``room`` spare columns."""
        pieces = sorted({p for p, _ in chosen})
        first = self._pieces[pieces[0]]
        width = max(self._pieces[p].width for p in pieces)
        n, device = len(chosen), first.valid.device
        tokens = [self._pieces[p].tokens[r] for p, r in chosen]
        if len(pieces) == 1 and room is None:  # one kept chunk, nothing to add: index it
            rows = torch.tensor([r for _, r in chosen], device=device)
            return KeptRows(
                [k[rows, :, :width] for k in first.keys],
                [v[rows, :, :width] for v in first.values],
                first.valid[rows],
                tokens,
            )

        columns = width + (room or 0)
        # Each layer's batch is allocated once and every piece's rows copied into it: one gather and one scatter
        # per piece. The spare columns are left as they are: the engine writes each before attention reads it.
        keys = [k.new_empty(n, k.size(1), columns, k.size(3)) for k in first.keys]
        values = [v.new_empty(n, v.size(1), columns, v.size(3)) for v in first.values]
        valid = torch.zeros(n, width, dtype=torch.bool, device=device)
        for p in pieces:
            piece = self._pieces[p]
            into = torch.tensor([i for i, (q, _) in enumerate(chosen) if q == p], device=device)
            rows = torch.tensor([r for q, r in chosen if q == p], device=device)
            for gathered, sources in ((keys, piece.keys), (values, piece.values)):
                for target, source in zip(gathered, sources):
                    target[:, :, : piece.width].index_copy_(0, into, source[:, :, : piece.width].index_select(0, rows))
                    # Zeros where a wider piece has columns these rows lack: masked out, but a NaN left there
                    # would still spread through attention's weighted sum (0 × NaN).
                    target[:, :, piece.width : width].index_fill_(0, into, 0.0)
            valid[:, : piece.width].index_copy_(0, into, piece.valid.index_select(0, rows))
        return KeptRows(keys, values, valid, tokens)


def kept_after_sampling(
    keys: list[Tensor],
    values: list[Tensor],
    valid: Tensor,
    first_generated: int,
    contexts: list[list[int]],
    tokens: Tensor,
    lengths: Tensor,
) -> KeptRows:
    """``KeptRows`` of a sampling call: ``valid`` ``[rows, width]`` says which of the first ``first_generated``
    columns hold the contexts; a later column holds the row's generated token ``column - first_generated`` (each
    step's token is written at the next step), valid up to the row's length (after its end: padding decoded)."""
    fed = valid.size(1) - first_generated
    steps = torch.arange(fed, device=valid.device)
    generated = steps[None, :] < lengths.to(valid.device)[:, None]
    valid = torch.cat([valid[:, :first_generated], valid[:, first_generated:] & generated], dim=1)
    counts = lengths.clamp(max=fed).tolist()
    drawn = tokens.tolist()
    return KeptRows(keys, values, valid, [c + drawn[i][: counts[i]] for i, c in enumerate(contexts)])
