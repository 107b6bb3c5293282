"""Image columns (issue 42, TRL's convention): ``image`` / ``images`` of PIL images, paths, bytes or a ``datasets``
``Image`` feature, several images per prompt, text-only rows beside them; bad rows refused before training with the
row and the column named; prompts with images encoded per row, left-padded, one image's inputs per row."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from datasets import Dataset, Image
from vision_models import encoder_for, image_prompt, shared_vlms, squares

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.vision.images import check_image_rows, images_of_rows, load_image
from grpo_lightning.rollout.prompts import check_prompt_rows


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_kind_of_image_value_reads_as_an_rgb_image(tmp_path):
    path = tmp_path / "two.png"
    squares(2).convert("L").save(path)  # greyscale on disk: read as RGB
    for value in (squares(1), str(path), path, _png(squares(3)), {"bytes": _png(squares(4)), "path": None}):
        image = load_image(value)
        assert image.mode == "RGB" and image.size == (84, 56)
    for value, why in ((str(tmp_path / "none.png"), "no such image file"), (b"not a png", "not an image file")):
        with pytest.raises(ValueError, match=why):
            load_image(value)


def test_a_datasets_image_feature_and_text_only_rows_are_read(tmp_path):
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # Arrow: one content type per column
    single = Dataset.from_dict({"prompt": [image_prompt("count", 1), text_only], "image": [squares(2), None]})
    assert isinstance(single.features["image"], Image)
    check_image_rows(single, "data.dataset")
    images = images_of_rows(single[:])
    assert [len(row) for row in images] == [1, 0] and images[0][0].mode == "RGB"
    several = {"prompt": [image_prompt("which?", 2)], "images": [[squares(1), _png(squares(2))]]}
    check_image_rows(several, "data.dataset")
    assert [len(row) for row in images_of_rows(several)] == [2]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ({"prompt": [image_prompt("a", 1), image_prompt("b", 2)], "images": [[squares(1)], [squares(1)]]},
         r"data.dataset row 1, column 'images': 1 image\(s\) for 2"),
        ({"prompt": [image_prompt("a", 1)], "image": ["/no/such.png"]},
         r"data.dataset row 0, column 'image': cannot read the image: no such image file"),
        ({"prompt": [image_prompt("a", 1)], "image": [b"garbage"]},
         r"row 0, column 'image': cannot read the image: its bytes are not an image file"),
        ({"prompt": [image_prompt("a", 1)]}, r"row 0: the prompt has 1 image part\(s\) but the data has no 'image'"),
        ({"prompt": ["plain"], "image": [None], "images": [None]}, "both an 'image' and an 'images' column"),
        ({"prompt": ["plain"], "images": [squares(1)]}, "column 'images': cannot read the image: the 'images' column"),
    ],
)  # fmt: skip
def test_bad_image_rows_are_refused_with_the_row_and_the_column(rows, match):
    with pytest.raises(ConfigError, match=match):
        check_image_rows(rows, "data.dataset")


def test_the_check_before_training_reads_the_images_and_the_parts(tiny_vlms):
    encoder = encoder_for(tiny_vlms["qwen2_vl"])
    good = Dataset.from_dict({"prompt": [image_prompt("count", 1)], "image": [squares(1)]})
    check_prompt_rows(good, "data.dataset", encoder, context_length=1024, max_new_tokens=8)
    bad = Dataset.from_dict({"prompt": [image_prompt("count", 2)], "image": [squares(1)]})
    with pytest.raises(ConfigError, match=r"data.dataset row 0, column 'image': 1 image\(s\) for 2"):
        check_prompt_rows(bad, "data.dataset", encoder)
    odd_part = [{"role": "user", "content": [{"type": "audio"}]}]
    with pytest.raises(
        ConfigError,
        match=r"data.dataset row 0: message 0 of the prompt has a content part .*: a part is \{type: text, text\} "
        r"or \{type: image\}$",
    ):
        check_prompt_rows(Dataset.from_dict({"prompt": [odd_part]}), "data.dataset", encoder)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_prompts_encode_per_row_left_padded_with_each_rows_own_image_inputs(tiny_vlms, family):
    encoder = encoder_for(tiny_vlms[family])
    image_token = encoder.processor.image_token_id
    rows = {
        "prompt": [image_prompt("count", 1), [{"role": "user", "content": "no image here"}], image_prompt("x", 2)],
        "images": [[squares(1)], [], [squares(2), squares(3, size=(112, 84))]],
    }
    ids, mask, vision = encoder.encode_rows(rows)
    assert ids.shape == mask.shape and bool(mask[:, -1].all())  # left-padded
    assert vision[1] == {} and "pixel_values" in vision[0] and "pixel_values" in vision[2]
    for row in range(3):
        alone = {name: values[row : row + 1] for name, values in rows.items()}
        alone_ids, _, alone_vision = encoder.encode_rows(alone)
        assert torch.equal(ids[row][mask[row].bool()], alone_ids[0])  # the same ids as alone
        assert all(torch.equal(alone_vision[0][k], vision[row][k]) for k in vision[row])
    counts = (ids == image_token).sum(-1)
    assert counts[1] == 0 and counts[2] > counts[0] > 0


def test_no_module_imports_pillow_at_import_time():
    """Pillow is the ``vision`` extra, and every run imports the vision modules: none may import PIL at module level
    (outside ``if TYPE_CHECKING``), or a text-only install fails to start."""
    import ast

    package = Path(__file__).resolve().parents[2] / "grpo_lightning"
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only: functions import it when called
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name == "PIL" or name.startswith("PIL.") for name in names):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not found, found


def test_an_image_read_without_pillow_is_one_line_naming_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "PIL" or name.startswith("PIL."):
            raise ModuleNotFoundError("No module named 'PIL'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(
        ImportError, match=r"^images need Pillow, which is not installed: pip install 'grpo_lightning\[vision\]'"
    ):
        load_image(b"not an image")
