"""``PromptSource``: which rows a run trains on and which it evaluates on, never the same ones.

The training rows are ``data.dataset``'s ``train_split``. The held-out rows, by rule:

- ``data.val_split: null``: none (validation off);
- ``data.val_fraction`` (e.g. 0.1): that share of the training rows, drawn by ``data.seed`` and then left out of
  training (any source: a local file, a Hub dataset with only a ``train`` split, a built-in task);
- ``data.val_dataset``: its ``val_split`` (a local file is one split: the file);
- a built-in task or a Hub dataset: its own ``val_split`` (``test``);
- a local file with neither: none, with a notice saying how to get some. A file has one split: evaluating on it
  would score the rows the policy trains on.

The split is a seeded permutation of the rows, the first ``round(n × val_fraction)`` (at least one) held out; both
parts keep the file's order. The same seed and file give the same split in ``fit``, ``validate`` and a resumed run.
Used by ``RolloutDataModule`` and ``SFTDataModule`` alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader

from grpo_lightning.config import ConfigError, EvalConfig, SamplingConfig
from grpo_lightning.engines import RolloutEngine
from grpo_lightning.modality import Modality
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.held_out import HeldOutSampler, held_out_loader
from grpo_lightning.rollout.kind import RolloutKind
from grpo_lightning.rollout.prompts import (
    PromptEncoder,
    check_chat_settings,
    check_prompt_rows,
    is_local_file,
    load_prompts,
    prompt_encoder,
    rename_prompt_column,
)
from grpo_lightning.rollout.sample_and_score import rollout_kind

log = logging.getLogger(__name__)


def split_off(data: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``(training rows, held-out rows)``: ``round(len × fraction)`` rows (at least one) drawn by ``seed``; both
    parts in the original order. Refused when no training row would be left."""
    size = len(data)
    count = max(1, round(size * fraction))
    if count >= size:
        raise ConfigError(
            f"data.val_fraction = {fraction} of {size} rows leaves no row to train on; lower it or add rows"
        )
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    held = sorted(order[:count])
    train = sorted(order[count:])
    return data.select(train), data.select(held)


@dataclass
class PromptSource:
    """The data settings that say where the training and held-out rows come from (see the module docstring)."""

    dataset: str
    subset: str | None = None
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    train_split: str = "train"
    val_dataset: str | None = None
    val_split: str | None = "test"
    val_fraction: float | None = None
    seed: int = 0
    curriculum: bool = False
    """``data.curriculum`` is set: a task with difficulty levels (``reasoning_gym:<task>``) makes rows of each."""

    def __post_init__(self) -> None:
        fraction = self.val_fraction
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
                raise ConfigError(f"data.val_fraction must be in (0, 1), or null (got {fraction!r})")
            if self.val_dataset is not None:
                raise ConfigError(
                    "data.val_fraction holds out training rows, data.val_dataset names other held-out data: set one"
                )
            if self.val_split is None:
                raise ConfigError(
                    "data.val_fraction holds out rows for validation, which data.val_split: null turns off: unset one"
                )
        if self.val_dataset is not None and is_local_file(self.val_dataset) and is_local_file(self.dataset):
            if Path(self.val_dataset).resolve() == Path(self.dataset).resolve():
                log.warning(
                    "data.val_dataset is data.dataset's own file: validation scores rows the policy trains on "
                    "(data.val_fraction holds some out instead)"
                )

    @property
    def train_where(self) -> str:
        """The training rows, as error messages name them."""
        return f"data.dataset ({self.dataset}, split {self.train_split})"

    def _load(self, source: str, split: str, setting: str) -> Dataset:
        return load_prompts(
            source, split, subset=self.subset, task_kwargs=self.task_kwargs, setting=setting, curriculum=self.curriculum
        )

    def training_rows(self) -> Dataset:
        """The rows to train on (without the held-out ones of ``val_fraction``)."""
        data = self._load(self.dataset, self.train_split, "data.dataset")
        if self.val_fraction is None:
            return data
        return split_off(data, self.val_fraction, self.seed)[0]

    def held_out(self, limit: int | None = None) -> tuple[Dataset, str] | None:
        """``(rows, where)`` of the held-out data (the first ``limit`` rows only, when set), ``where`` naming it for
        error messages; None: no validation."""
        found = self._held_out()
        if found is None or limit is None:
            return found
        data, where = found
        return data.select(range(min(limit, len(data)))), where

    def _held_out(self) -> tuple[Dataset, str] | None:
        if self.val_split is None:
            return None
        if self.val_fraction is not None:
            data = self._load(self.dataset, self.train_split, "data.dataset")
            held = split_off(data, self.val_fraction, self.seed)[1]
            return held, f"validation data ({self.dataset}: data.val_fraction {self.val_fraction} of the rows)"
        if self.val_dataset is not None:
            data = self._load(self.val_dataset, self.val_split, "data.val_dataset")
            return data, f"validation data ({self.val_dataset}, split {self.val_split})"
        if is_local_file(self.dataset):
            _notice(
                f"data.dataset ({self.dataset}) is a local file and no held-out data is set: no validation (set "
                "data.val_fraction: 0.1 to hold out a tenth of its rows, or data.val_dataset)"
            )
            return None
        data = self._load(self.dataset, self.val_split, "data.dataset")
        return data, f"validation data ({self.dataset}, split {self.val_split})"

    def no_held_out_error(self) -> ConfigError:
        """What ``validate``/``test`` say when there are no held-out rows to evaluate."""
        if self.val_split is None:
            return ConfigError("no held-out data: data.val_split is null (set it, or data.val_fraction)")
        return ConfigError(
            f"no held-out data: data.dataset ({self.dataset}) is a local file; set data.val_fraction (e.g. 0.1) "
            "or data.val_dataset"
        )


class PromptData:
    """What the data modules (``RolloutDataModule``, ``SFTDataModule``) share: where their rows come from
    (``sources``), how their prompts are encoded (``encoder``), from their settings of the same names, and how
    their held-out rows are evaluated (``held_out_loader``: ``rollout/held_out.py``, from the settings each declares
    below)."""

    scorer: Scorer
    sampling: SamplingConfig
    eval: EvalConfig
    seed: int

    def init_prompts(self, settings: Mapping[str, Any]) -> None:
        """Take the data settings (a data module's ``__init__`` arguments) that say where the rows come from and
        how prompts are rendered; the chat settings that need no tokenizer are checked now."""
        self.source, self.subset = settings["dataset"], settings["subset"]
        self.task_kwargs = settings["task_kwargs"] or {}
        self.train_split, self.val_dataset, self.val_split = (
            settings[k] for k in ("train_split", "val_dataset", "val_split")
        )
        self.sources = PromptSource(
            self.source,
            self.subset,
            self.task_kwargs,
            self.train_split,
            self.val_dataset,
            self.val_split,
            settings["val_fraction"],
            settings["seed"],
            curriculum=settings.get("curriculum") is not None,  # SFT's data module has no curriculum
        )
        self.prompt_column, self.use_chat_template = settings["prompt_column"], settings["use_chat_template"]
        self.system_prompt, kwargs = settings["system_prompt"], settings["chat_template_kwargs"]
        check_chat_settings(self.use_chat_template, self.system_prompt, kwargs)
        self.chat_template_kwargs: dict[str, Any] = dict(kwargs or {})

    def held_out_loader(
        self, data: Dataset, engine: Callable[[], RolloutEngine], environment: RolloutKind | None = None
    ) -> DataLoader:
        """``data`` (held-out rows) generated and scored batch by batch on this rank (``rollout/held_out.py``), by the
        data module's ``scorer``, ``sampling``, ``eval`` and ``seed``; ``engine()``: the engine on the current
        weights."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        if trainer is not None:  # rewards that read TRL's ``trainer_state`` see the progress of the evaluated policy
            self.scorer.trainer_state.update(trainer.global_step, trainer.current_epoch)
        sampler = HeldOutSampler(
            module=lambda: self.policy_side,
            engine=engine,
            encoder=self.encoder,
            scorer=self.scorer,
            sampling=self.sampling,
            config=self.eval,
            seed=self.seed,
            rank=rank,
            environment=environment,
        )
        return held_out_loader(data, self.eval.batch_size, sampler, rank=rank, world_size=world)

    def encoder(self, tokenizer: Any = None, modality: Modality | None = None) -> PromptEncoder:
        """The prompts' encoder for ``tokenizer`` of ``modality`` (default: the policy's), with this module's chat
        settings: the modality's (``rollout/prompts.py: prompt_encoder``: a vision-language model's encodes the rows'
        images too). Outside a fit (a tool with a module of its own), give both."""
        tokenizer = self.policy_side.tokenizer if tokenizer is None else tokenizer
        modality = self.policy_side.modality if modality is None else modality
        settings = {"system_prompt": self.system_prompt, "chat_template_kwargs": self.chat_template_kwargs}
        return prompt_encoder(modality, tokenizer, self.use_chat_template, **settings)


def checked_rows(
    data: Dataset,
    where: str,
    *,
    prompt_column: str,
    encoder: PromptEncoder,
    scorer: Scorer,
    environment: RolloutKind | None = None,
    context_length: int | None = None,
    max_new_tokens: int = 0,
    context_name: str = "the model's context",
) -> Dataset:
    """``data`` with its prompt column named ``prompt``, refused in one line (naming ``where`` and the row) for a
    missing column (the prompt's, one a reward or the environment reads), a malformed prompt, or one that does not
    fit the context with ``max_new_tokens`` as the model is given it (``check_prompt_rows``)."""
    data = rename_prompt_column(data, prompt_column, where)
    scorer.check_columns(data.column_names, where)
    kind = rollout_kind(environment)  # None: single-turn sampling, which reads no column and lists no tools
    needed = kind.required_columns()
    missing = [column for column in needed if column not in data.column_names]
    if missing:
        raise ConfigError(f"{where} has no column {missing[0]!r}, which data.environment reads")
    kind.check_rows(data, where)
    # The prompts list them: their lengths count. A row's tools depend on the columns the rollout kind reads.
    reads = data.select_columns(list(needed)) if needed else [{}] * len(data)
    tools = [kind.prompt_tools(row) for row in reads]
    tools = tools if any(tools) else None
    check_prompt_rows(
        data,
        where,
        encoder,
        context_length=context_length,
        max_new_tokens=max_new_tokens,
        context_name=context_name,
        tools=tools,
    )
    return data


def _notice(message: str) -> None:
    if rank_zero_only.rank == 0:  # once per run, not once per process
        log.warning(message)
