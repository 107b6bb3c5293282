"""SFT of a vision-language model (``grpo_lightning sft``, issue 56): the examples are encoded as a rollout encodes
its rows (each image marker expanded by the processor, the rows' image inputs in the batch), the loss is the
transformers model's own loss on the same example, and what cannot work with images is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import quiet_trainer
from vision_models import COLOURS, encoder_for, image_prompt, squares

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.sft import SFTDataModule, SFTModule
from grpo_lightning.integrations.vision.tiny import build_tiny_vlm


def pairs_file(folder, rows: int = 6) -> str:
    """A jsonl of counting prompts with one image each (a path) and their answers as responses."""
    lines = []
    for i in range(rows):
        path = folder / f"squares_{i}.png"
        squares(i % 4 + 1, COLOURS[i % 4], size=(84, 56 + 28 * (i % 2))).save(path)
        prompt = image_prompt("How many squares?" + " Count." * (i % 3), 1)
        lines.append({"prompt": prompt, "images": [str(path)], "response": f"{i % 4 + 1} squares"})
    file = folder / "pairs.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(file)


def own_loss(model, encoder, row: dict, response: str) -> tuple[torch.Tensor, int]:
    """transformers' own loss of one example: the model's processor on the prompt and its images (PaliGemma's on
    the response too, as its ``suffix``: its token types and labels are its own), the response's tokens and EOS
    labelled; and how many tokens it averages over."""
    from grpo_lightning.integrations.vision.images import row_images

    text = encoder.texts([row["prompt"]])[0]
    images = [row_images(row["images"], "images")]
    tokenizer = encoder.tokenizer
    if model.config.model_type == "paligemma":
        out = encoder.processor(text=[text], images=images, suffix=[response], return_tensors="pt")
        labels = out.pop("labels")
    else:
        out = encoder.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        answer = torch.tensor([*tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id])
        labels = torch.cat([torch.full_like(out["input_ids"][0], -100), answer])[None]
        out["input_ids"] = torch.cat([out["input_ids"][0], answer])[None]
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        for name in ("mm_token_type_ids", "token_type_ids"):  # a text token's type: 0
            if name in out:
                out[name] = torch.cat([out[name][0], torch.zeros_like(answer)])[None]
    return model(**out, labels=labels).loss, int((labels[0, 1:] != -100).sum())


@pytest.mark.parametrize("family", ["qwen2_vl", "paligemma"])
def test_sft_trains_on_each_examples_images_with_transformers_own_loss(tmp_path, family):
    folder = build_tiny_vlm(family, tmp_path / family)
    file = pairs_file(tmp_path)
    module = SFTModule(model_name_or_path=str(folder), lr=1e-2, disable_dropout=True)
    data = SFTDataModule(dataset=file, batch_size=3, val_split=None, seed=0)
    trainer = quiet_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2
    # The examples are the rollout's rows: the same expanded ids and image inputs as VisionPromptEncoder gives.
    rows = [json.loads(line) for line in open(file)]
    encoder = encoder_for(folder)
    for row, example in zip(rows, data.train_examples):
        ids, mask, vision = encoder.encode_rows({"prompt": [row["prompt"]], "images": [row["images"]]})
        assert example["prompt"] == ids[0].tolist() and example["vision"].keys() == vision[0].keys()
        assert all(torch.equal(example["vision"][k], vision[0][k]) for k in vision[0])
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "vision"}
    model = module.policy.eval()
    with torch.no_grad():
        ours, count = module.loss(batch)
        order = [data.train_examples.index(e) for e in _examples_of(batch, data)]
        losses = [own_loss(model, encoder, rows[i], rows[i]["response"]) for i in order]
    own = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    assert int(count) == sum(n for _, n in losses)
    torch.testing.assert_close(ours, own, atol=1e-5, rtol=0)


def _examples_of(batch, data) -> list[dict]:
    """The training examples in ``batch``'s rows (found by their prompt and response tokens)."""
    found = []
    for row in range(batch["prompt_ids"].size(0)):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        response = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        found.append(next(e for e in data.train_examples if e["prompt"] == prompt and e["response"] == response))
    return found


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"packing": True, "max_length": 256}, r"^data.packing: a vision-language model's examples are not packed"),
        ({"max_length": 20}, r"^data.max_length 20: data.dataset .*row 0's prompt is \d+ tokens with its images"),
    ],
)
def test_what_sft_cannot_do_with_images_is_refused_in_one_line(tmp_path, settings, message):
    folder = build_tiny_vlm("qwen2_vl", tmp_path / "qwen2_vl")
    module = SFTModule(model_name_or_path=str(folder))
    data = SFTDataModule(dataset=pairs_file(tmp_path), batch_size=3, val_split=None, **settings)
    with pytest.raises(ConfigError, match=message):
        quiet_trainer(tmp_path, max_steps=1).fit(module, datamodule=data)
