"""``RolloutDataModule``: the prompt stream, and one freshly generated rollout per epoch.

One epoch is one rollout round: ``train_dataloader()`` (called at every epoch start, with
``Trainer(reload_dataloaders_every_n_epochs=1)``) takes the next ``prompts_per_round`` prompts of this rank,
has the policy generate and score G completions for each, and serves that rollout for μ passes in
mini-batches (one optimizer step each) of micro-batches (one forward each).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, load_dataset
from lightning import LightningDataModule
from torch.utils.data import DataLoader

from grpo_lightning.config import ConfigError
from grpo_lightning.rewards import check_required_columns
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.curriculum import CurriculumConfig, CurriculumSampler
from grpo_lightning.rollout.round import collect_rollout
from grpo_lightning.strategies import rollout_context
from grpo_lightning.tasks import is_task, load_task
from grpo_lightning.validation import check_prompts, check_ranges

log = logging.getLogger(__name__)

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_prompts(
    source: str,
    split: str,
    *,
    subset: str | None = None,
    task_kwargs: dict | None = None,
    setting: str = "data.dataset",
) -> Dataset:
    """A built-in task's split, a local jsonl/json/parquet/csv file, or a split of a Hub dataset.

    ``setting`` names the config key that gave ``source``, for error messages.
    """
    if is_task(source):
        splits = load_task(source, **(task_kwargs or {}))
        if split not in splits:
            raise ConfigError(f"task {source!r} has no split {split!r}; it has {', '.join(splits)}")
        return splits[split]
    suffix = Path(source).suffix.lower()
    if suffix in _FILE_FORMATS:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{setting}: no such file {source!r}")
        if path.stat().st_size == 0 or (suffix != ".parquet" and not path.read_text(errors="replace").strip()):
            raise ConfigError(f"{setting}: the file {source!r} is empty; it needs at least one row")
        # A local file is one split: the file itself (``split`` names the split of a Hub dataset only).
        try:
            return load_dataset(_FILE_FORMATS[suffix], data_files=source, split="train")
        except Exception as err:  # a malformed file: name it, with the reader's own words
            raise ConfigError(f"{setting}: cannot read {source!r} as {_FILE_FORMATS[suffix]}: {err}") from err
    return load_dataset(source, subset, split=split)


def _collate_rows(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {key: [row[key] for row in rows] for key in rows[0]}


class RolloutDataModule(LightningDataModule):
    """Prompts from a built-in task, a local file or the Hub; a generated rollout each epoch."""

    def __init__(
        self,
        dataset: str = "arithmetic",
        subset: str | None = None,
        task_kwargs: dict[str, Any] | None = None,
        train_split: str = "train",
        val_dataset: str | None = None,
        val_split: str | None = "test",
        prompt_column: str = "prompt",
        prompts_per_round: int = 16,
        mini_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        val_batch_size: int = 128,
        val_limit: int | None = None,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        seed: int = 0,
        curriculum: CurriculumConfig | None = None,
    ) -> None:
        """
        Args:
            dataset: built-in task name (``arithmetic``), a local ``.jsonl/.json/.parquet/.csv`` file, or a Hub name.
            subset: the Hub dataset's configuration name, if it has several.
            task_kwargs: options of the built-in task.
            train_split: split of ``dataset`` to train on.
            val_dataset: held-out source (same kinds as ``dataset``); defaults to ``dataset``'s ``val_split``.
            val_split: held-out split; ``None`` disables validation.
            prompt_column: the column holding the prompt text.
            prompts_per_round: prompts per rank per round; the rollout has ``prompts_per_round × G`` completions.
            mini_batch_size: completions per optimizer step (default: the whole rollout, one step per pass).
            micro_batch_size: completions per forward/backward; ``mini / micro`` must equal
                ``trainer.accumulate_grad_batches``.
            val_batch_size: prompts per validation batch.
            val_limit: evaluate on the first ``val_limit`` held-out prompts only.
            dynamic_sampling: DAPO dynamic sampling: drop groups whose (outcome) rewards are all equal and draw
                more prompts until the rollout is full of informative groups.
            max_sampling_rounds: cap on generations per round with dynamic sampling (then the rollout is topped
                up with uninformative groups, so its size never changes).
            seed: seed of the prompt order (one shuffle per pass over the dataset).
            curriculum: draw prompts by their recent pass rate instead of in shuffled order, preferring those
                neither always nor never solved (``rollout/curriculum.py``); logs ``curriculum/`` metrics.
        """
        super().__init__()
        if prompts_per_round < 1:
            raise ConfigError(f"data.prompts_per_round must be >= 1 (got {prompts_per_round})")
        self.source, self.subset, self.task_kwargs = dataset, subset, task_kwargs or {}
        self.train_split, self.val_dataset, self.val_split = train_split, val_dataset, val_split
        self.prompt_column, self.prompts_per_round = prompt_column, prompts_per_round
        self.mini_batch_size, self.micro_batch_size = mini_batch_size, micro_batch_size
        self.val_batch_size, self.val_limit, self.seed = val_batch_size, val_limit, seed
        if max_sampling_rounds < 1:
            raise ConfigError(f"data.max_sampling_rounds must be >= 1 (got {max_sampling_rounds})")
        check_ranges(
            "data",
            {
                "mini_batch_size": mini_batch_size,
                "micro_batch_size": micro_batch_size,
                "val_batch_size": val_batch_size,
                "val_limit": val_limit,
            },
        )
        self.dynamic_sampling, self.max_sampling_rounds = dynamic_sampling, max_sampling_rounds
        self.train_data: Dataset | None = None
        self.val_data: Dataset | None = None
        # The resumable place in the prompt stream: prompts consumed so far, over all ranks. Each rank keeps its
        # own: with dynamic sampling a rank that refills more often advances further (it uses its own slot of
        # each window of prompts_per_round × world prompts, so the ranks never draw the same prompt).
        self.position = 0
        self.last_rollout: RolloutBatch | None = None
        self._order: tuple[int, torch.Tensor] | None = None  # (pass over the dataset, its shuffled order)
        self.curriculum = CurriculumSampler(curriculum, seed) if curriculum is not None else None

    # ----------------------------------------------------------------------------------------------- data
    def _prepare(self, data: Dataset, where: str) -> Dataset:
        if len(data) == 0:
            raise ConfigError(f"{where} is empty: it needs at least one row")
        if self.prompt_column not in data.column_names:
            raise ConfigError(
                f"{where} has no prompt column {self.prompt_column!r} (columns: {', '.join(data.column_names)}); "
                "set data.prompt_column"
            )
        if self.prompt_column != "prompt":
            if "prompt" in data.column_names:
                data = data.remove_columns("prompt")
            data = data.rename_column(self.prompt_column, "prompt")
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None:
            check_required_columns(module.reward_specs, data.column_names, where)
        return data

    def setup(self, stage: str) -> None:
        """Load and check the prompts (before any model is built): columns, prompts, lengths, batch sizes."""
        if stage == "fit" and self.train_data is None:
            data = load_prompts(self.source, self.train_split, subset=self.subset, task_kwargs=self.task_kwargs)
            where = f"data.dataset ({self.source}, split {self.train_split})"
            self.train_data = self._prepare(data, where)
            self._check_batch_sizes()
            self._check_prompts(self.train_data, where)
        if self.val_split is not None and self.val_data is None:
            source = self.val_dataset or self.source
            setting = "data.val_dataset" if self.val_dataset else "data.dataset"
            data = load_prompts(
                source, self.val_split, subset=self.subset, task_kwargs=self.task_kwargs, setting=setting
            )
            if self.val_limit is not None:
                data = data.select(range(min(self.val_limit, len(data))))
            where = f"validation data ({source}, split {self.val_split})"
            self.val_data = self._prepare(data, where)
            self._check_prompts(self.val_data, where)

    def _check_prompts(self, data: Dataset, where: str) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None:
            check_prompts(module, data, where)  # non-empty, and prompt + completion within the model's context

    def _check_batch_sizes(self) -> None:
        rollout = self.prompts_per_round * self.trainer.lightning_module.sampling.group_size
        mini = self.mini_batch_size or rollout
        micro = self.micro_batch_size or mini
        if rollout % mini:
            raise ConfigError(
                f"data.mini_batch_size ({mini}) must divide the rollout of prompts_per_round × group_size = {rollout}"
            )
        if mini % micro:
            raise ConfigError(f"data.micro_batch_size ({micro}) must divide data.mini_batch_size ({mini})")
        accumulate = self.trainer.accumulate_grad_batches
        if mini // micro != accumulate:
            raise ConfigError(
                f"data.mini_batch_size / data.micro_batch_size = {mini // micro} but "
                f"trainer.accumulate_grad_batches = {accumulate}: set them to agree"
            )

    def next_prompts(self) -> dict[str, list[Any]]:
        """This rank's next ``prompts_per_round`` rows; the stream position advances for all ranks at once."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        start = self.position + rank * self.prompts_per_round
        if self.curriculum is not None:  # the curriculum picks the prompts; the position still counts them
            indices = self.curriculum.draw(len(self.train_data), self.prompts_per_round, rank=rank, world_size=world)
        else:
            indices = [self._stream_index(start + i) for i in range(self.prompts_per_round)]
        self.position += self.prompts_per_round * world
        return _collate_rows([self.train_data[i] for i in indices])

    def _stream_index(self, position: int) -> int:
        # The stream walks the dataset in a fresh seeded shuffle per pass, so it is a pure function of position.
        size = len(self.train_data)
        epoch = position // size
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(size, generator=generator))
        return int(self._order[1][position % size])

    # ----------------------------------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module
        sum_across_ranks = None
        if self.trainer.world_size > 1:
            sum_across_ranks = lambda t: module.all_gather(t).sum(0)  # noqa: E731
        rollout_size = self.prompts_per_round * module.sampling.group_size  # dynamic sampling keeps it fixed
        mini = self.mini_batch_size or rollout_size
        # The Trainer's precision as in training_step; FSDP2: the policy's weights gathered once for the round.
        with rollout_context(module):
            self.last_rollout = collect_rollout(
                module,
                self.next_prompts,
                optimizer_steps=module.objective.num_iterations * (rollout_size // mini),
                dynamic_sampling=self.dynamic_sampling,
                max_sampling_rounds=self.max_sampling_rounds,
                all_gather=module.all_gather,
            )
        if self.curriculum is not None:  # feed the round's pass rates back; adds curriculum/ metrics to the rollout
            self.curriculum.observe(self.last_rollout, lambda i: self.train_data[i]["prompt"], module)
        batches = self.last_rollout.micro_batches(
            micro_batch_size=self.micro_batch_size or mini,
            mini_batch_size=mini,
            num_iterations=module.objective.num_iterations,
            generator=torch.Generator().manual_seed(self.seed + self.position),
            sum_across_ranks=sum_across_ranks,
        )
        # The batches are ready-made: no sampler, no worker processes, nothing for Lightning to re-split. A
        # generator of its own: creating an iterator draws a seed, and from the global RNG that draw would differ
        # between a resumed run and an uninterrupted one (Lightning creates one iterator fewer on resume).
        return DataLoader(batches, batch_size=None, shuffle=False, generator=torch.Generator())

    def val_dataloader(self) -> DataLoader | list:
        if self.val_split is None:
            return []  # validation off: Lightning skips an empty loader list
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def _eval_loader(self) -> DataLoader:
        if self.val_data is None:
            raise ConfigError("no held-out data: set data.val_split (and data.val_dataset for local files)")
        data = self.val_data
        if self.trainer is not None and self.trainer.world_size > 1:
            data = data.shard(num_shards=self.trainer.world_size, index=self.trainer.global_rank, contiguous=True)
        return DataLoader(data, batch_size=self.val_batch_size, shuffle=False, collate_fn=_collate_rows)

    # ------------------------------------------------------------------------------------- checkpoints
    def _positions_of_all_ranks(self) -> list[int]:
        """Every rank's stream position (a collective under data parallelism: called on every rank, as Lightning
        calls ``state_dict`` when it saves a checkpoint)."""
        if self.trainer is None or self.trainer.world_size == 1:
            return [self.position]
        strategy = self.trainer.strategy
        gathered = strategy.all_gather(torch.tensor(self.position, device=strategy.root_device))
        return [int(p) for p in gathered.flatten().tolist()]

    def state_dict(self) -> dict[str, Any]:
        """The place in the prompt stream of every rank; the order is a function of the seed and the position."""
        positions = self._positions_of_all_ranks()
        state = {
            "position": positions[0],  # rank 0's, as checkpoints without ``positions`` have it
            "positions": positions,
            "seed": self.seed,
            "dataset": self.source,
            "prompts_per_round": self.prompts_per_round,
        }
        if self.curriculum is not None:  # the per-prompt pass rates: a key of its own
            state["curriculum"] = self.curriculum.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the prompt stream where the checkpoint left it (the data settings should be the same)."""
        positions = state_dict.get("positions") or [state_dict.get("position")]
        if not all(isinstance(p, int) and p >= 0 for p in positions):
            raise ConfigError(f"the checkpoint's prompt stream position is {positions!r}, not a count of prompts")
        world = self.trainer.world_size if self.trainer is not None else 1
        rank = self.trainer.global_rank if self.trainer is not None else 0
        if len(positions) == world:
            position = positions[rank]
        else:
            # Another number of processes: continue after the furthest rank, so no prompt is drawn twice.
            position = max(positions)
            if "positions" in state_dict:
                log.warning(
                    "the checkpoint's prompt stream was drawn by %d processes, this run has %d: continuing at %d",
                    len(positions),
                    world,
                    position,
                )
        self.position = position
        changed = [
            f"data.{key}={state_dict[key]!r}"
            for key, value in (
                ("seed", self.seed),
                ("dataset", self.source),
                ("prompts_per_round", self.prompts_per_round),
            )
            if key in state_dict and state_dict[key] != value
        ]
        if changed:
            # Allowed (a new dataset or seed can be intended), but the run then differs from an uninterrupted one.
            log.warning(
                "resuming a prompt stream made with %s; it continues at position %d", ", ".join(changed), position
            )
        if self.curriculum is not None and "curriculum" in state_dict:
            self.curriculum.load_state_dict(state_dict["curriculum"])
