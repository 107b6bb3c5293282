"""Every processor output a vision-language model's forward reads reaches it, in the trainer's passes and in
``generate()`` (issue 50): on every tiny family, the log-probs of a completion equal the model's own forward on its
own processor's outputs for that one prompt (Gemma 3's ``token_type_ids``: each image's tokens attend both ways;
PaliGemma's: the prompt is a prefix attended both ways), whatever rows share the micro-batch; a model whose forward
reads an output the passes would drop is refused when it loads."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForImageTextToText
from vision_models import encoder_for, image_prompt, shared_vlms, squares

import grpo_lightning.integrations.vision.inputs as vision_inputs
from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.engines.hf import TransformersEngine
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.vision.inputs import forward_inputs, generation_inputs, join_rows, repeat_rows
from grpo_lightning.integrations.vision.modality import IMAGES
from grpo_lightning.integrations.vision.tiny import VLM_FAMILIES
from grpo_lightning.integrations.vllm.engine import VLLMEngine
from grpo_lightning.integrations.vllm.server import VLLMServerEngine
from grpo_lightning.modality import modality_for
from grpo_lightning.models.build import load_tokenizer
from grpo_lightning.models.logprobs import completion_logprobs

# What ``generate()`` gives a token it appends, in each per-token input (the generic rule repeats the prompt's last
# value, 0 here; PaliGemma's own appends 1: the causal suffix).
APPENDED = {"token_type_ids": {"paligemma": 1}, "mm_token_type_ids": {}}


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


def text_then_images(text: str, images: int) -> list[dict]:
    """A one-message conversation: ``text``, then ``images`` image parts (the images next to the completion: the
    attention over them weighs most there)."""
    return [{"role": "user", "content": [{"type": "text", "text": text}, *({"type": "image"} for _ in range(images))]}]


def rows_for(family: str) -> dict:
    """Prompts of different lengths (left padding), one and two images of other sizes, before or after the text,
    and a text-only row (not for PaliGemma, whose processor takes no prompt without an image)."""
    prompts = [text_then_images("how many squares?", 1), image_prompt("which has more?", 2), text_then_images("n", 1)]
    images = [[squares(2)], [squares(1, "blue"), squares(3, size=(112, 84))], [squares(4, "green")]]
    if family != "paligemma":
        prompts.insert(1, [{"role": "user", "content": "a text-only row, longer than the others"}])
        images.insert(1, [])
    return {"prompt": prompts, "images": images}


def own_logprobs(model, encoder, prompt, images, completion: torch.Tensor) -> torch.Tensor:
    """The model's own forward on one prompt, unpadded: its processor's outputs, the completion appended to every
    per-token one as ``generate()`` appends it; the completion tokens' log-probs."""
    text = encoder.texts([prompt])[0]
    out = encoder.processor(
        text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False
    )
    ids = torch.cat([out.pop("input_ids")[0], completion])[None]
    out.pop("attention_mask"), out.pop("labels", None)
    family = model.config.model_type
    for name, appended in APPENDED.items():
        if name in out:
            tail = torch.full_like(completion, appended.get(family, 0))
            out[name] = torch.cat([out[name][0], tail])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **out).logits[0]
    logits = logits[-completion.numel() - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)


def _setup(path, family):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    encoder = encoder_for(path)
    rows = rows_for(family)
    prompt_ids, prompt_mask, vision = encoder.encode_rows(rows)
    return model, encoder, rows, (prompt_ids, prompt_mask, vision)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_every_processor_output_the_forward_reads_reaches_the_passes_and_generate(tiny_vlms, family):
    """Each row's processor outputs that the model's forward takes, in the inputs of a trainer's pass over the
    left-padded batch + completions and of ``generate()`` over the prompts: per-token ones at the row's real columns
    (the completion's as ``generate()`` appends them), per-image ones joined in row order."""
    model, encoder, rows, (prompt_ids, prompt_mask, vision) = _setup(tiny_vlms[family], family)
    reads = inspect.signature(model.forward).parameters
    completion = torch.full((len(vision), 3), 7)
    input_ids = torch.cat([prompt_ids, completion], 1)
    attention = torch.cat([prompt_mask, torch.ones_like(completion)], 1)
    passes = {
        "pass": forward_inputs(model, vision, input_ids, attention, prompt_width=prompt_ids.size(1)),
        "generate": generation_inputs(model, vision, prompt_ids),
    }
    per_image: dict[str, list] = {}
    for row, (prompt, images) in enumerate(zip(rows["prompt"], rows["images"])):
        text = encoder.texts([prompt])[0]
        own = encoder.processor(
            text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False
        )
        real = prompt_mask[row].bool()
        assert torch.equal(prompt_ids[row, real], own["input_ids"][0])
        for name, value in own.items():
            if name in ("input_ids", "attention_mask", "labels") or name not in reads:
                continue
            if name in APPENDED:  # per token
                tail = torch.full((3,), APPENDED[name].get(family, 0))
                assert torch.equal(
                    passes["pass"][name][row, real.nonzero().min() :].long(), torch.cat([value[0], tail])
                )
                assert torch.equal(passes["generate"][name][row, real].long(), value[0]), name
            else:
                per_image.setdefault(name, []).append(value)
    for name, values in per_image.items():
        for inputs in passes.values():
            assert torch.equal(inputs[name], join_rows([{name: v} for v in values])[name]), name


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_logprobs_are_the_models_own_forward_whatever_the_batch(tiny_vlms, family):
    model, encoder, rows, (prompt_ids, prompt_mask, vision) = _setup(tiny_vlms[family], family)
    n = len(vision)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 7, 1, 6][:n])
    completion_mask = (torch.arange(7)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, 60, (n, 7), generator=generator) * completion_mask  # pad (0) after the end
    args = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    with torch.no_grad():
        together = completion_logprobs(model, *args, vision=vision, micro_batch_size=n, modality=IMAGES)[0]
        alone = completion_logprobs(model, *args, vision=vision, micro_batch_size=1, modality=IMAGES)[0]
        order = torch.arange(n).flip(0)  # other neighbours, other padding
        pairs = completion_logprobs(
            model, *(a[order] for a in args), vision=[vision[i] for i in order], micro_batch_size=2, modality=IMAGES
        )[0][order.argsort()]
    for row in range(n):
        completion = completion_ids[row, : lengths[row]]
        own = own_logprobs(model, encoder, rows["prompt"][row], rows["images"][row], completion)
        for name, ours in (("together", together), ("alone", alone), ("pairs", pairs)):
            torch.testing.assert_close(ours[row, : lengths[row]], own, atol=1e-5, rtol=0, msg=f"{name}, row {row}")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_generate_samples_from_the_models_own_forward(tiny_vlms, family):
    """The transformers engine's tempered log-probs of what it sampled (``generate()``'s own logits) are the model's
    own forward's on its processor's outputs: ``generate()`` was given every input the model reads."""
    model, encoder, rows, (prompt_ids, prompt_mask, vision) = _setup(tiny_vlms[family], family)
    engine = TransformersEngine()
    engine.setup(model, encoder.tokenizer, encoder.modality)
    params = SamplingParams(group_size=2, max_new_tokens=6, temperature=1.0)
    out = engine.generate(
        prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(1), return_logprobs=True, vision=vision
    )
    with torch.no_grad():
        trainer = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
            vision=repeat_rows(vision, 2), modality=IMAGES)[0]  # fmt: skip
    for row in range(out.completion_ids.size(0)):
        length = int(out.completion_mask[row].sum())
        completion = out.completion_ids[row, :length]
        own = own_logprobs(model, encoder, rows["prompt"][row // 2], rows["images"][row // 2], completion)
        torch.testing.assert_close(out.policy_logprobs[row, :length], own, atol=1e-5, rtol=0)
        torch.testing.assert_close(trainer[row, :length], own, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "rule,message",
    [
        (None, r"by a rule grpo_lightning does not know \(model_type gemma3\)"),
        ("prefix", r"which its ids do not give back"),
    ],
)
def test_a_model_whose_token_types_no_pass_would_give_is_refused_when_it_loads(tiny_vlms, monkeypatch, rule, message):
    """Gemma 3 with its rule unknown, or another rule than its processor's (PaliGemma's): refused in one line."""
    if rule is None:
        monkeypatch.delitem(vision_inputs.TOKEN_TYPE_RULES, "gemma3")
    else:
        monkeypatch.setitem(vision_inputs.TOKEN_TYPE_RULES, "gemma3", rule)
    with pytest.raises(ConfigError, match=r"^model.model_name_or_path .*gemma3.*'token_type_ids', " + message):
        load_tokenizer(str(tiny_vlms["gemma3"]))


def test_what_a_prefix_language_model_cannot_do_is_refused_before_training(tiny_vlms):
    """PaliGemma: a prompt without an image (its processor takes none), and a multi-turn environment (a later turn's
    prefix would be its whole context when sampled, the first prompt alone in the passes)."""
    encoder = encoder_for(tiny_vlms["paligemma"])
    rows = {"prompt": [image_prompt("n", 1), [{"role": "user", "content": "text"}]], "images": [[squares(1)], []]}
    with pytest.raises(ConfigError, match=r"^data.dataset row 1: a prompt without an image, which PaliGemmaProcessor"):
        encoder.check_rows(rows, "data.dataset")
    encoder_for(tiny_vlms["gemma3"]).check_rows(rows, "data.dataset")  # Gemma 3's takes one
    environment = ToolEnvironment(tools=["calculator"])
    with pytest.raises(ConfigError, match=r"^data.environment: paligemma is a prefix language model"):
        modality_for(str(tiny_vlms["paligemma"])).check_run(TransformersEngine(), environment)
    modality_for(str(tiny_vlms["gemma3"])).check_run(TransformersEngine(), environment)


@pytest.mark.parametrize("engine_class", [VLLMEngine, VLLMServerEngine])
@pytest.mark.parametrize("family", ["gemma3", "paligemma"])
def test_an_engine_not_checked_to_follow_token_types_is_refused_before_training(tiny_vlms, family, engine_class):
    """vLLM's engines are not checked to sample Gemma 3 / PaliGemma with the attention their forward reads from
    ``token_type_ids`` (``RolloutEngine.follows_token_types``): refused in one line, before any engine starts (the
    declaration is the class's, read without vLLM installed)."""
    engine = engine_class.__new__(engine_class)
    with pytest.raises(ConfigError, match=rf"^data.engine: {engine.name} is not checked to sample {family} "):
        modality_for(str(tiny_vlms[family])).check_run(engine, None)
    modality_for(str(tiny_vlms["qwen2_vl"])).check_run(engine, None)  # a model without token types
