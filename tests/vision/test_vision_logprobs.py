"""A row's log-probs under a vision-language model do not depend on the rows that share its micro-batch (issue 42):
per-row image inputs joined per micro-batch, Qwen2-VL's M-RoPE positions right under left padding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText
from vision_models import encoder_for, image_prompt, shared_vlms, squares

from grpo_lightning.integrations.vision.inputs import forward_inputs
from grpo_lightning.integrations.vision.modality import IMAGES
from grpo_lightning.models.logprobs import completion_logprobs


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


ROWS = {
    "prompt": [
        image_prompt("how many squares?", 1),
        [{"role": "user", "content": "a text-only row, longer than the others"}],
        image_prompt("which has more?", 2),
        image_prompt("count", 1),
    ],
    "images": [[squares(2)], [], [squares(1, "blue"), squares(3, size=(112, 84))], [squares(4, "green")]],
}


def _rollout(path):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    encoder = encoder_for(path)
    prompt_ids, prompt_mask, vision = encoder.encode_rows(ROWS)
    lengths = torch.tensor([5, 3, 7, 1])
    completion_mask = (torch.arange(7)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, 60, (4, 7)) * completion_mask  # pad (0) after the end
    return model, (prompt_ids, prompt_mask, completion_ids, completion_mask), vision


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_row_logprobs_do_not_depend_on_the_micro_batch(tiny_vlms, family):
    model, args, vision = _rollout(tiny_vlms[family])
    together = completion_logprobs(model, *args, vision=vision, micro_batch_size=4, modality=IMAGES)[0]
    alone = completion_logprobs(model, *args, vision=vision, micro_batch_size=1, modality=IMAGES)[0]
    order = torch.tensor([3, 0, 2, 1])  # other neighbours, other padding
    pairs = completion_logprobs(
        model, *(a[order] for a in args), vision=[vision[i] for i in order], micro_batch_size=2, modality=IMAGES
    )[0]
    mask = args[3].bool()
    assert together.abs().sum() > 0
    torch.testing.assert_close(together * mask, alone * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(pairs * mask[order], together[order] * mask[order], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_the_images_change_the_logprobs(tiny_vlms, family):
    model, args, vision = _rollout(tiny_vlms[family])
    swapped = [vision[3], vision[1], vision[2], vision[0]]  # rows 0 and 3: one image each, of the same size
    before = completion_logprobs(model, *args, vision=vision, modality=IMAGES)[0]
    after = completion_logprobs(model, *args, vision=swapped, modality=IMAGES)[0]
    assert not torch.allclose(before[0], after[0], atol=1e-4)
    torch.testing.assert_close(before[1:3], after[1:3], atol=1e-5, rtol=0)


def test_qwen2_vl_positions_are_the_models_own_under_left_padding(tiny_vlms):
    """Row 0 left-padded in the batch gets the 3-D M-RoPE positions the model itself gives it alone, unpadded."""
    model, (prompt_ids, prompt_mask, _, _), vision = _rollout(tiny_vlms["qwen2_vl"])
    batch = forward_inputs(model, vision, prompt_ids, prompt_mask, prompt_width=prompt_ids.size(1))[
        "position_ids"
    ]  # [3, B, P]
    real = prompt_mask[0].bool()
    alone_ids = prompt_ids[:1, real]
    alone = forward_inputs(model, vision[:1], alone_ids, torch.ones_like(alone_ids), prompt_width=alone_ids.size(1))
    alone = alone["position_ids"]
    assert batch.shape[0] == 3 and not torch.equal(alone[0], alone[1])  # 3-D: the image's rows and columns differ
    torch.testing.assert_close(batch[:, 0, real], alone[:, 0])
    own, _ = model.model.get_rope_index(
        alone_ids, mm_token_type_ids=(alone_ids == model.config.image_token_id).int(),
        image_grid_thw=vision[0]["image_grid_thw"],
    )  # fmt: skip
    torch.testing.assert_close(alone, own)


def test_qwen2_vl_positions_once_per_prompt_equal_the_models_over_the_whole_batch(tiny_vlms):
    """``forward_inputs`` computes the 3-D positions once per prompt head and counts the rest on: equal, exactly, to
    the model's own ``get_rope_index`` over the whole batch of prompts + completions, G rows a prompt (rows that
    share their head, rows that do not), a text-only row, a two-image row, other paddings."""
    from grpo_lightning.integrations.vision.inputs import modality_types, repeat_rows

    model, (prompt_ids, prompt_mask, _, _), vision = _rollout(tiny_vlms["qwen2_vl"])
    group = 3
    ids, mask = prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
    rows = repeat_rows(vision, group)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (len(rows),), generator=generator)
    completion_mask = (torch.arange(8)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, 60, (len(rows), 8), generator=generator) * completion_mask
    input_ids, attention = torch.cat([ids, completion_ids], 1), torch.cat([mask, completion_mask], 1)
    fast = forward_inputs(model, rows, input_ids, attention, prompt_width=ids.size(1))["position_ids"]
    grids = [row["image_grid_thw"] for row in rows if "image_grid_thw" in row]
    own, _ = model.model.get_rope_index(
        input_ids, mm_token_type_ids=modality_types(model.config, input_ids), image_grid_thw=torch.cat(grids),
        attention_mask=attention,
    )  # fmt: skip
    real = attention.bool()
    assert torch.equal(fast[:, real], own[:, real]) and not torch.equal(fast[0], fast[1])
