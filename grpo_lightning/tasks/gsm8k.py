"""GSM8K: grade-school word problems, prompted for the R1 ``<think>…</think><answer>…</answer>`` layout.

Loads a local file (``data_files``: a jsonl / json / parquet / csv path, or ``{"train": ..., "test": ...}``) or,
without one, the Hub dataset ``openai/gsm8k`` through ``datasets.load_dataset``. The ``answer`` column is the final
number after ``####`` (thousands separators removed); ``solution`` keeps the full worked solution.
"""

from __future__ import annotations

import os
from typing import Any

from datasets import Dataset, DatasetDict

from grpo_lightning.tasks import register_task

R1_INSTRUCTION = (
    "Think the problem through step by step inside <think> </think> tags, then write only the final answer "
    "inside <answer> </answer> tags, like <think> reasoning here </think> <answer> 42 </answer>."
)
GSM8K_TEMPLATE = "Solve this math word problem.\n\n{question}\n\n" + R1_INSTRUCTION

DataFiles = str | list[str] | dict[str, str | list[str]]


def _builder(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    return {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(ext, "json")


def load_splits(
    data_files: DataFiles | None,
    hub_name: str,
    hub_config: str | None,
    test_size: int | float,
    split_seed: int,
) -> DatasetDict:
    """``train`` and ``test`` splits from local files or the Hub.

    With local files, ``{"train": ..., "test": ...}`` is used as given; a single path (or a dict with one split)
    is split by ``test_size`` (a count or a fraction) with ``split_seed``. A Hub dataset without a test split is
    split the same way.
    """
    from datasets import load_dataset

    if data_files is not None:
        files = data_files if isinstance(data_files, dict) else {"train": data_files}
        first = next(iter(files.values()))
        loaded = load_dataset(_builder(first if isinstance(first, str) else first[0]), data_files=files)
    else:
        loaded = load_dataset(hub_name, hub_config) if hub_config else load_dataset(hub_name)
    if "train" in loaded and "test" in loaded:
        return DatasetDict({"train": loaded["train"], "test": loaded["test"]})
    only: Dataset = loaded[next(iter(loaded))]
    split = only.train_test_split(test_size=test_size, seed=split_seed)
    return DatasetDict({"train": split["train"], "test": split["test"]})


def final_answer(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, without thousands separators."""
    return solution.rsplit("####", 1)[-1].strip().replace(",", "")


@register_task("gsm8k")
def gsm8k(
    data_files: DataFiles | None = None,
    hub_name: str = "openai/gsm8k",
    hub_config: str | None = "main",
    template: str = GSM8K_TEMPLATE,
    test_size: int | float = 0.1,
    split_seed: int = 1234,
) -> DatasetDict:
    """GSM8K with columns ``prompt`` (``template`` with ``{question}``), ``answer``, ``question``, ``solution``."""
    splits = load_splits(data_files, hub_name, hub_config, test_size, split_seed)

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "prompt": template.format(question=row["question"]),
            "answer": final_answer(row["answer"]),
            "question": row["question"],
            "solution": row["answer"],
        }

    return DatasetDict({name: split.map(convert, remove_columns=split.column_names) for name, split in splits.items()})
