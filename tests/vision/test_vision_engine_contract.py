"""The rollout engine contract (``tests/engine_contract.py``) on vision-language models with the ``transformers``
engine: what it checks on text, checked on prompts with images (issue 42).

Greedy completions equal ``model.generate(do_sample=False)`` given the prompt's images; without filters the
sampled tokens' log-probs are the trainer's (its pass given each row's images), and with temperature, top-k, top-p
and a minimum length those of the filtered distribution the tokens were drawn from (image placeholders suppressed,
as the engine does); masks, truncation and padding follow ``Completions``' rules, the same generator state gives
the same completions; the joint distribution of the first two sampled tokens after an image prompt passes a χ² test
against the model's own.
"""

from __future__ import annotations

import pytest
import torch
from engine_contract import check_rows_end_by_the_rule, chi2_critical, filtered_probs, model_end_ids
from transformers import AutoModelForImageTextToText
from vision_models import encoder_for, image_prompt, shared_vlms, squares

from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.engines.hf import TransformersEngine
from grpo_lightning.engines.token_sampling import filter_logits
from grpo_lightning.integrations.vision.inputs import (
    forward_inputs,
    generation_inputs,
    placeholder_token_ids,
    repeat_rows,
)
from grpo_lightning.integrations.vision.modality import IMAGES
from grpo_lightning.models.logprobs import completion_logprobs

FAMILIES = ["qwen2_vl", "llava", "idefics3"]
ROWS = {  # different lengths (left padding), one and two images, a text-only row
    "prompt": [image_prompt("12+34=", 1), [{"role": "user", "content": "5+6="}], image_prompt("how many?", 2)],
    "images": [[squares(1)], [], [squares(3, "blue"), squares(2, size=(112, 84))]],
}


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


def _setup(path):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    encoder = encoder_for(path)
    engine = TransformersEngine()
    engine.setup(model, encoder.tokenizer, encoder.modality)
    ids, mask, vision = encoder.encode_rows(ROWS)
    return engine, model, encoder.tokenizer, (ids, mask, vision)


def _row_logits(model, vision_row, ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[len(ids), V]``: the model's logits over one unpadded row (its prompt's ``prompt_length`` tokens, then
    sampled ones), given its images."""
    ids, mask = ids[None], torch.ones(1, ids.numel(), dtype=torch.long)
    extra = forward_inputs(model, [vision_row], ids, mask, prompt_width=prompt_length)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **extra).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate_with_the_images(tiny_vlms, family):
    engine, model, tokenizer, (ids, mask, vision) = _setup(tiny_vlms[family])
    max_new = 12
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=max_new, greedy=True), vision=vision)
    assert torch.equal(out.prompt_ids, ids)  # one completion per prompt when greedy
    for row in range(len(ROWS["prompt"])):
        alone = ids[row][mask[row].bool()][None]
        with torch.no_grad():
            theirs = model.generate(
                input_ids=alone, attention_mask=torch.ones_like(alone),
                **generation_inputs(model, [vision[row]], alone),
                max_new_tokens=max_new, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, suppress_tokens=placeholder_token_ids(model),
            )[0, alone.size(1) :].tolist()  # fmt: skip
        length = int(out.completion_mask[row].sum())
        assert out.completion_ids[row, :length].tolist() == theirs[:length]
        assert all(token == tokenizer.pad_token_id for token in theirs[length:])


def _sampling_logprobs(model, out, vision, params: SamplingParams, ends: tuple[int, ...]) -> torch.Tensor:
    """``[N, T]``: each completion token's log-prob under the distribution ``params`` describes, from one unpadded
    forward per row with its prompt's images: the image placeholders suppressed (always: the engine never samples
    them), the end ids banned before ``min_new_tokens``, then temperature, top-k and top-p, renormalised."""
    group = out.completion_ids.size(0) // len(vision)
    expected = torch.zeros(out.completion_ids.shape)
    for row in range(out.completion_ids.size(0)):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        completion = out.completion_ids[row][out.completion_mask[row].bool()]
        logits = _row_logits(model, vision[row // group], torch.cat([prompt, completion]), prompt.numel())[
            prompt.numel() - 1 : -1
        ]
        logits[:, placeholder_token_ids(model)] = float("-inf")
        logits[: params.min_new_tokens, list(ends)] = float("-inf")
        scores = filter_logits(logits.float(), temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        expected[row, : completion.numel()] = scores.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)
    return expected


@pytest.mark.parametrize("family", FAMILIES)
def test_unfiltered_logprobs_are_the_trainers_with_the_images(tiny_vlms, family):
    """No filter but the placeholders' suppression: the tempered policy's log-probs (π_old without a pass) are the
    trainer's pass with each row's images; the sampler's are its distribution without the placeholders, above the
    trainer's by exactly their mass."""
    engine, model, tokenizer, (ids, mask, vision) = _setup(tiny_vlms[family])
    params = SamplingParams(group_size=4, max_new_tokens=8, temperature=0.7)
    assert not params.filtered
    out = engine.generate(
        ids, mask, params, generator=torch.Generator().manual_seed(3), return_logprobs=True, vision=vision
    )
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7,
            vision=repeat_rows(vision, 4), modality=IMAGES)  # fmt: skip
    done = out.completion_mask.bool()
    torch.testing.assert_close(out.policy_logprobs[done], trainer[done], atol=1e-4, rtol=1e-4)
    expected = _sampling_logprobs(model, out, vision, params, model_end_ids(model, tokenizer))
    torch.testing.assert_close(out.logprobs[done], expected[done], atol=1e-4, rtol=1e-4)
    assert (out.logprobs[done] > trainer[done]).all()  # renormalised without the placeholders
    assert (out.logprobs[~done] == 0).all() and (out.policy_logprobs[~done] == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_filtered_logprobs_are_the_sampling_distributions_with_the_images(tiny_vlms, family):
    """With temperature, top-k, top-p and a minimum length, the sampler's log-probs are those of the filtered,
    renormalised distribution each token was drawn from, given its row's images."""
    engine, model, tokenizer, (ids, mask, vision) = _setup(tiny_vlms[family])
    params = SamplingParams(group_size=4, max_new_tokens=8, min_new_tokens=2, temperature=0.7, top_k=5, top_p=0.9)
    out = engine.generate(
        ids, mask, params, generator=torch.Generator().manual_seed(3), return_logprobs=True, vision=vision
    )
    expected = _sampling_logprobs(model, out, vision, params, model_end_ids(model, tokenizer))
    done = out.completion_mask.bool()
    assert torch.isfinite(expected[done]).all()  # no token from outside the filtered support
    torch.testing.assert_close(out.logprobs[done], expected[done], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_truncation_padding_and_seeding_with_the_images(tiny_vlms, family):
    engine, model, tokenizer, (ids, mask, vision) = _setup(tiny_vlms[family])
    params = SamplingParams(group_size=3, max_new_tokens=6, temperature=1.5)
    out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0), vision=vision)
    assert torch.equal(out.prompt_ids, ids.repeat_interleave(3, dim=0))  # groups adjacent
    check_rows_end_by_the_rule(out, model_end_ids(model, tokenizer), (), 0, 6, tokenizer.pad_token_id)
    again = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0), vision=vision)
    assert torch.equal(again.completion_ids, out.completion_ids)
    generator = torch.Generator().manual_seed(0)
    first = engine.generate(ids, mask, params, generator=generator, vision=vision)
    second = engine.generate(ids, mask, params, generator=generator, vision=vision)
    assert not torch.equal(first.completion_ids, second.completion_ids)


def test_token_pairs_after_an_image_prompt_follow_the_model_distribution(tiny_vlms):
    """χ² over the joint distribution of the first two tokens (top-k 3: 9 cells) after a LLaVA image prompt, exact
    from the model's logits given the image: the first step and the next (from a sampled token) both right."""
    engine, model, tokenizer, _ = _setup(tiny_vlms["llava"])
    encoder = encoder_for(tiny_vlms["llava"])
    ids, mask, vision = encoder.encode_rows({"prompt": [image_prompt("3+4=", 1)], "images": [[squares(2)]]})
    temperature, top_k, draws = 0.8, 3, 3000
    params = SamplingParams(
        group_size=draws, max_new_tokens=2, min_new_tokens=2, temperature=temperature, top_k=top_k, batch_size=draws
    )
    out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(7), vision=vision)
    banned = (*model_end_ids(model, tokenizer), *placeholder_token_ids(model))
    first = filtered_probs(_row_logits(model, vision[0], ids[0], ids.size(1))[-1], temperature, top_k, banned)
    expected = {}
    for t1 in first.nonzero().flatten().tolist():
        logits = _row_logits(model, vision[0], torch.cat([ids[0], torch.tensor([t1])]), ids.size(1))[-1]
        second = filtered_probs(logits, temperature, top_k, banned)
        for t2 in second.nonzero().flatten().tolist():
            expected[(t1, t2)] = float(first[t1] * second[t2]) * draws
    counts: dict[tuple[int, int], int] = {}
    for t1, t2 in out.completion_ids.tolist():
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    assert set(counts) <= set(expected)  # no pair outside the filtered support
    chi2 = sum((counts.get(cell, 0) - e) ** 2 / e for cell, e in expected.items())
    assert chi2 < chi2_critical(len(expected) - 1), f"χ² = {chi2:.1f} over {len(expected)} cells"
