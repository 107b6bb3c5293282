"""``GenerationSession.resume`` gathers the kept rows of several pieces (rows that left a decoding batch at
different steps, or chunks of a call) into one batch: each row's kept columns bit for bit, zeros where a wider piece
has columns the row's piece lacks (never NaN: a masked column still meets attention's weighted sum), ``room`` spare
columns, the rows in the order ``select`` asked for."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.engines.continuation import GenerationSession, Kept, KeptRows

LAYERS, HEADS, DIM = 3, 2, 4


def piece(rows: int, width: int, capacity: int, seed: int) -> KeptRows:
    """A piece as a decoder leaves it: buffers of ``capacity`` columns whose first ``width`` are filled (NaN after:
    never read), each row's tokens in its first valid columns."""
    generator = torch.Generator().manual_seed(seed)

    def buffers() -> list[torch.Tensor]:
        filled = [torch.randn(rows, HEADS, width, DIM, generator=generator) for _ in range(LAYERS)]
        return [torch.cat([f, torch.full((rows, HEADS, capacity - width, DIM), float("nan"))], dim=2) for f in filled]

    counts = torch.randint(1, width + 1, (rows,), generator=generator)
    valid = torch.arange(width)[None, :] < counts[:, None]
    tokens = [[seed * 100 + row * 10 + j for j in range(int(c))] for row, c in enumerate(counts)]
    return KeptRows(buffers(), buffers(), valid, tokens)


@pytest.mark.parametrize("room", [None, 0, 6])
def test_resume_gathers_the_chosen_rows_of_every_piece(room):
    pieces = [piece(5, 9, 20, 1), piece(3, 4, 11, 2), piece(6, 13, 13, 3)]
    index = [(p, r) for p, kept in enumerate(pieces) for r in range(len(kept))]
    session = GenerationSession(stamp=lambda: 0)
    session.store(Kept(pieces, index))
    order = [13, 0, 6, 2, 9, 5, 11, 7]  # rows of every piece, in another order; the others leave
    session.select(order)
    chosen = [index[i] for i in order]
    contexts = [pieces[p].tokens[r] + [7, 8] for p, r in chosen]  # each row's kept tokens, then two new ones
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[0] * (width - len(c)) + c for c in contexts])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    resume = session.resume(0, len(order), ids, mask, room=room)
    kept = resume.kept
    columns = 13 + (0 if room is None else 2 + room)  # the widest piece, and the new tokens' and room's columns
    assert kept.width == 13 and kept.tokens == [pieces[p].tokens[r] for p, r in chosen]
    for i, (p, r) in enumerate(chosen):
        source, own = pieces[p], pieces[p].width
        assert torch.equal(kept.valid[i, :own], source.valid[r]) and not kept.valid[i, own:].any()
        for gathered, sources in ((kept.keys, source.keys), (kept.values, source.values)):
            for target, layer in zip(gathered, sources):
                assert target.shape == (len(order), HEADS, columns, DIM)
                assert torch.equal(target[i, :, :own], layer[r, :, :own])  # bit for bit
                assert torch.equal(target[i, :, own:13], torch.zeros(HEADS, 13 - own, DIM))
    assert resume.new_ids.tolist() == [[7, 8]] * len(order) and resume.positions.tolist() == [
        [len(c) - 2, len(c) - 1] for c in contexts
    ]
    assert session.reused_tokens == sum(len(c) - 2 for c in contexts) and session.prefilled_tokens == 2 * len(order)
