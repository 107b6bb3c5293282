"""Tasks with images: ``count_shapes`` (drawn in code, the CPU demo's) and ``geometry3k`` (the GPU recipe's).

Both make TRL's format: a conversational ``prompt`` whose user message holds ``{"type": "image"}`` parts and a
text part, the images in an ``images`` column (a list per row), and an ``answer`` column for the rewards.

``count_shapes``: how many shapes an image shows. Each image is a white square of ``grid`` × ``grid`` cells; the
shapes (squares, discs or triangles, one colour per image) sit in randomly chosen cells, one per cell, nudged a
few pixels inside it. Every image is drawn from a seed of its own (``split_seed`` and the row), so the same
settings draw the same pixels on any machine; the held-out rows are drawn from other seeds than the training rows.

``geometry3k``: the Geometry3K problems (InterGPS) as ``hiyouga/geometry3k`` holds them on the Hub (the dataset
verl's and EasyR1's Qwen2.5-VL geometry recipes train on), or local files with the same columns (``images``,
``problem`` with an ``<image>`` marker per image, ``answer``); the prompt asks for the R1 layout
(``<think>…</think><answer>…</answer>``).
"""

from __future__ import annotations

import io
import random
from typing import Any

from datasets import Dataset, DatasetDict

from grpo_lightning.config import ConfigError
from grpo_lightning.tasks import register_task

COUNT_QUESTION = "How many shapes?"
PALETTE = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220), "orange": (240, 140, 20)}
SHAPES = ("square", "disc", "triangle")
CELL = 28  # pixels: one cell is one image token of Qwen2-VL's processor (14-pixel patches merged 2 × 2)


def draw_shapes(cells: list[int], shape: str, colour: str, grid: int, rng: random.Random) -> Any:
    """A white ``grid * CELL``-pixel square image with ``shape`` in each of ``cells`` (row-major cell numbers),
    each 14 to 18 pixels wide and nudged at random inside its cell (so that pixels vary beyond the layout)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (grid * CELL, grid * CELL), "white")
    draw = ImageDraw.Draw(image)
    fill = PALETTE[colour]
    for cell in cells:
        size = rng.randint(14, 18)
        left = (cell % grid) * CELL + rng.randint(2, CELL - size - 2)
        top = (cell // grid) * CELL + rng.randint(2, CELL - size - 2)
        box = (left, top, left + size, top + size)
        if shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "disc":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(left + size / 2, top), (left, top + size), (left + size, top + size)], fill=fill)
    return image


def png_bytes(image: Any) -> dict[str, Any]:
    """``image`` as a ``datasets`` image value (``{"bytes", "path"}``): a PNG, lossless and deterministic."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def count_prompt(question: str = COUNT_QUESTION) -> list[dict[str, Any]]:
    """The counting prompt: one user message, the image then the question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def count_rows(size: int, seed: int, max_count: int, grid: int) -> dict[str, list[Any]]:
    """``size`` rows of the counting task; row ``i`` is drawn from ``random.Random(f"{seed}-{i}")`` alone."""
    rows: dict[str, list[Any]] = {"prompt": [], "images": [], "answer": [], "count": [], "shape": [], "colour": []}
    for i in range(size):
        rng = random.Random(f"{seed}-{i}")  # a string seed: the same on every Python, independent of the others
        count = rng.randint(1, max_count)
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(PALETTE))
        cells = rng.sample(range(grid * grid), count)
        rows["prompt"].append(count_prompt())
        rows["images"].append([png_bytes(draw_shapes(cells, shape, colour, grid, rng))])
        rows["answer"].append(str(count))
        rows["count"].append(count)
        rows["shape"].append(shape)
        rows["colour"].append(colour)
    return rows


@register_task("count_shapes")
def count_shapes(
    train_size: int = 2000, test_size: int = 300, max_count: int = 6, grid: int = 3, split_seed: int = 0
) -> DatasetDict:
    """How many shapes an image shows (1 to ``max_count`` in a ``grid`` × ``grid`` image); columns ``prompt``,
    ``images`` (one PNG per row), ``answer`` (the count as text), ``count``, ``shape`` and ``colour``. The held-out
    rows are drawn from seed ``split_seed + 1``, the training rows from ``split_seed``."""
    if not 1 <= max_count <= grid * grid:
        raise ConfigError(
            f"data.task_kwargs.max_count: {max_count} shapes do not fit a {grid} x {grid} grid (one per cell); set "
            f"it between 1 and {grid * grid}"
        )
    if train_size < 1 or test_size < 1:
        raise ConfigError("data.task_kwargs.train_size and test_size: each split needs at least one row")
    from datasets import Features, Image, Sequence, Value

    features = Features(
        {
            "prompt": [{"role": Value("string"), "content": [{"type": Value("string"), "text": Value("string")}]}],
            "images": Sequence(Image()),
            "answer": Value("string"),
            "count": Value("int64"),
            "shape": Value("string"),
            "colour": Value("string"),
        }
    )
    splits = {"train": (train_size, split_seed), "test": (test_size, split_seed + 1)}
    return DatasetDict(
        {
            name: Dataset.from_dict(count_rows(size, seed, max_count, grid), features=features)
            for name, (size, seed) in splits.items()
        }
    )


# ---------------------------------------------------------------------------------------------- Geometry3K
GEOMETRY_INSTRUCTION = (
    "Think the problem through step by step inside <think> </think> tags, then write only the final answer "
    "inside <answer> </answer> tags, like <think> reasoning here </think> <answer> 42 </answer>."
)


def image_prompt(problem: str, instruction: str) -> list[dict[str, Any]]:
    """``problem`` with each ``<image>`` marker as an image part (an image with no marker goes first, as the Hub's
    rows without one mean), then ``instruction``: one user message."""
    pieces = problem.split("<image>")
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    if len(pieces) == 1:
        parts.insert(0, {"type": "image"})
    parts.append({"type": "text", "text": instruction})
    return [{"role": "user", "content": parts}]


def shrink(image: Any, max_pixels: int | None) -> Any:
    """``image`` scaled down (aspect kept) to at most ``max_pixels`` pixels; smaller images as they are. The
    processor turns every 28 × 28 pixels into a token, so this bounds a prompt's image tokens."""
    if max_pixels is None or image.width * image.height <= max_pixels:
        return image
    scale = (max_pixels / (image.width * image.height)) ** 0.5
    return image.resize((max(28, int(image.width * scale)), max(28, int(image.height * scale))))


@register_task("geometry3k")
def geometry3k(
    data_files: str | dict[str, str] | None = None,
    hub_name: str = "hiyouga/geometry3k",
    instruction: str = GEOMETRY_INSTRUCTION,
    max_pixels: int | None = 1003520,
    test_split: str = "test",
) -> DatasetDict:
    """Geometry3K with columns ``prompt`` (the problem's images as image parts, then the problem and
    ``instruction``), ``images`` (each no larger than ``max_pixels``) and ``answer``. ``data_files``: local files
    (``{"train": ..., "test": ...}``) with the Hub dataset's columns instead of downloading ``hub_name``.
    ``test_split``: the Hub split held out (``test``, 601 problems, or ``validation``, 300)."""
    from datasets import load_dataset

    from grpo_lightning.integrations.vision.images import load_image
    from grpo_lightning.tasks.gsm8k import _builder

    if data_files is not None:
        files = data_files if isinstance(data_files, dict) else {"train": data_files}
        first = next(iter(files.values()))
        loaded = load_dataset(_builder(first), data_files=files)
    else:
        loaded = load_dataset(hub_name)
    if "train" not in loaded or test_split not in loaded:
        raise ConfigError(
            f"data.task_kwargs: geometry3k needs a 'train' and a {test_split!r} split (got {', '.join(loaded)}); set "
            "data_files to {train: ..., test: ...} or test_split"
        )
    missing = {"images", "problem", "answer"} - set(loaded["train"].column_names)
    if missing:
        raise ConfigError(f"data.task_kwargs.data_files: geometry3k rows need the columns {sorted(missing)}")

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        images = [png_bytes(shrink(load_image(value), max_pixels)) for value in row["images"]]
        return {"prompt": image_prompt(row["problem"], instruction), "images": images, "answer": str(row["answer"])}

    from datasets import Image, Sequence, Value

    splits = {"train": loaded["train"], "test": loaded[test_split]}
    converted = {}
    for name, split in splits.items():
        rows = split.map(convert, remove_columns=split.column_names)
        # map keeps a column's type where its name is kept: an answer read as a number stays one without this
        converted[name] = rows.cast_column("images", Sequence(Image())).cast_column("answer", Value("string"))
    return DatasetDict(converted)
