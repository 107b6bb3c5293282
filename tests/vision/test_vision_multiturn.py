"""Multi-turn rollouts with a vision-language model (issue 42, ``data.environment``): the first prompt holds the
images, the calculator tool's observations are text appended in token space, and every log-prob pass gives each
trajectory its prompt's images."""

from __future__ import annotations

import string

import pytest
import torch
from conftest import quiet_trainer
from test_vision_fit import vision_run
from transformers import AutoModelForImageTextToText
from vision_models import encoder_for, image_prompt, shared_vlms, squares

from grpo_lightning import SamplingConfig
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.engines.hf import TransformersEngine
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.environments.base import Step
from grpo_lightning.integrations.environments.multiturn import generate_trajectories
from grpo_lightning.integrations.vision.modality import IMAGES
from grpo_lightning.integrations.vision.models import vision_towers
from grpo_lightning.integrations.vision.vllm_inputs import engine_prompts, image_token_id
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.rollout.sample_and_score import repeat_each

HINT = " Use the calculator."
ROWS = {
    "prompt": [image_prompt("count", 1), [{"role": "user", "content": "text only"}], image_prompt("which?", 2)],
    "images": [[squares(1)], [], [squares(3, "blue"), squares(2, size=(112, 84))]],
}


class EveryTurnCallsTheCalculator(ToolEnvironment):
    """The calculator tool environment, with every policy turn ended after its first character and read as the
    call ``6*7``: a random tiny model's trajectories then have several turns, each observation the tool's text
    (``<result>42</result>``). Each trajectory's prompt is its own (``HINT`` appended, as TRL's environments do),
    so it is rendered again with its images."""

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return tuple(string.printable)

    def step(self, turn: str) -> Step:
        return super().step("<tool>calculator: 6*7</tool>")

    def trajectory_prompt(self, prompt):
        last = prompt[-1]
        content = last["content"]
        hinted = [*content, {"type": "text", "text": HINT}] if isinstance(content, list) else content + HINT
        return [*prompt[:-1], {**last, "content": hinted}]


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_every_turn_is_sampled_and_scored_with_the_prompts_images(tiny_vlms, family):
    """Three policy turns per trajectory with two calculator observations between them; the log-probs each turn
    was sampled with (the engine's, with the images) are those of the trainer's pass over the whole trajectory,
    given each row's images; without the images they differ."""
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlms[family]), dtype=torch.float32).eval()
    encoder = encoder_for(tiny_vlms[family])
    engine = TransformersEngine()
    engine.setup(model, encoder.tokenizer, encoder.modality)
    trajectories = generate_trajectories(
        ROWS, engine=engine, encoder=encoder, environment=EveryTurnCallsTheCalculator(format="tag", max_turns=3),
        params=SamplingParams(group_size=2, max_new_tokens=64), generator=torch.Generator().manual_seed(0),
        return_logprobs=True,
    )  # fmt: skip
    out = trajectories.completions
    assert trajectories.stats["turns"] == [3.0] * 6
    assert all(t.count("<result>42</result>") == 2 for t in trajectories.transcripts)
    # Each trajectory's own prompt (the hint appended) holds its images' tokens: as many as its row's alone.
    _, _, prompt_vision = encoder.encode_rows(ROWS)
    for got, expected in zip(trajectories.vision, repeat_each(prompt_vision, 2), strict=True):
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    for row in range(6):
        text = encoder.tokenizer.decode(out.prompt_ids[row][out.prompt_mask[row].bool()])
        assert HINT in text
        alone = encoder.text_inputs(encoder.render(EveryTurnCallsTheCalculator().trajectory_prompt(
            ROWS["prompt"][row // 2])), ROWS["images"][row // 2])[0]  # fmt: skip
        assert out.prompt_ids[row][out.prompt_mask[row].bool()].tolist() == alone
        # its image inputs know that prompt: a vLLM engine is given its whole context, the prompt unexpanded
        context = [*alone, *out.completion_ids[row][out.completion_mask[row].bool()].tolist()]
        (request,) = engine_prompts([context], [trajectories.vision[row]], image_token_id(model.config))
        assert request["prompt_token_ids"][-len(context) + len(alone) :] == context[len(alone) :]
        assert HINT in encoder.tokenizer.decode(request["prompt_token_ids"])
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            model,
            out.prompt_ids,
            out.prompt_mask,
            out.completion_ids,
            out.completion_mask,
            vision=trajectories.vision,
            modality=IMAGES,
        )
        blind = [{**v, "pixel_values": -v["pixel_values"]} if v else v for v in trajectories.vision]
        without, _ = completion_logprobs(
            model,
            out.prompt_ids,
            out.prompt_mask,
            out.completion_ids,
            out.completion_mask,
            vision=blind,
            modality=IMAGES,
        )
    action = trajectories.action_mask.bool()
    assert action.sum() == 18 and (out.completion_mask.bool() & ~action).sum() > 0  # observations: context only
    torch.testing.assert_close(trainer[action], out.policy_logprobs[action], atol=1e-4, rtol=0)
    image_rows = torch.tensor([0, 1, 4, 5])
    assert not torch.allclose(trainer[image_rows][action[image_rows]], without[image_rows][action[image_rows]])


def test_two_rounds_of_tool_calls_train_a_vision_language_model(tmp_path):
    """``data.environment`` through the ``Trainer``: trajectories of several turns with the images in the first
    prompt, the observations out of the loss, π_old and π_ref with each row's images, the language model trained
    and the vision tower frozen."""
    module, data = vision_run(
        tmp_path,
        environment=EveryTurnCallsTheCalculator(format="tag", max_turns=2),
        sampling=SamplingConfig(group_size=2, max_new_tokens=32, temperature=1.0),
    )
    module.configure_model()
    tower = {name: p.detach().clone() for name, p in vision_towers(module.policy)[0].named_parameters()}
    head = module.policy.lm_head.weight.detach().clone()
    trainer = quiet_trainer(tmp_path, max_epochs=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4
    rollout = data.last_rollout
    assert rollout.turn_stats["turns"] == [2.0] * 6 and len(rollout.vision) == len(rollout.images) == 6
    assert rollout.old_logprobs is not None and rollout.ref_logprobs is not None
    observations = rollout.completion_mask.bool() & ~rollout.action_mask.bool()
    assert observations.any() and not rollout.loss_mask[observations].any()
    assert not torch.equal(module.policy.lm_head.weight, head)
    for name, p in vision_towers(module.policy)[0].named_parameters():
        torch.testing.assert_close(p, tower[name], rtol=0, atol=0)
