"""On-policy distillation of a vision-language student (issue 50): a vision-language teacher scores each completion
given the row's images, as its own forward on its own processor's outputs does; a teacher that cannot see the images
(a text model, a served one) or whose processor encodes them otherwise is refused before training."""

from __future__ import annotations

import json

import pytest
import torch
from test_vision_families import own_logprobs, rows_for
from transformers import AutoModelForImageTextToText
from vision_models import encoder_for

from grpo_lightning import GRPOModule
from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.distillation.teacher import TeacherConfig
from grpo_lightning.integrations.vision.tiny import build_tiny_vlm, build_vlm_tokenizer
from grpo_lightning.models.tiny import TinyModelConfig, build_tiny_llama
from grpo_lightning.rollout.batch import RolloutBatch


def _batch(folder, family: str) -> tuple[RolloutBatch, dict]:
    """Each row of ``rows_for(family)`` encoded by the student's processor, with a random completion."""
    rows = rows_for(family)
    prompt_ids, prompt_mask, vision = encoder_for(folder).encode_rows(rows)
    n = len(vision)
    lengths = torch.tensor([5, 3, 7, 2, 6][:n])
    completion_mask = (torch.arange(7)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, 60, (n, 7), generator=torch.Generator().manual_seed(0)) * completion_mask
    batch = RolloutBatch(
        prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(n, dtype=torch.bool), torch.zeros(n)
    )
    batch.vision = vision
    return batch, rows


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_a_vision_teacher_scores_each_completion_with_the_students_images(tmp_path, family):
    """The teacher's log-probs (``GRPOModule.teacher_logprobs``, micro-batches of 2 rows) equal the teacher model's
    own forward on its own processor's outputs for each prompt, images included; with other images they differ."""
    student = build_tiny_vlm(family, tmp_path / "student", seed=0)
    teacher = build_tiny_vlm(family, tmp_path / "teacher", seed=1)
    module = GRPOModule(
        model_name_or_path=str(student), teacher=TeacherConfig(model_name_or_path=str(teacher)), logprob_batch_size=2
    )
    module.check_teacher(1.0)
    module.configure_model()
    batch, rows = _batch(student, family)
    scored = module.teacher_logprobs(batch)
    model = AutoModelForImageTextToText.from_pretrained(str(teacher), dtype=torch.float32).eval()
    encoder = encoder_for(teacher)
    for row in range(len(batch)):
        length = int(batch.completion_mask[row].sum())
        completion = batch.completion_ids[row, :length]
        own = own_logprobs(model, encoder, rows["prompt"][row], rows["images"][row], completion)
        torch.testing.assert_close(scored[row, :length], own, atol=1e-5, rtol=0)
    other = {**rows, "images": [[image.transpose(0) for image in images] for images in rows["images"]]}
    mirrored = encoder_for(student).encode_rows(other)[2]  # the same sizes, other pixels
    seen = module.teacher.logprobs(
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
        vision=mirrored,
        modality=module.modality,
    )
    assert (seen - scored).abs().max() > 1e-3, (seen - scored).abs().max()  # the images count


def test_a_teacher_that_cannot_see_the_images_is_refused_before_training(tmp_path):
    """A text teacher with the student's very vocabulary (so no other check stops it), and a served teacher: each
    refused in one line by the check before training, before any model loads."""
    student = str(build_tiny_vlm("qwen2_vl", tmp_path / "student"))
    tokenizer = build_vlm_tokenizer("qwen2_vl")
    text_teacher = tmp_path / "text_teacher"
    build_tiny_llama(TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2), tokenizer).save_pretrained(
        text_teacher
    )
    tokenizer.save_pretrained(text_teacher)
    module = GRPOModule(model_name_or_path=student, teacher=TeacherConfig(model_name_or_path=str(text_teacher)))
    with pytest.raises(ConfigError, match=r"^model.teacher.model_name_or_path .* is a text model and model.model_name"):
        module.check_teacher(1.0)
    served = GRPOModule(model_name_or_path=student, teacher=TeacherConfig(url="http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match=r"^model.teacher.url: a served teacher scores token ids without images .* "):
        served.check_teacher(1.0)
    GRPOModule(teacher=TeacherConfig(url="http://127.0.0.1:9")).check_teacher(1.0)  # a text student: fine


def test_a_teacher_whose_processor_encodes_the_images_otherwise_is_refused(tmp_path):
    student = build_tiny_vlm("llava", tmp_path / "student", seed=0)
    teacher = build_tiny_vlm("llava", tmp_path / "teacher", seed=1)
    config_file = teacher / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]
    config_file.write_text(json.dumps(config))
    module = GRPOModule(model_name_or_path=str(student), teacher=TeacherConfig(model_name_or_path=str(teacher)))
    with pytest.raises(
        ConfigError,
        match=r"^model.teacher.model_name_or_path .* otherwise than the student's \(another 'pixel_values'\)",
    ):
        module.configure_model()
