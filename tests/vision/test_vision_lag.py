"""A rollout lag with a vision-language model (issue 42, ``data.schedule.rollout_lag`` ≥ 1): the background process
builds the model (``AutoModelForImageTextToText``) and its processor, samples each row with its own images, and sends
each row's image inputs back; the trainer's π_old pass gives every row its images."""

from __future__ import annotations

import pickle

import torch
from conftest import quiet_trainer
from lightning import Callback
from test_vision_fit import vision_run
from transformers import AutoModelForImageTextToText
from vision_models import encoder_for, image_prompt, squares

from grpo_lightning.config import ScheduleConfig
from grpo_lightning.integrations.vision.inputs import forward_inputs, placeholder_token_ids
from grpo_lightning.integrations.vision.modality import IMAGES
from grpo_lightning.integrations.vision.models import model_from_config
from grpo_lightning.integrations.vision.tiny import build_tiny_vlm
from grpo_lightning.models.logprobs import completion_logprobs


class Snapshots(Callback):
    """The policy's weights at each round's start, and each round's rollout as trained on."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.rollouts: list = []

    def on_train_epoch_start(self, trainer, module):
        self.weights.append({name: value.detach().clone() for name, value in module.policy.state_dict().items()})

    def on_train_epoch_end(self, trainer, module):
        self.rollouts.append(trainer.datamodule.last_rollout)


def sampled_logprobs(model, rollout) -> torch.Tensor:
    """``[N, T]``: each completion token's log-prob under the distribution it was drawn from, given its row's images:
    the model's (temperature 1, no filter) with the image placeholders suppressed, as the engine samples."""
    prompt_ids, completion_ids = rollout.prompt_ids.cpu(), rollout.completion_ids.cpu()
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([rollout.prompt_mask.cpu(), rollout.completion_mask.cpu()], 1)
    with torch.no_grad():
        extra = forward_inputs(model, rollout.vision, ids, attention, prompt_width=prompt_ids.size(1))
        logits = model(input_ids=ids, attention_mask=attention, **extra).logits[:, prompt_ids.size(1) - 1 : -1]
    logits[..., placeholder_token_ids(model)] = float("-inf")
    return logits.float().log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)


def test_the_processor_and_encoder_pickle_for_the_background_process(tmp_path):
    """What the worker is sent: the Qwen2-VL processor built for images alone (a class made at run time) pickles,
    and the copy encodes a prompt and its image exactly as the original does."""
    encoder = encoder_for(build_tiny_vlm("qwen2_vl", tmp_path / "qwen2_vl"))
    copy = pickle.loads(pickle.dumps(encoder))
    assert type(copy.processor).__name__ == "Qwen2VLProcessor" and copy.processor.video_processor is None
    rows = {"prompt": [image_prompt("How many?", 1)], "images": [[squares(2)]]}
    ids, mask, vision = encoder.encode_rows(rows)
    copy_ids, copy_mask, copy_vision = copy.encode_rows(rows)
    assert torch.equal(ids, copy_ids) and torch.equal(mask, copy_mask)
    assert vision[0].keys() == copy_vision[0].keys() == {"pixel_values", "image_grid_thw"}
    assert all(torch.equal(vision[0][k], copy_vision[0][k]) for k in vision[0])


def test_model_from_config_builds_the_vision_language_architecture(tmp_path):
    folder = build_tiny_vlm("llava", tmp_path / "llava")
    policy = AutoModelForImageTextToText.from_pretrained(str(folder))
    built = model_from_config(policy.config, torch.float32)
    assert type(built) is type(policy)
    built.load_state_dict(policy.state_dict())  # strict: the same names, every one


def test_a_lag_of_one_samples_with_each_rows_images_and_pi_old_is_right(tmp_path):
    """Three rounds at lag 1 through the ``Trainer``: round k is sampled in the background by the weights of round
    k − 1 (round 0 by the first), the log-probs each row was sampled with are those of the model under those
    weights given the row's own images (its image placeholders suppressed, as the engine samples), and π_old (the
    weights at round k's start) is recomputed with them."""
    module, data = vision_run(tmp_path, schedule=ScheduleConfig(rollout_lag=1))
    snapshots = Snapshots()
    trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=[snapshots])
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 6
    rollouts = snapshots.rollouts
    assert [r.metrics["rollout/lag"] for r in rollouts] == [0.0, 1.0, 1.0]
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "qwen2_vl")).eval()
    for k, rollout in enumerate(rollouts):
        image_rows = [i for i, p in enumerate(rollout.prompts) if isinstance(p[0]["content"], list)]
        assert image_rows and all("image_grid_thw" in rollout.vision[i] for i in image_rows)
        assert all(len(rollout.images[i]) == 1 for i in image_rows)  # the prompts' images, for the logs
        mask = rollout.completion_mask.bool()
        model.load_state_dict(snapshots.weights[k - int(rollout.metrics["rollout/lag"])])
        torch.testing.assert_close(
            rollout.engine_logprobs[mask], sampled_logprobs(model, rollout)[mask], atol=1e-4, rtol=0
        )
        model.load_state_dict(snapshots.weights[k])
        with torch.no_grad():
            old, _ = completion_logprobs(
                model, rollout.prompt_ids.cpu(), rollout.prompt_mask.cpu(), rollout.completion_ids.cpu(),
                rollout.completion_mask.cpu(), vision=rollout.vision, modality=IMAGES)  # fmt: skip
        torch.testing.assert_close(rollout.old_logprobs[mask], old[mask], atol=1e-4, rtol=0)
    # The later rounds were sampled by older weights than they trained from: the two differ there.
    assert not torch.allclose(rollouts[2].engine_logprobs, rollouts[2].old_logprobs, atol=1e-4)
