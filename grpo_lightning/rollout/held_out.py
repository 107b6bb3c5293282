"""Held-out evaluation, the data side: each batch of held-out prompts generated and scored (``HeldOutSampler``).

- ``HeldOutSampler`` (the ``collate_fn`` of the DataModules' ``val_dataloader``/``test_dataloader``): each batch of
  held-out prompts is decoded greedily and, with ``data.eval.num_samples`` = k > 0, sampled k times, with the same
  ``sample_and_score`` a training round uses; the batch it yields holds the scores.
- ``held_out_loader``: the DataLoader of a rank's share of the held-out rows, with a ``HeldOutSampler``. Every
  rank makes the same number of batches: each batch runs in ``rollout_context()``, whose gathering of a sharded
  policy (FSDP2's unshard, ZeRO-3's ``GatheredParameters``) is a collective, so a rank with one batch more would wait
  in it for the others, which wait in the metrics' sync. A rank whose share makes fewer batches gets padding
  batches (one row each, ``PADDING``), generated like the others and dropped from the scores: they count nothing.

The module side keeps the metrics (``grpo_lightning/evaluation.py: HeldOutMetrics``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from grpo_lightning.config import EvalConfig, SamplingConfig
from grpo_lightning.engines import RolloutEngine, SamplingParams
from grpo_lightning.metrics import resolve_answer_fn
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.kind import RolloutKind
from grpo_lightning.rollout.policy_side import PolicySide
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.sample_and_score import sample_and_score

PADDING = -1  # the held-out index of a padding batch's row (``held_out_loader``): its scores are dropped


class HeldOutSampler:
    """Turns a list of held-out rows into their scored completions (greedy, and k samples when asked).

    The k samples draw from a generator of their own, seeded by ``seed``, the rank and the batch's first row:
    evaluating (even in the middle of ``fit``) neither changes nor advances the training run's random stream,
    and is reproducible whatever the order in which batches are fetched. ``engine()`` returns the engine on the
    policy's current weights (``RolloutCollector.evaluation_engine``, ``integrations/sft.py: EngineHandle.current``).
    """

    def __init__(
        self,
        *,
        module: Callable[[], PolicySide],
        engine: Callable[[], RolloutEngine],
        encoder: Callable[[], PromptEncoder],
        scorer: Scorer,
        sampling: SamplingConfig,
        config: EvalConfig,
        seed: int,
        rank: int = 0,
        environment: RolloutKind | None = None,
    ) -> None:
        self.module, self.engine, self.encoder, self.scorer = module, engine, encoder, scorer
        self.environment = environment  # the round's rollout kind (None: single-turn): held-out rows use it too
        self.sampling, self.config, self.seed, self.rank = sampling, config, seed, rank
        self.answer_fn = resolve_answer_fn(config.answer_fn)

    def __call__(self, rows: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        """``rows``: ``(index in the held-out set, row)`` pairs; returns the scores of their completions (none for
        a padding batch, whose rows' index is ``PADDING``: the same keys, no rows)."""
        out = self.scores(rows)
        if all(index == PADDING for index, _ in rows):
            return {key: value if key == "pass_k" else value[:0] for key, value in out.items()}
        return out

    def scores(self, rows: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        """The scores of ``rows``' completions: greedy, and the k samples when asked."""
        columns = {key: [row[key] for _, row in rows] for key in rows[0][1]}
        module = self.module()
        engine, encoder = self.engine(), self.encoder()
        common = {
            "engine": engine,
            "encoder": encoder,
            "scorer": self.scorer,
            "device": module.device,
            "environment": self.environment,
        }
        with torch.no_grad(), module.rollout_context():
            greedy = sample_and_score(
                columns, params=SamplingParams.from_config(self.sampling, greedy=True, group_size=1), **common
            )
            # An agent's session may make several rows: per trajectory, the row whose text the rewards scored.
            greedy = greedy.per_trajectory()
            out: dict[str, Any] = {
                "reward": greedy.rewards.float(),
                "length": greedy.completion_mask.sum(-1).float(),
            }
            if greedy.correct is not None:  # None: only process rewards, nothing decides "correct"
                out["correct"] = torch.tensor(greedy.correct, dtype=torch.float32)
            k = self.config.num_samples
            if k == 0:
                return out
            seed = self.seed + 1_000_003 * (self.rank + 1) + rows[0][0]
            generator = torch.Generator(device=module.device).manual_seed(seed)
            params = SamplingParams.from_config(
                self.sampling, group_size=k, temperature=self.config.temperature, min_new_tokens=0
            )
            samples = sample_and_score(columns, params=params, generator=generator, **common).per_trajectory()
        out["sample_reward"] = samples.rewards.float()
        out["sample_length"] = samples.completion_mask.sum(-1).float()
        if samples.correct is not None:
            out["sample_correct"] = torch.tensor(samples.correct).view(-1, k)
            texts = samples.completions
            out["sample_answers"] = [[self.answer_fn(t) for t in texts[i : i + k]] for i in range(0, len(texts), k)]
            out["pass_k"] = self.config.ks
        return out


def held_out_loader(
    data: Dataset, batch_size: int, sampler: HeldOutSampler, *, rank: int = 0, world_size: int = 1
) -> DataLoader:
    """This rank's share of the held-out rows (contiguous shards, sized as ``datasets.Dataset.shard(contiguous=
    True)`` sizes them), generated and scored batch by batch by ``sampler``; as many batches on every rank, a short
    rank's last ones padding (see the module docstring)."""
    size, extra = divmod(len(data), world_size)
    start = size * rank + min(rank, extra)
    rows = [(i, data[i]) for i in range(start, start + size + (rank < extra))]
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    most = -(-(size + (extra > 0)) // batch_size)  # the batches of the largest share
    batches += [[(PADDING, data[0])] for _ in range(most - len(batches))]
    return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=sampler)
