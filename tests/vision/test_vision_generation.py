"""Generation with images on the transformers engine (issue 42): G completions per prompt, each prompt's own images
(greedy completions in a batch are those of each prompt alone), seeded, and never an image placeholder token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText
from vision_models import encoder_for, image_prompt, shared_vlms, squares

from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.engines.hf import TransformersEngine
from grpo_lightning.integrations.vision.inputs import placeholder_token_ids, repeat_rows
from grpo_lightning.integrations.vision.modality import IMAGES
from grpo_lightning.models.logprobs import completion_logprobs


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


ROWS = {
    "prompt": [image_prompt("count", 1), [{"role": "user", "content": "text only"}], image_prompt("which?", 2)],
    "images": [[squares(1)], [], [squares(3, "blue"), squares(2, size=(112, 84))]],
}


def _engine(path):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    encoder = encoder_for(path)
    engine = TransformersEngine()
    engine.setup(model, encoder.tokenizer, encoder.modality)
    return engine, encoder


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_greedy_completions_in_a_batch_are_each_prompts_own(tiny_vlms, family):
    engine, encoder = _engine(tiny_vlms[family])
    greedy = SamplingParams(greedy=True, max_new_tokens=6)
    ids, mask, vision = encoder.encode_rows(ROWS)
    together = engine.generate(ids, mask, greedy, return_logprobs=True, vision=vision)
    for row in range(3):
        alone_ids, alone_mask, alone_vision = encoder.encode_rows({k: v[row : row + 1] for k, v in ROWS.items()})
        alone = engine.generate(alone_ids, alone_mask, greedy, return_logprobs=True, vision=alone_vision)
        length = int(alone.completion_mask.sum())
        assert torch.equal(together.completion_ids[row, :length], alone.completion_ids[0, :length])
        torch.testing.assert_close(together.logprobs[row, :length], alone.logprobs[0, :length], atol=1e-5, rtol=0)
    # The first row's image is what it sees: other pixels, another first-token distribution (the argmax of a random
    # model may stay the same; its log-prob does not).
    changed = [{**vision[0], "pixel_values": vision[0]["pixel_values"] * -1}, vision[1], vision[2]]
    other = engine.generate(ids, mask, greedy, return_logprobs=True, vision=changed)
    assert not torch.allclose(other.logprobs[0, 0], together.logprobs[0, 0], atol=1e-4)
    torch.testing.assert_close(other.logprobs[1:], together.logprobs[1:], atol=1e-5, rtol=0)


def test_g_seeded_completions_per_prompt_without_image_placeholders(tiny_vlms):
    engine, encoder = _engine(tiny_vlms["qwen2_vl"])
    params = SamplingParams(group_size=4, max_new_tokens=30)
    ids, mask, vision = encoder.encode_rows(ROWS)
    first = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(1), vision=vision)
    again = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(1), vision=vision)
    assert first.completion_ids.size(0) == 12 and torch.equal(first.completion_ids, again.completion_ids)
    assert torch.equal(first.prompt_ids, ids.repeat_interleave(4, dim=0))
    placeholders = torch.tensor(placeholder_token_ids(engine.policy))
    assert (
        placeholders.numel() and not torch.isin(first.completion_ids[first.completion_mask.bool()], placeholders).any()
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_the_samplers_logprobs_are_the_trainers_for_every_row_of_every_group(tiny_vlms, family):
    """G > 1 with a two-image prompt: ``generate()`` expands each prompt's images to its G rows; the log-probs it
    sampled with are those the trainer's pass computes from each row's own images (π_old without a pass)."""
    engine, encoder = _engine(tiny_vlms[family])
    ids, mask, vision = encoder.encode_rows(ROWS)
    out = engine.generate(
        ids, mask, SamplingParams(group_size=3, max_new_tokens=8), generator=torch.Generator().manual_seed(0),
        return_logprobs=True, vision=vision,
    )  # fmt: skip
    rows = repeat_rows(vision, 3)
    trainer = completion_logprobs(
        engine.policy,
        out.prompt_ids,
        out.prompt_mask,
        out.completion_ids,
        out.completion_mask,
        vision=rows,
        modality=IMAGES,
    )[0]
    torch.testing.assert_close(trainer, out.policy_logprobs * out.completion_mask, atol=1e-4, rtol=0)
