"""Tasks with images (``grpo_lightning/integrations/vision/tasks.py``): the counting demo's drawn images and
Geometry3K's rows from local files, both in TRL's format (image parts in the prompt, an ``images`` column)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.vision.images import check_image_rows
from grpo_lightning.integrations.vision.tasks import image_prompt, shrink
from grpo_lightning.rewards.inputs import prompt_text
from grpo_lightning.tasks import is_task, load_task


def pixels(row) -> bytes:
    return row["images"][0].tobytes()


def test_count_shapes_draws_the_same_images_from_the_same_seed_and_others_for_the_held_out_rows():
    assert is_task("count_shapes")
    first = load_task("count_shapes", train_size=12, test_size=6)
    again = load_task("count_shapes", train_size=12, test_size=6)
    assert [pixels(r) for r in first["train"]] == [pixels(r) for r in again["train"]]
    assert {pixels(r) for r in first["train"]}.isdisjoint(pixels(r) for r in first["test"])
    other = load_task("count_shapes", train_size=12, test_size=6, split_seed=5)
    assert [pixels(r) for r in other["train"]] != [pixels(r) for r in first["train"]]
    for split in first.values():
        check_image_rows(split, "data.dataset")  # one readable image per image part
        for row in split:
            assert row["answer"] == str(row["count"]) and 1 <= row["count"] <= 6
            assert row["images"][0].size == (84, 84)
            assert row["prompt"][0]["content"][0]["type"] == "image"


def test_count_shapes_draws_as_many_shapes_as_its_answer():
    """Each shape is one connected blob of its colour: counting the blobs gives the answer."""
    rows = load_task("count_shapes", train_size=20, test_size=1)["train"]
    for row in rows:
        image = row["images"][0]
        width, height = image.size
        coloured = {(x, y) for x in range(width) for y in range(height) if image.getpixel((x, y)) != (255, 255, 255)}
        blobs = 0
        while coloured:
            blobs += 1
            stack = [coloured.pop()]
            while stack:
                x, y = stack.pop()
                for near in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                    if near in coloured:
                        coloured.remove(near)
                        stack.append(near)
        assert blobs == row["count"], (blobs, row["count"], row["shape"])


def test_count_shapes_refuses_more_shapes_than_cells():
    with pytest.raises(ConfigError, match=r"data.task_kwargs.max_count: 10 shapes do not fit a 3 x 3 grid"):
        load_task("count_shapes", max_count=10)


def test_geometry3k_rows_from_local_files_become_image_prompts(tmp_path):
    files = {}
    for split, sizes in (("train", [(100, 80), (2000, 1000)]), ("test", [(60, 60)])):
        lines = []
        for i, size in enumerate(sizes):
            path = tmp_path / f"{split}{i}.png"
            Image.new("RGB", size, "white").save(path)
            lines.append({"images": [str(path)], "problem": f"<image>Find x. Side {i}.", "answer": 3 + i})
        files[split] = str(tmp_path / f"{split}.jsonl")
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    splits = load_task("geometry3k", data_files=files, max_pixels=500_000)
    train = splits["train"]
    assert len(train) == 2 and len(splits["test"]) == 1
    parts = [{k: v for k, v in part.items() if v is not None} for part in train[0]["prompt"][0]["content"]]
    assert parts[0] == {"type": "image"} and parts[1] == {"type": "text", "text": "Find x. Side 0."}
    assert "<answer>" in parts[2]["text"] and train[1]["answer"] == "4"
    assert train[0]["images"][0].size == (100, 80)  # small enough: kept
    big = train[1]["images"][0]
    assert big.width * big.height <= 500_000 and abs(big.width / big.height - 2) < 0.01  # shrunk, aspect kept
    check_image_rows(train, "data.dataset")


def test_geometry3k_refuses_rows_without_its_columns(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "x", "answer": 1}) + "\n")
    with pytest.raises(ConfigError, match=r"geometry3k rows need the columns \['images', 'problem'\]"):
        load_task("geometry3k", data_files={"train": str(path), "test": str(path)})


def test_an_image_marker_anywhere_becomes_an_image_part_in_place():
    prompt = image_prompt("Given <image> and <image>, find y.", "Answer.")
    kinds = [part["type"] for part in prompt[0]["content"]]
    assert kinds == ["text", "image", "text", "image", "text", "text"]
    assert image_prompt("No marker.", "Answer.")[0]["content"][0] == {"type": "image"}  # the image goes first
    assert shrink(Image.new("RGB", (10, 10)), None).size == (10, 10)


def test_a_prompt_with_an_image_reads_as_text_with_an_image_marker():
    """What the console and the tables show of a row read back from a dataset, where the image part's "text" is
    None (every part of an Arrow column has every key): the marker, not "None"."""
    row = load_task("count_shapes", train_size=1, test_size=1)["train"][0]
    assert row["prompt"][0]["content"][0]["text"] is None
    assert prompt_text(row["prompt"]) == "user: <image>How many shapes?"
