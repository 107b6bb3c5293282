"""The teacher plugs into the core (``grpo_lightning/distillation.py``): its settings (``model.teacher``), its
contract and the checks of a run are the core's; the module builds the teacher through the plug-in path
``TEACHER_FACTORY`` (``integrations/distillation/teacher.py: make_teacher``), imported only when a run has a teacher.
"""

from __future__ import annotations

import io

import pytest
import torch
from conftest import TINY
from test_cli_plugins import loaded_after

from grpo_lightning import distillation
from grpo_lightning.config import ConfigError
from grpo_lightning.distillation import DistillationTeacher, TeacherConfig


def test_the_settings_are_the_cores_and_the_teachers_module_gives_the_same_class():
    from grpo_lightning.advantages import distillation_advantages
    from grpo_lightning.models import teacher

    assert TeacherConfig.__module__ == "grpo_lightning.distillation"
    assert teacher.TeacherConfig is TeacherConfig and teacher.distillation_advantages is distillation_advantages
    assert teacher.check_teacher_run is distillation.check_teacher_run
    assert issubclass(teacher.Teacher, DistillationTeacher)
    from grpo_lightning.integrations.distillation.served_teacher import ServedTeacher

    assert issubclass(ServedTeacher, DistillationTeacher)


def test_the_module_imports_the_teacher_only_for_a_run_with_one():
    seen = loaded_after(
        """
        from grpo_lightning.module import GRPOModule
        from grpo_lightning.models.tiny import TinyModelConfig
        tiny = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
        GRPOModule(tiny_model=tiny)
        mark("no teacher")
        from grpo_lightning.distillation import TeacherConfig
        GRPOModule(tiny_model=tiny, teacher=TeacherConfig(url="http://127.0.0.1:9"))
        mark("a teacher")
        """
    )
    assert seen["no teacher"] == []
    assert seen["a teacher"] == [
        "grpo_lightning.integrations.distillation.teacher",
        "grpo_lightning.integrations.distillation.served_teacher",
    ]


class StandInTeacher(DistillationTeacher):
    """A teacher that scores nothing: what the module builds when ``TEACHER_FACTORY`` names it."""

    def __init__(self, config: TeacherConfig) -> None:
        self.config = config

    def build(self, student, tokenizer) -> None:
        pass

    def context_length(self) -> int | None:
        return None

    def check_temperature(self, temperature: float) -> None:
        if temperature != 1.0:
            raise ConfigError("model.teacher: the stand-in scores at temperature 1 only")

    def check_student(self, student) -> None:
        pass

    def logprobs(self, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs):
        return torch.zeros(completion_ids.shape)


def test_the_module_builds_the_teacher_the_factory_path_names(monkeypatch):
    from grpo_lightning.module import GRPOModule

    monkeypatch.setattr(distillation, "TEACHER_FACTORY", "test_teacher_plugin:StandInTeacher")
    module = GRPOModule(tiny_model=TINY, teacher=TeacherConfig(url="http://127.0.0.1:9"))
    assert isinstance(module.teacher, StandInTeacher)
    module.check_teacher(1.0)
    with pytest.raises(ConfigError, match="temperature 1 only"):  # the core's check asks the teacher
        module.check_teacher(0.7)


def test_a_checkpoint_that_names_the_settings_by_their_old_path_still_loads():
    """Checkpoints saved before the move name ``grpo_lightning.models.teacher.TeacherConfig`` in their pickle;
    Lightning reads them with ``weights_only=True``, which allows only the classes registered by those names."""
    import grpo_lightning.module  # noqa: F401  (registers the settings classes, as a run does)

    buffer = io.BytesIO()
    torch.save({"teacher": TeacherConfig("folder", weight=0.5)}, buffer, _use_new_zipfile_serialization=False)
    saved = buffer.getvalue()
    old = saved.replace(b"grpo_lightning.distillation\nTeacherConfig", b"grpo_lightning.models.teacher\nTeacherConfig")
    assert b"grpo_lightning.models.teacher\nTeacherConfig" in old
    loaded = torch.load(io.BytesIO(old), weights_only=True)
    assert loaded["teacher"] == TeacherConfig("folder", weight=0.5)
