"""What a vision-language run checks and writes around training (issue 42): the context check counts each image's
expanded tokens, the W&B completions table shows each prompt's images, the exported folder holds the processor,
and a checkpoint resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import quiet_trainer
from helpers import load_tool
from lightning import seed_everything
from lightning.pytorch.loggers import WandbLogger
from test_vision_fit import count_file, vision_run
from transformers import AutoModelForImageTextToText, AutoProcessor
from vision_models import encoder_for, image_prompt, shared_vlms, squares

from grpo_lightning import SamplingConfig
from grpo_lightning.callbacks.checkpointing import RoundCheckpoint
from grpo_lightning.callbacks.completions import CompletionsTable
from grpo_lightning.callbacks.export import SaveHFModel
from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.vision.processors import load_processor
from grpo_lightning.integrations.vision.tiny import build_tiny_vlm
from grpo_lightning.rollout.prompts import PromptEncoder, check_prompt_rows

ROWS = {
    "prompt": [image_prompt("count", 1), [{"role": "user", "content": "text only"}], image_prompt("which?", 2)],
    "images": [[squares(1)], [], [squares(3, "blue", size=(56, 56)), squares(2, size=(112, 84))]],
}


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


# ------------------------------------------------------------------------------------------- the context check
@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_the_context_check_counts_each_images_expanded_tokens(tiny_vlms, family):
    """Each row's length is the processor's: every image marker expanded (one run of the processor per image size,
    the same counts as encoding each row whole), more than the text's markers alone."""
    encoder = encoder_for(tiny_vlms[family])
    rendered = encoder.texts(ROWS["prompt"])
    lengths = encoder.rendered_lengths(rendered, ROWS)
    assert lengths == [len(encoder.text_inputs(t, i)[0]) for t, i in zip(rendered, ROWS["images"])]
    markers = PromptEncoder.rendered_lengths(encoder, rendered, ROWS)
    assert lengths[1] == markers[1] and lengths[0] > markers[0] + 2 and lengths[2] > markers[2] + 4
    # A completion budget the markers alone would fit, the expanded images do not: refused, naming the row.
    budget = 1024 - lengths[2] + 1
    assert markers[2] + budget <= 1024
    with pytest.raises(ConfigError, match=rf"data.dataset row 2: its prompt of {lengths[2]} tokens"):
        check_prompt_rows(ROWS, "data.dataset", encoder, context_length=1024, max_new_tokens=budget)
    check_prompt_rows(ROWS, "data.dataset", encoder, context_length=1024, max_new_tokens=budget - 1)


def test_a_run_whose_images_overflow_the_context_is_refused_before_training(tmp_path):
    encoder = encoder_for(build_tiny_vlm("qwen2_vl", tmp_path / "probe"))
    rows = [json.loads(line) for line in open(count_file(tmp_path))]
    texts = encoder.texts([r["prompt"] for r in rows])
    columns = {"prompt": [r["prompt"] for r in rows], "images": [r["images"] for r in rows]}
    longest = max(encoder.rendered_lengths(texts, columns))
    assert max(PromptEncoder.rendered_lengths(encoder, texts, columns)) < longest - 1
    # A completion budget that fits the prompts' image markers, not the images' tokens.
    module, data = vision_run(tmp_path, sampling=SamplingConfig(group_size=2, max_new_tokens=1024 - longest + 1))
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    with pytest.raises(ConfigError, match=rf"its prompt of {longest} tokens \+ data.sampling.max_new_tokens"):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0


# ----------------------------------------------------------------------------------------- the W&B table
def test_the_completions_table_shows_each_prompts_images(tmp_path, monkeypatch):
    """A W&B run offline: the table of round 0 has ``image_1`` beside ``prompt``, a ``wandb.Image`` of each image
    row's picture (its pixels the file's), None for the text-only row; W&B builds the table from it."""
    import wandb

    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="vision")
    tables = []
    monkeypatch.setattr(logger, "log_table", lambda key, columns, data, step: tables.append((key, columns, data)))
    module, data = vision_run(tmp_path)
    trainer = quiet_trainer(tmp_path, max_epochs=1, logger=logger, callbacks=[CompletionsTable(every_n_rounds=1)])
    trainer.fit(module, datamodule=data)
    wandb.finish()
    ((key, columns, rows),) = tables
    assert key == "completions/round_0000" and columns[:5] == ["round", "step", "prompt", "image_1", "completion"]
    rollout = data.last_rollout
    for row, prompt, images in zip(rows, rollout.prompts, rollout.images, strict=True):
        cell = row[3]
        if isinstance(prompt[0]["content"], list):
            assert isinstance(cell, wandb.Image) and len(images) == 1
            assert cell.image.size == images[0].size and cell.image.tobytes() == images[0].tobytes()
        else:
            assert cell is None and images == []
    wandb.Table(columns=columns, data=rows)  # a table W&B accepts (an image column with empty cells)


# ----------------------------------------------------------------------------------------------- export
def _same_processor(original, reloaded) -> None:
    """The reloaded processor encodes every row as the original: ids, pixels, grids, chat template."""
    assert reloaded.chat_template == original.chat_template
    for prompt, images in zip(ROWS["prompt"], ROWS["images"]):
        text = original.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        a = original(text=[text], images=[images] if images else None, return_tensors="pt")
        b = reloaded(text=[text], images=[images] if images else None, return_tensors="pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_the_export_callback_saves_the_processor_for_auto_processor(tmp_path, family):
    module, data = vision_run(tmp_path, family)
    folder, out = tmp_path / family, tmp_path / "exported"
    quiet_trainer(tmp_path, max_epochs=1, callbacks=[SaveHFModel(str(out))]).fit(module, datamodule=data)
    # transformers 5 writes the image processor's settings into processor_config.json (4.x: preprocessor_config.json)
    assert "image_processor" in json.loads((out / "processor_config.json").read_text())
    _same_processor(AutoProcessor.from_pretrained(str(folder)), AutoProcessor.from_pretrained(str(out)))
    model = AutoModelForImageTextToText.from_pretrained(str(out))
    torch.testing.assert_close(model.lm_head.weight, module.policy.lm_head.weight)


# ----------------------------------------------------------------------------------- resume, export_hf
def _fit(tmp_path, root, epochs, ckpt_path=None):
    seed_everything(0)
    module, data = vision_run(tmp_path)
    trainer = quiet_trainer(
        root, max_epochs=epochs, enable_checkpointing=True, callbacks=[RoundCheckpoint(dirpath=str(root / "ckpt"))]
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, data


def test_a_checkpoint_resumes_exactly_and_exports_with_its_processor(tmp_path):
    """Two rounds, against one round, saved, and a second resumed from ``last.ckpt``: the same final weights and
    the same last rollout (its images' inputs included). ``tools/export_hf.py`` writes the checkpoint's policy
    with its processor (Qwen2-VL's, saved for images alone), which loads back whole."""
    reference, reference_data = _fit(tmp_path, tmp_path / "reference", 2)
    _fit(tmp_path, tmp_path / "run", 1)
    resumed, resumed_data = _fit(tmp_path, tmp_path / "run", 2, ckpt_path=str(tmp_path / "run" / "ckpt" / "last.ckpt"))
    assert resumed_data.last_rollout.completions == reference_data.last_rollout.completions
    for a, b in zip(resumed_data.last_rollout.vision, reference_data.last_rollout.vision, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name, value in reference.policy.state_dict().items():
        assert torch.equal(resumed.policy.state_dict()[name], value), name

    out = load_tool("export_hf").export_checkpoint(tmp_path / "run" / "ckpt" / "last.ckpt", tmp_path / "hf")
    assert {"preprocessor_config.json", "processor_config.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    _same_processor(load_processor(str(tmp_path / "qwen2_vl")), load_processor(str(out)))
    model = AutoModelForImageTextToText.from_pretrained(str(out))
    for name, value in resumed.policy.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
