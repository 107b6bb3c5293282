"""``RolloutBatch``: one round's completions with everything the loss needs, and its split into micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo_lightning.models.logprobs import logprob_layout
from grpo_lightning.update_plan import UpdatePlan


@dataclass
class RolloutBatch:
    """The tensors of one rollout round (N = prompts × G rows, groups adjacent; more where an agent's session made
    several rows: ``trajectory``) and the texts behind them."""

    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T] right-padded
    completion_mask: Tensor  # [N, T] generated tokens (up to and including EOS)
    truncated: Tensor  # [N] bool: hit the length limit
    rewards: Tensor  # [N] weighted total reward
    loss_mask: Tensor | None = None  # [N, T] tokens that count in the loss (default: completion_mask)
    # [N, T] the policy's own tokens, in multi-turn rollouts (environment tokens are context only); None: all.
    action_mask: Tensor | None = None
    advantages: Tensor | None = None  # [N] (or [N, T] for process rewards)
    old_logprobs: Tensor | None = None  # [N, T], only when the round has more than one optimizer step
    ref_logprobs: Tensor | None = None  # [N, T], only when β > 0
    # [N, T] the engine's own log-probs of the sampled tokens: π_old when they are the trainer's; kept for the
    # importance correction when the engine is not the trainer (vLLM); else None.
    engine_logprobs: Tensor | None = None
    # [N, T] the sampler's log-probs of the same tokens under the tempered policy, unfiltered (lean, transformers:
    # ``Completions.policy_logprobs``): π_old without a pass when the sampler is the trainer; None otherwise.
    policy_logprobs: Tensor | None = None
    prompts: list[str] = field(default_factory=list)  # [N] texts, for logging and reward functions
    completions: list[str] = field(default_factory=list)
    reward_columns: dict[str, list[float | None]] = field(default_factory=dict)  # every source's (``Scores``)
    reward_weights: dict[str, float] = field(default_factory=dict)  # their weights (``combine.column_weight``)
    step_rewards: Tensor | None = None  # [N, S] process rewards per step (NaN = no such step)
    step_ends: Tensor | None = None  # [N, S] token index where each step ends
    correct: list[bool] | None = None  # [N] the accuracy reward >= 1 (None when no outcome reward decides it)
    # Multi-turn rollouts: every turn and observation as text, and per-trajectory counts (turns, tokens, tool
    # calls, ...); ``completions`` then holds the final turns, which the rewards scored.
    transcripts: list[str] = field(default_factory=list)
    turn_stats: dict[str, list[float]] = field(default_factory=dict)
    # What reward functions logged through TRL's ``log_extra`` (one value per row) and ``log_metric`` (scalars).
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    reward_log: dict[str, float] = field(default_factory=dict)
    # [N] True where no reward applied (every one returned None): out of its group's baseline, advantage 0.
    unscorable: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # How the round was sampled, for the loss: the temperature of π_old (the update's log-probs use the same),
    # and the length limit (Dr. GRPO's constant normaliser).
    temperature: float = 1.0
    max_new_tokens: int = 0
    pack_tokens: int | str | None = None  # ``data.update.pack_tokens``: packed or padded log-prob passes
    # [N] each row's trajectory, rows of one adjacent (an agent's session may make several rows:
    # ``integrations/agents/``): group statistics and advantages are per trajectory, each row taking its trajectory's.
    # None: row i is trajectory i.
    trajectory: Tensor | None = None
    # [N] True on the row of each trajectory whose text the rewards scored (an agent session's last call's row):
    # what stands for the trajectory in ``per_trajectory``. None: each trajectory's first row.
    scored: Tensor | None = None
    agent_log: dict[str, float] = field(
        default_factory=dict
    )  # the round's ``agent/`` counts (``integrations/agents/rollout.py``)
    # [N] a vision-language model's image inputs of each row's prompt (``integrations/vision/inputs.py``; {} for a
    # text-only row), on the CPU: each forward joins its own rows'. Empty for a text model.
    vision: list[dict[str, Tensor]] = field(default_factory=list)
    images: list[list[Any]] = field(default_factory=list)  # [N] its prompt's images (PIL), for the logs' tables

    def __len__(self) -> int:
        return self.completion_ids.size(0)

    def trajectory_starts(self) -> Tensor:
        """``[N]`` bool: the row is its trajectory's first (every row when rows are trajectories)."""
        if self.trajectory is None:
            return torch.ones(len(self), dtype=torch.bool, device=self.rewards.device)
        t = self.trajectory
        return torch.cat([torch.ones_like(t[:1], dtype=torch.bool), t[1:] != t[:-1]])

    def per_trajectory(self) -> RolloutBatch:
        """One row per trajectory (the one whose text the rewards scored, ``scored``, else its first; all of a
        trajectory's rows share its reward): what group statistics and held-out metrics are taken over. The batch
        itself when its rows are its trajectories."""
        if self.trajectory is None:
            return self
        return self.select((self.trajectory_starts() if self.scored is None else self.scored).nonzero().squeeze(1))

    def trajectory_values(self, values: Tensor) -> Tensor:
        """``values`` of each trajectory (``[K, ...]``, in order) for each of its rows (``[N, ...]``)."""
        if self.trajectory is None:
            return values
        return values[(self.trajectory_starts().long().cumsum(0) - 1).to(values.device)]

    def group_rows(self, group: int, group_size: int) -> Tensor:
        """The rows of the ``group``-th group (its ``group_size`` trajectories)."""
        ordinal = self.trajectory_starts().long().cumsum(0) - 1
        return (ordinal // group_size == group).nonzero().squeeze(1)

    def select(self, rows: Tensor) -> RolloutBatch:
        """The rows ``rows`` (a 1-D index tensor) of every per-row field."""
        index = rows.tolist()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                out[f.name] = value[rows.to(value.device)]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in index] if value else []
            elif f.name in _PER_ROW_COLUMNS:
                out[f.name] = {name: [values[i] for i in index] for name, values in value.items()}
            else:
                out[f.name] = value
        return RolloutBatch(**out)

    @staticmethod
    def concat(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
        """Rows of ``batches`` one after the other; prompts padded on the left, completions on the right."""
        if len(batches) == 1:
            return batches[0]
        out = {}
        for f in fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if f.name == "trajectory" and values[0] is not None:
                out[f.name] = _numbered_apart(values)
            elif isinstance(values[0], Tensor):
                out[f.name] = _cat_padded(values, f.name, pad_token_id)
            elif isinstance(values[0], list):
                out[f.name] = [item for value in values for item in value]
            elif f.name == "reward_weights":  # a column's weight is its source's, the same in every draw
                out[f.name] = {name: weight for value in values for name, weight in value.items()}
            elif f.name in ("reward_log", "agent_log"):  # a draw's scalars: their mean over the draws that logged them
                names = list(dict.fromkeys(name for value in values for name in value))
                out[f.name] = {n: sum(v[n] for v in values if n in v) / sum(n in v for v in values) for n in names}
            elif f.name in _PER_ROW_COLUMNS:
                # Draws of one round can differ in names: an environment reports a metric or reward part only
                # when a trajectory earned it. All names of all draws, each row filled where its draw lacked it.
                names = list(dict.fromkeys(name for value in values for name in value))
                out[f.name] = {name: [v for b in batches for v in _column(b, f.name, name)] for name in names}
            else:
                out[f.name] = values[0]
        return RolloutBatch(**out)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device`` (a background process sends its rollouts on the CPU)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()})

    def column_names(self) -> dict[str, list[str]]:
        """The names of each per-row dict column (``reward_columns``, ``turn_stats``), in their order."""
        return {column: list(getattr(self, column)) for column in _PER_ROW_COLUMNS}

    def align_columns(self, names: dict[str, list[str]]) -> None:
        """Give each per-row dict column exactly ``names[column]``, in that order (a name missing here is filled
        as ``concat`` fills it): under data parallelism every rank then has the same reward and turn columns, and
        so summarises and logs the same metrics."""
        for column, wanted in names.items():
            missing = set(getattr(self, column)) - set(wanted)
            if missing:
                raise ValueError(f"align_columns: {column} {sorted(missing)} would be dropped")
            setattr(self, column, {name: _column(self, column, name) for name in wanted})

    def tensors(self, rows: Tensor) -> dict[str, Any]:
        """The loss inputs of ``rows``, trimmed to their longest completion.

        Also ``layout`` (``grpo_lightning.models.logprobs.LogprobLayout``): what the update's forward would otherwise
        read from the masks, with a device sync each time. Found here, at rollout time, for every micro-batch of the
        μ passes, it leaves the update's lean forward without host-device round trips.
        """
        mask = self.completion_mask[rows]
        keep = int(mask.sum(0).nonzero().max()) + 1 if bool(mask.any()) else 1
        loss_mask = self.completion_mask if self.loss_mask is None else self.loss_mask
        advantages = self.advantages[rows]
        prompt_ids, prompt_mask = self.prompt_ids[rows], self.prompt_mask[rows]
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": self.completion_ids[rows, :keep],
            "completion_mask": mask[:, :keep],
            "loss_mask": loss_mask[rows, :keep],
            "advantages": advantages if advantages.dim() == 1 else advantages[:, :keep],
            "layout": logprob_layout(prompt_ids, prompt_mask, mask[:, :keep]),
            "temperature": self.temperature,
            "max_completion_length": self.max_new_tokens,
            "pack_tokens": self.pack_tokens,
        }
        if self.old_logprobs is not None:
            batch["old_logprobs"] = self.old_logprobs[rows, :keep]
        if self.ref_logprobs is not None:
            batch["ref_logprobs"] = self.ref_logprobs[rows, :keep]
        if self.engine_logprobs is not None:
            batch["engine_logprobs"] = self.engine_logprobs[rows, :keep]
        if self.vision:
            batch["vision"] = [self.vision[i] for i in rows.tolist()]
        return batch

    def micro_batches(
        self,
        plan: UpdatePlan,
        *,
        generator: torch.Generator,
        sum_across_ranks: Callable[[Tensor], Tensor] | None = None,
        balance_tokens: bool = False,
    ) -> list[dict[str, Any]]:
        """The round cut as ``plan`` says: μ shuffled passes, each in ``plan.mini_batches_per_pass`` mini-batches
        (one optimizer step each) of ``plan.micro_batches_per_step`` micro-batches (the trainer's fixed gradient
        accumulation). The micro-batches of a mini-batch hold equal row counts, or with ``balance_tokens`` equal
        completion-token counts (rows assigned longest first to the micro-batch with the fewest tokens,
        ``balanced_split``), so that a step's peak memory does not depend on where its long completions fell.

        Each micro-batch carries ``num_items`` and ``num_rows``: the loss tokens and the rows of its whole
        mini-batch, summed over ranks by ``sum_across_ranks`` under data parallelism, so that every aggregation but
        ``micro_batch_token_mean`` makes the same step whatever the micro-batches hold or the number of ranks.

        The counts are planned on trajectories: where an agent's sessions made more rows than trajectories, each
        pass still makes the plan's mini-batches and micro-batches, the extra rows spread over them (a few more rows
        per micro-batch).
        """
        n = len(self)
        loss_mask = self.completion_mask if self.loss_mask is None else self.loss_mask
        trajectories = n if self.trajectory is None else int(self.trajectory_starts().sum())
        if trajectories != plan.rows_per_round:  # the settings fix a round's size; a mismatch is a bug
            raise RuntimeError(f"the round has {trajectories} trajectories, {plan.rows_per_round} were planned")
        minis = [
            mini
            for order in (torch.randperm(n, generator=generator) for _ in range(plan.num_iterations))
            for mini in order.tensor_split(plan.mini_batches_per_pass)
        ]
        tokens = torch.stack([loss_mask[mini.to(loss_mask.device)].sum() for mini in minis]).float()
        counts = torch.tensor([float(len(mini)) for mini in minis], device=tokens.device)
        totals = torch.stack([tokens, counts])
        if sum_across_ranks is not None:
            totals = sum_across_ranks(totals)
        lengths = self.completion_mask.sum(1).cpu() if balance_tokens else None
        parts = plan.micro_batches_per_step
        out = []
        for mini, num_items, num_rows in zip(minis, *totals.cpu()):
            for rows in balanced_split(mini, parts, lengths) if lengths is not None else mini.tensor_split(parts):
                batch = self.tensors(rows.to(loss_mask.device))
                batch["num_items"], batch["num_rows"] = num_items, num_rows
                out.append(batch)
        return out


def balanced_split(rows: Tensor, parts: int, lengths: Tensor) -> list[Tensor]:
    """``rows`` in ``parts`` groups of near-equal total ``lengths[row]``: longest first, each to the group with the
    fewest tokens (then the fewest rows, then the first); every group keeps ``rows``' order. Deterministic."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [(0, 0, g) for g in range(parts)]  # (tokens, rows, group)
    order = sorted(range(len(rows)), key=lambda i: (-int(lengths[rows[i]]), i))
    for i in order:
        tokens, count, g = min(load)
        groups[g].append(i)
        load[g] = (tokens + int(lengths[rows[i]]), count + 1, g)
    return [rows[sorted(group)] for group in groups if group]


_PER_ROW_COLUMNS = ("reward_columns", "turn_stats", "extra_columns")  # dicts of one value per row


def _column(batch: RolloutBatch, column: str, name: str) -> list[Any]:
    """``batch.<column>[name]``, filled where the batch has no such name. The only names that can be missing are an
    environment's or an agent's: a turn count or metric (``turn_stats``: a trajectory that made no tool call made 0)
    and a reward part (``env_<name>``, ``agent_<name>`` of ``reward_columns``: no trajectory of this batch earned it,
    so each is None there, "not applicable", as ``multiturn`` fills a part one trajectory did not earn; a column of
    None changes no total and no row's scorability). A reward function's column is in every batch."""
    values = getattr(batch, column)
    if name in values:
        return list(values[name])
    return [None if column == "reward_columns" else 0.0] * len(batch)


def _numbered_apart(trajectories: list[Tensor]) -> Tensor:
    """Draws' ``trajectory`` columns joined, each shifted past the previous ones: no two draws share a number, so a
    draw's first row starts a trajectory of its own."""
    out, offset = [], 0
    for t in trajectories:
        out.append(t - t.min() + offset)
        offset += int(t.max() - t.min()) + 1
    return torch.cat(out)


def _cat_padded(tensors: list[Tensor], name: str, pad_token_id: int) -> Tensor:
    if tensors[0].dim() < 2:
        return torch.cat(tensors)
    width = max(t.size(1) for t in tensors)
    left = name.startswith("prompt")  # prompts are left-padded so that generation appends on the right
    value = {"prompt_ids": pad_token_id, "completion_ids": pad_token_id, "step_rewards": float("nan")}.get(name, 0)
    padded = [F.pad(t, (width - t.size(1), 0) if left else (0, width - t.size(1)), value=value) for t in tensors]
    return torch.cat(padded)


class LazyRound(torch.utils.data.Dataset):
    """The micro-batches of one round, generated when the first one is fetched (see ``rollout/datamodule.py``)."""

    def __init__(self, collect: Callable[[], list[dict[str, Any]]], length: int) -> None:
        self.collect, self.length = collect, length
        self.batches: list[dict[str, Any]] | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.batches is None:
            try:
                self.batches = self.collect()
            except StopIteration as err:  # out of here, the data loader's iterator would read it as the epoch's end
                raise RuntimeError(f"the round raised StopIteration ({err!r}): a bug in a rollout step") from err
            if len(self.batches) != self.length:  # the settings fix the count; a mismatch is a bug
                raise RuntimeError(f"the round made {len(self.batches)} micro-batches, {self.length} were planned")
        return self.batches[index]
