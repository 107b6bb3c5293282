"""The entropy terms over two processes (gloo): the quantile of the top-entropy mask is taken over both ranks'
tokens, and the adaptive coefficient measures the token-weighted entropy of both, with the collectives Lightning's
DDP strategy runs for ``GRPOModule.all_gather`` and ``strategy.reduce``. The ranks' micro-batches differ in shape
and token count, so a per-rank quantile, a padded-value leak or a mean of the ranks' means would show.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available

from grpo_lightning.losses.entropy import EntropyControl, entropy_threshold

SHAPES = [(3, 5, [5, 2, 0]), (2, 9, [9, 4])]  # rows, padded length, tokens per row: 7 and 13 loss tokens


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, length, lengths = SHAPES[rank]
    entropy = torch.rand(rows, length, generator=torch.Generator().manual_seed(rank)) * (1 + 3 * rank)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    entropy = torch.where(mask, entropy, torch.full_like(entropy, 1e6))  # padding far above any entropy
    return entropy, mask


def worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        entropy, mask = rank_batch(rank)
        control = EntropyControl(0.1, quantile=0.25, adaptive=True, target=1.5, delta=0.05)
        settings = control.loss_settings(entropy, mask, lambda t: _all_gather_ddp_if_available(t))
        threshold = entropy_threshold(entropy, mask, 0.25, pool=settings["entropy_pool"])
        control.accumulate(entropy, mask)  # every loss token
        control.step(lambda t, reduce_op: _sync_ddp_if_available(t, reduce_op=reduce_op))
        result = {"threshold": float(threshold), "coef": control.coef, "measured": control.last_entropy}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_the_quantile_and_the_measured_entropy_span_both_ranks(tmp_path):
    args = (f"file://{tmp_path / 'rendezvous'}", str(tmp_path))
    mp.start_processes(worker, args=args, nprocs=2, join=True, start_method="fork")  # no re-import: seconds
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    batches = [rank_batch(rank) for rank in range(2)]
    tokens = torch.cat([entropy[mask] for entropy, mask in batches])
    assert tokens.numel() == 7 + 13
    expected = float(torch.quantile(tokens, 0.75))
    alone = [float(entropy_threshold(entropy, mask, 0.25)) for entropy, mask in batches]
    for result in results:
        assert abs(result["threshold"] - expected) < 1e-6
        assert abs(result["measured"] - float(tokens.mean())) < 1e-6  # token-weighted, not the ranks' mean
        assert result["coef"] == results[0]["coef"]  # the ranks agree
    assert all(abs(a - expected) > 1e-3 for a in alone)  # one rank's own quantile would differ
    means = [float(entropy[mask].mean()) for entropy, mask in batches]
    assert abs(sum(means) / 2 - float(tokens.mean())) > 1e-3
