"""Image columns, TRL's convention: ``image`` (one per row) or ``images`` (a list per row) beside a conversational
prompt whose messages hold ``{"type": "image"}`` parts, one per image, in order.

A value is a PIL image, a path, raw bytes, or what a ``datasets`` ``Image`` feature holds (decoded: a PIL image;
undecoded: ``{"bytes", "path"}``). Every value becomes an RGB PIL image (``row_images``). A row may have no image
(None, an empty list) when its prompt has no image part: text-only rows train beside image rows.
``check_image_rows`` reads every row's images before training and refuses, naming the row and the column, an
unreadable image or a count of images that differs from the prompt's image parts.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_lightning.config import ConfigError

if TYPE_CHECKING:
    from PIL import Image

IMAGE_COLUMNS = ("image", "images")


def pil_image() -> Any:
    """``PIL.Image``, imported when an image is first read: Pillow is the ``vision`` extra, and a text-only run
    never needs it (this module is imported by every run)."""
    try:
        from PIL import Image
    except ImportError as err:
        raise ImportError(
            "images need Pillow, which is not installed: pip install 'grpo_lightning[vision]' (or pip install pillow)"
        ) from err
    return Image


def image_column(columns: Sequence[str], where: str = "data.dataset") -> str | None:
    """The image column among ``columns`` (``image`` or ``images``); None when there is neither. Both are refused:
    which one holds a row's images would be a guess."""
    present = [name for name in IMAGE_COLUMNS if name in columns]
    if len(present) > 1:
        raise ConfigError(f"{where} has both an 'image' and an 'images' column; keep one (TRL reads one of them)")
    return present[0] if present else None


def load_image(value: Any) -> Image.Image:
    """``value`` (a PIL image, a path, bytes, or a ``datasets`` ``{"bytes", "path"}`` dict) as an RGB PIL image.
    Raises ``ValueError`` saying why it cannot be read."""
    Image = pil_image()
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, Mapping) and (value.get("bytes") is not None or value.get("path") is not None):
        return load_image(value["bytes"] if value.get("bytes") is not None else value["path"])
    elif isinstance(value, (bytes, bytearray)):
        image = _opened(lambda: Image.open(io.BytesIO(value)), "its bytes are not an image file")
    elif isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"no such image file {str(value)!r}")
        image = _opened(lambda: Image.open(path), f"{str(value)!r} is not a readable image file")
    else:
        raise ValueError(f"{type(value).__name__} is not an image (a PIL image, a path, bytes or {{bytes, path}})")
    return image if image.mode == "RGB" else image.convert("RGB")


def _opened(open_image: Any, why: str) -> Image.Image:
    try:
        image = open_image()
        image.load()  # read now: a truncated file fails here, not in the middle of a round
        return image
    except (OSError, SyntaxError, pil_image().DecompressionBombError) as err:
        raise ValueError(f"{why} ({err})") from err


def row_images(value: Any, column: str) -> list[Image.Image]:
    """A row's images: ``image`` holds one (None: none), ``images`` a list of them (None or empty: none)."""
    if value is None:
        return []
    if column == "images":
        if isinstance(value, (str, bytes, Mapping, pil_image().Image)) or not isinstance(value, Sequence):
            raise ValueError(f"the 'images' column holds a list of images per row (got {type(value).__name__})")
        return [load_image(v) for v in value]
    return [load_image(value)]


def image_parts(prompt: Any) -> int:
    """How many ``{"type": "image"}`` parts ``prompt``'s messages hold (0 for a string prompt)."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        return 0
    count = 0
    for message in prompt:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, Sequence) and not isinstance(content, str):
            count += sum(1 for part in content if isinstance(part, Mapping) and part.get("type") == "image")
    return count


def images_of_rows(rows: Mapping[str, list[Any]]) -> list[list[Image.Image]]:
    """Each row's images (a dict of columns, as a round draws them); no image column: none."""
    column = image_column(list(rows))
    if column is None:
        return [[] for _ in rows["prompt"]]
    return [row_images(value, column) for value in rows[column]]


def check_image_rows(data: Any, where: str) -> None:
    """Every row's images readable and as many as its prompt's image parts; refused in one line naming the row
    and the column. ``data``: a ``datasets.Dataset`` (or a dict of columns) with a ``prompt`` column."""
    columns = list(data.column_names) if hasattr(data, "column_names") else list(data)
    column = image_column(columns, where)
    prompts = data["prompt"]
    values = data[column] if column is not None else [None] * len(prompts)
    for row, (prompt, value) in enumerate(zip(prompts, values)):
        wanted = image_parts(prompt)
        if column is None:
            if wanted:
                raise ConfigError(
                    f"{where} row {row}: the prompt has {wanted} image part(s) but the data has no 'image' or "
                    "'images' column"
                )
            continue
        try:
            count = len(row_images(value, column))
        except ValueError as err:
            raise ConfigError(f"{where} row {row}, column {column!r}: cannot read the image: {err}") from err
        if count != wanted:
            raise ConfigError(
                f'{where} row {row}, column {column!r}: {count} image(s) for {wanted} {{"type": "image"}} '
                "part(s) in the prompt; each image needs one part, in order"
            )
