"""A vision-language run at a rollout lag resumes exactly (issue 56): ``configs/vision.yaml`` at
``data.schedule.rollout_lag: 1`` through the CLI, stopped after 3 rounds and resumed with ``--ckpt_path last`` for 3
more, ends with the weights of 6 rounds without a stop, bit for bit, as the text runs do
(``tests/runs/test_async_rollouts.py``). The checkpoint holds the round sampled ahead as plain data (each row's
image inputs, its images as PNG bytes), which ``torch.load(weights_only=True)`` reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from grpo_lightning.cli import main
from grpo_lightning.integrations.vision.saved import images_from_plain, plain_images, plain_vision, vision_from_plain
from grpo_lightning.integrations.vision.vllm_inputs import SourcedRow

ROOT = Path(__file__).resolve().parents[2]
SMALL = [  # the demo's config, rounds made small: 2 prompts x G = 4, two optimizer steps a round, no evaluation
    "--data.schedule.rollout_lag", "1",
    "--data.prompts_per_round", "2",
    "--data.sampling.group_size", "4",
    "--data.update.mini_batch_size", "4",
    "--data.task_kwargs.train_size", "64",
    "--data.task_kwargs.test_size", "8",
    "--data.schedule.rollout_threads", "1",
    "--trainer.limit_val_batches", "0",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip


def fit(root: Path, rounds: int, *extra: str) -> None:
    main(
        [
            "fit", "--config", str(ROOT / "configs/vision.yaml"),
            "--model.model_name_or_path", str(ROOT / "grpo_lightning/assets/tiny-count-shapes"),
            "--trainer.default_root_dir", str(root), "--trainer.max_epochs", str(rounds), *SMALL, *extra,
        ]
    )  # fmt: skip


def saved(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


@pytest.mark.slow  # about 40 s (pytest -m slow, run by .ci/run)
def test_three_plus_three_rounds_at_lag_one_equal_six_for_the_vision_config(tmp_path):
    fit(tmp_path / "six", 6)
    fit(tmp_path / "split", 3)
    ahead = saved(tmp_path / "split")["RolloutDataModule"]
    fit(tmp_path / "split", 6, "--ckpt_path", "last")
    six, split = saved(tmp_path / "six"), saved(tmp_path / "split")
    assert split["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 6
    weights = {name: value for name, value in six["state_dict"].items() if name.startswith("policy.")}
    assert weights and weights.keys() == {k for k in split["state_dict"] if k.startswith("policy.")}
    differ = [name for name, value in weights.items() if not torch.equal(split["state_dict"][name], value)]
    assert not differ, differ
    # The data side too: the stream, the sampling generator, the round sampled ahead (its timings aside).
    assert _same(six["RolloutDataModule"], split["RolloutDataModule"])
    # The round sampled ahead (round 4, from the weights of round 3) was in the 3-round checkpoint, with its images.
    rows = next(iter(_find(ahead, "vision")))
    assert rows and all("pixel_values" in row["inputs"] and len(row["images"]) == 1 for row in rows)


def _find(state, key: str):
    """Every value of ``key`` anywhere in a nested state."""
    if isinstance(state, dict):
        for name, value in state.items():
            if name == key:
                yield value
            yield from _find(value, key)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _find(value, key)


def _same(a, b) -> bool:
    """Equal nested states, tensors bit for bit, timings (``timings``, the round's ``metrics``) left out."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        keys = a.keys() - {"timings", "metrics"}
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in keys)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_image_inputs_and_images_round_trip_as_plain_data():
    image = Image.linear_gradient("L").convert("RGB").resize((30, 20))
    row = SourcedRow({"pixel_values": torch.randn(4, 6)}, [image], [1, 2, 3], [1, 2, 2, 2, 3])
    rows = vision_from_plain(plain_vision([row, {}]))
    assert rows[0].keys() == {"pixel_values"} and torch.equal(rows[0]["pixel_values"], row["pixel_values"])
    assert (rows[0].prompt_ids, rows[0].expanded_ids) == ([1, 2, 3], [1, 2, 2, 2, 3])
    assert rows[0].images[0].tobytes() == image.tobytes() and rows[0].images[0].mode == "RGB"
    assert rows[1] == {} and rows[1].images == []
    (back,) = images_from_plain(plain_images([[image]]))
    assert back[0].tobytes() == image.tobytes()
