"""The teacher of on-policy distillation (``model.teacher``): a frozen model that scores every token the student
samples.

On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025; the last stage of DeepSeek-R1's
pipeline): the student samples, the teacher gives the log-prob of each sampled token, and the per-token signal is
minus the reverse KL's estimate on the student's own sample,

    A_t = λ · (log π_T(y_t | y_<t) − log π_S(y_t | y_<t)),      y ~ π_S,

whose expectation over the student's token is −KL(π_S ‖ π_T) at that position. It is a dense advantage: added to
each token's group-relative advantage (or alone), it goes through the configured policy loss, its clipping and its
off-policy corrections, so it works with every engine and at a lag. π_S is the student as the round's log-prob
passes see it (π_old at lag 0, π_prox at a lag), at the sampling temperature; the teacher scores at the same one
unless ``temperature`` (τ_T) sets its own. λ may change over the rounds (``weight_schedule``: linear, cosine or
step down to 0, after which the rewards teach alone).

TRL's ``DistillationTrainer`` (beta = 1, on-policy) differentiates the full-vocabulary reverse KL of each position
instead; ``reverse_kl_per_token`` computes that quantity, equal to TRL's per-token divergence on the same logits
(``tests/losses/test_distillation.py``); a round logs the mean of its sampled estimate, ``distill/reverse_kl_k1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.advantages import distillation_advantages
from grpo_lightning.config import ConfigError
from grpo_lightning.distillation import DistillationTeacher, TeacherConfig, check_teacher_run
from grpo_lightning.integrations.distillation.served_teacher import ServedTeacher
from grpo_lightning.modality import TEXT, Modality
from grpo_lightning.models.build import disable_dropout, load_tokenizer, model_modality
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.sources import config_context_length, load_model_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SETTING = "model.teacher.model_name_or_path"  # what a one-line error about the teacher's path names

# The settings, the run's checks and the advantage are the core's (``grpo_lightning/distillation.py``,
# ``advantages.py``); importable from here as before.
__all__ = [
    "Teacher",
    "TeacherConfig",
    "check_same_vocabulary",
    "check_teacher_run",
    "distillation_advantages",
    "load_teacher",
    "make_teacher",
    "reverse_kl_per_token",
]


def make_teacher(config: TeacherConfig) -> DistillationTeacher:
    """The teacher of ``config`` (``distillation.TEACHER_FACTORY``): loaded here (``Teacher``), or reached on its
    server (``ServedTeacher``)."""
    if config.url:
        return ServedTeacher(config)
    return Teacher(config)


class Teacher(DistillationTeacher):
    """The module's teacher: built with the policy (``build``), its log-prob pass run where π_ref's runs.

    Not an ``nn.Module`` attribute of the LightningModule on purpose: it stays on its own device and dtype (Lightning
    moves and casts the module's children), out of checkpoints (it is re-loaded from its folder) and out of the
    optimizer.
    """

    def __init__(self, config: TeacherConfig) -> None:
        self.config = config
        self.model: PreTrainedModel | None = None
        self.student_modality: Modality = TEXT  # what the student's rows add to their ids (``build``)

    def build(self, student: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, modality: Modality = TEXT) -> None:
        """Load the teacher for the ``student`` (its ``tokenizer`` and ``modality``), checked against them first."""
        self.check_student(modality)
        self.student_modality = modality
        if self.model is None:
            self.model = load_teacher(self.config, student, tokenizer)

    def context_length(self) -> int | None:
        """The longest sequence the teacher reads (its config's, read without its weights: the data is checked
        before any model loads), None when unknown."""
        config = (
            self.model.config if self.model is not None else load_model_config(self.config.model_name_or_path, _SETTING)
        )
        return config_context_length(config)

    def check_temperature(self, temperature: float) -> None:
        """Any temperature: the pass divides the teacher's logits by it."""

    def check_student(self, student: Modality) -> None:
        """Refuse a teacher that cannot read the ``student`` modality's rows as the student does
        (``Modality.check_teacher``: a text teacher for a vision-language student would read the images'
        placeholder tokens as text, never the images). Read from the teacher's config: no weights load."""
        name = self.config.model_name_or_path
        student.check_teacher(model_modality(name, _SETTING), name)

    @torch.no_grad()
    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, **kwargs: Any
    ) -> Tensor:
        """The teacher's log-probs ``[N, T]`` of the completion tokens (``completion_logprobs``' ``kwargs``: the
        temperature, micro-batches, chunks, packing, and a vision-language student's ``vision``: each row's image
        inputs, which the teacher's processor makes alike: ``load_teacher``), on the inputs' device. The rows'
        inputs are given as the student's modality gives them, unless ``kwargs`` names another."""
        kwargs.setdefault("modality", self.student_modality)
        device = next(self.model.parameters()).device
        tensors = (t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
        return completion_logprobs(self.model, *tensors, **kwargs)[0].to(prompt_ids.device)


def load_teacher(
    config: TeacherConfig, student: torch.nn.Module, student_tokenizer: PreTrainedTokenizerBase
) -> PreTrainedModel:
    """The frozen teacher, in eval mode without dropout, on its device and dtype; refused in one line when its
    vocabulary is not the student's (its log-prob of a token id would be another token's). Loaded as its own
    modality loads it (``grpo_lightning/modality.py``); what it must share with the student's modality (a
    vision-language student's: the same image encoding) is checked before, in ``Teacher.check_student``."""
    name = config.model_name_or_path
    modality = model_modality(name, _SETTING)  # the teacher's: it loads the teacher (a vision-language one too)
    teacher_tokenizer = load_tokenizer(name, _SETTING, modality)
    check_same_vocabulary(student_tokenizer, teacher_tokenizer, name)
    student_param = next(student.parameters())
    dtype = student_param.dtype if config.dtype == "auto" else _DTYPES[config.dtype]
    teacher = modality.load_model(name, dtype)  # a vision-language teacher too (for a text student: it reads text)
    # Output layers padded to different sizes (Qwen2.5-7B's 152064 rows, 0.5B's 151936, one tokenizer) are fine:
    # only the log-prob of a sampled token, an id of the shared tokenizer, is read.
    teacher_rows = teacher.get_output_embeddings().weight.shape[0]
    if teacher_rows < len(student_tokenizer):
        raise ConfigError(
            f"model.teacher {config.model_name_or_path!r} scores {teacher_rows} tokens, fewer than the student's "
            f"tokenizer has ({len(student_tokenizer)}): on-policy distillation needs the student's vocabulary"
        )
    disable_dropout(teacher)
    device = torch.device(config.device) if config.device else student_param.device
    return teacher.to(device).eval().requires_grad_(False)


def check_same_vocabulary(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase, name: str) -> None:
    """Refuse a teacher whose tokenizer maps some token to another id than the student's."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        shown = ", ".join(f"{token!r}→{index}" for token, index in differ)
        raise ConfigError(
            f"model.teacher {name!r} has another vocabulary than the student ({len(theirs)} vs {len(mine)} tokens; "
            f"differing: {shown}): on-policy distillation needs a teacher with the student's tokenizer"
        )


def reverse_kl_per_token(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``[..., ]`` KL(π_S ‖ π_T) = Σ_v π_S(v) (log π_S(v) − log π_T(v)) at each position, both at ``temperature``:
    the per-token divergence TRL's ``DistillationTrainer`` minimises at beta = 1."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # at least float32
    student = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    return (student.exp() * (student - teacher)).sum(-1)
