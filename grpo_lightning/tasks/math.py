"""MATH (competition mathematics), prompted for the R1 layout; the reference is the solution's ``\\boxed{}``.

Loads local files (``data_files``, as in :func:`grpo_lightning.tasks.gsm8k.load_splits`) or, without them, a Hub
dataset (default ``DigitalLearningGmbH/MATH-lighteval``: columns ``problem``, ``solution``, ``level``, ``type``).
When the data has an ``answer`` column (e.g. MATH-500) it is used; otherwise the answer is the content of the
last ``\\boxed{}`` of the solution.
"""

from __future__ import annotations

import re
from typing import Any

from datasets import DatasetDict

from grpo_lightning.rewards.math import last_boxed
from grpo_lightning.tasks import register_task
from grpo_lightning.tasks.gsm8k import R1_INSTRUCTION, DataFiles, load_splits

MATH_TEMPLATE = "Solve this competition math problem.\n\n{problem}\n\n" + R1_INSTRUCTION


def _level(value: Any) -> int | None:
    match = re.search(r"\d+", str(value))
    return int(match.group(0)) if match else None


@register_task("math")
def math_task(
    data_files: DataFiles | None = None,
    hub_name: str = "DigitalLearningGmbH/MATH-lighteval",
    hub_config: str | None = None,
    template: str = MATH_TEMPLATE,
    levels: list[int] | None = None,
    test_size: int | float = 0.1,
    split_seed: int = 1234,
) -> DatasetDict:
    """MATH with columns ``prompt`` (``template`` with ``{problem}``), ``answer``, ``problem``, ``solution``,
    plus ``level`` / ``type`` when the data has them. ``levels`` keeps only those difficulty levels (e.g. [3, 4, 5]).
    """
    splits = load_splits(data_files, hub_name, hub_config, test_size, split_seed)

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        answer = row.get("answer") or last_boxed(row["solution"]) or ""
        out = {"prompt": template.format(problem=row["problem"]), "answer": str(answer)}
        out.update({"problem": row["problem"], "solution": row["solution"]})
        out.update({key: row[key] for key in ("level", "type", "subject") if key in row})
        return out

    result = {}
    for name, split in splits.items():
        converted = split.map(convert, remove_columns=split.column_names).filter(lambda row: bool(row["answer"]))
        if levels is not None and "level" in converted.column_names:
            converted = converted.filter(lambda row: _level(row["level"]) in set(levels))
        result[name] = converted
    return DatasetDict(result)
