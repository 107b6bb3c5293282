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

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.config import ConfigError
from grpo_lightning.config_checks import config_context_length
from grpo_lightning.models.build import disable_dropout, load_tokenizer
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.served_teacher import ServedTeacher
from grpo_lightning.models.sources import load_model_config
from grpo_lightning.vision.model_inputs import same_encoding
from grpo_lightning.vision.models import is_vision_model, load_vision_model, processor_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCHEDULES = ("constant", "linear", "cosine", "step")
_SETTING = "model.teacher.model_name_or_path"  # what a one-line error about the teacher's path names


@dataclass
class TeacherConfig:
    """``model.teacher``: the model that teaches (a local one, or one served by vLLM), and how much its signal
    weighs."""

    model_name_or_path: str | None = None
    """A local folder or a Hub name (its tokenizer must be the student's: same vocabulary, same ids)."""
    url: str | None = None
    """Instead of ``model_name_or_path``: a ``vllm serve`` of the teacher (``http://host:port``), for teachers too
    large to hold beside the student (``served_teacher.py``: temperature 1 only)."""
    served_model_name: str | None = None
    """With ``url``: the model's name on the server; None: the one it serves."""
    timeout_s: float = 600.0
    """With ``url``: the longest wait for one answer before a retry."""
    retries: int = 3
    """With ``url``: retries of a request that failed (down, 5xx, too slow) before the run stops in one line."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Its weights' dtype; ``auto``: the student's."""
    device: str | None = None
    """Where it runs (``cuda:1``, ``cpu``); None: the student's device."""
    weight: float = 1.0
    """λ: the distillation advantage's weight; the rewards' group-relative advantage is added as it is (with
    ``data.rewards: []`` the teacher alone teaches). Its value at the first round when ``weight_schedule`` changes
    it."""
    weight_schedule: Literal["constant", "linear", "cosine", "step"] = "constant"
    """How λ changes over the rounds (``weight_at``): ``constant``; ``linear`` or ``cosine``: from ``weight`` at the
    first round down to 0 at round ``weight_rounds`` + 1; ``step``: ``weight`` for the first ``weight_rounds``
    rounds, then 0. Once λ is 0 a round runs no teacher pass: it is the rewards' alone (GRPO). For a teacher that
    helps the first rounds and slows the end; on the quickstart no schedule beat GRPO alone (docs/distillation.md)."""
    weight_rounds: int | None = None
    """N: the rounds over which a ``linear``, ``cosine`` or ``step`` schedule brings λ to 0 (``constant``: unset)."""
    temperature: float | None = None
    """τ_T: the teacher's log-probs are those of softmax(z_T / τ_T), the student's stay at the sampling temperature
    T. None: τ_T = T (the reverse KL to the teacher as it samples). τ_T < T sharpens the target toward the teacher's
    greedy answers (a teacher right greedily that spreads mass over wrong answers at T); 1.0 lets a served teacher,
    whose log-probs are the raw model's, teach a student sampling at any T."""

    def __post_init__(self) -> None:
        if bool(self.model_name_or_path) == bool(self.url):
            raise ConfigError(
                "model.teacher needs exactly one of model_name_or_path (a local folder or Hub name) and url (a vLLM "
                f"server of the teacher) (got model_name_or_path={self.model_name_or_path!r}, url={self.url!r})"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"model.teacher.dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        if not self.weight > 0:
            raise ConfigError(f"model.teacher.weight must be > 0 (got {self.weight})")
        self._check_schedule()
        if self.temperature is not None and not self.temperature > 0:
            raise ConfigError(f"model.teacher.temperature must be > 0 or null (got {self.temperature})")
        if not self.timeout_s > 0 or self.retries < 0:
            raise ConfigError(
                f"model.teacher.timeout_s must be > 0 and retries >= 0 (got {self.timeout_s}, {self.retries})"
            )

    def _check_schedule(self) -> None:
        if self.weight_schedule not in _SCHEDULES:
            raise ConfigError(
                f"model.teacher.weight_schedule must be constant, linear, cosine or step (got {self.weight_schedule!r})"
            )
        if self.weight_schedule == "constant":
            if self.weight_rounds is not None:
                raise ConfigError(
                    f"model.teacher.weight_rounds ({self.weight_rounds}) applies to a linear, cosine or step "
                    "weight_schedule only: set model.teacher.weight_schedule or remove weight_rounds"
                )
            return
        rounds = self.weight_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ConfigError(
                f"model.teacher.weight_schedule: {self.weight_schedule} needs model.teacher.weight_rounds, the rounds "
                f"over which λ reaches 0, an integer >= 1 (got {rounds!r})"
            )

    def round_weight(self, round_index: int) -> float | None:
        """``weight_at``, None once the schedule has reached 0: the round then runs no teacher pass."""
        weight = self.weight_at(round_index)
        return weight if weight > 0 else None

    def weight_at(self, round_index: int) -> float:
        """λ at round ``round_index`` (0 = the first round) under ``weight_schedule``."""
        if self.weight_schedule == "constant":
            return self.weight
        progress = min(round_index, self.weight_rounds) / self.weight_rounds  # 0 at the first round, then up to 1
        if self.weight_schedule == "step":
            return self.weight if progress < 1 else 0.0
        if self.weight_schedule == "linear":
            return self.weight * (1.0 - progress)
        # cosine: flat at the start and the end, the steepest fall halfway (as learning-rate schedules)
        return self.weight * 0.5 * (1.0 + math.cos(math.pi * progress))

    @property
    def name(self) -> str:
        """What the teacher is called in messages: its folder, Hub name or URL."""
        return self.model_name_or_path or self.url or ""


def make_teacher(config: TeacherConfig) -> Teacher | ServedTeacher:
    """The teacher of ``config``: loaded here (``Teacher``), or reached on its server (``ServedTeacher``)."""
    if config.url:
        return ServedTeacher(config)
    return Teacher(config)


class Teacher:
    """The module's teacher: built with the policy (``build``), its log-prob pass run where π_ref's runs.

    Not an ``nn.Module`` attribute of the LightningModule on purpose: it stays on its own device and dtype (Lightning
    moves and casts the module's children), out of checkpoints (it is re-loaded from its folder) and out of the
    optimizer.
    """

    def __init__(self, config: TeacherConfig) -> None:
        self.config = config
        self.model: PreTrainedModel | None = None

    def build(self, student: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
        self.check_student(processor_of(tokenizer) is not None)
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

    def check_student(self, vision: bool) -> None:
        """Refuse a text teacher for a vision-language student (``vision``): it would read the images' placeholder
        tokens as text, never the images. (Read from the teacher's config: no model loads.)"""
        if vision and not is_vision_model(self.config.model_name_or_path):
            raise ConfigError(
                f"model.teacher.model_name_or_path {self.config.model_name_or_path!r} is a text model and "
                "model.model_name_or_path a vision-language one: the teacher would score the image placeholders "
                "without the images; give a vision-language teacher with the student's processor"
            )

    @torch.no_grad()
    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, **kwargs: Any
    ) -> Tensor:
        """The teacher's log-probs ``[N, T]`` of the completion tokens (``completion_logprobs``' ``kwargs``: the
        temperature, micro-batches, chunks, packing, and a vision-language student's ``vision``: each row's image
        inputs, which the teacher's processor makes alike: ``load_teacher``), on the inputs' device."""
        device = next(self.model.parameters()).device
        tensors = (t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask))
        return completion_logprobs(self.model, *tensors, **kwargs)[0].to(prompt_ids.device)


def check_teacher_run(
    teacher: Teacher | ServedTeacher, temperature: float, rewards_teach: bool, vision: bool = False
) -> None:
    """Refuse, before training, a temperature τ_T the teacher cannot score at, a teacher that cannot see a
    vision-language student's images (``vision``), and a weight schedule that stops the teacher where the rewards
    give no signal of their own (``rewards_teach`` false): the rounds after it would teach nothing."""
    teacher.check_temperature(temperature)
    teacher.check_student(vision)
    config = teacher.config
    if config.weight_schedule != "constant" and not rewards_teach:
        raise ConfigError(
            f"model.teacher.weight_schedule: {config.weight_schedule} stops the teacher after {config.weight_rounds} "
            "rounds but data.rewards give no signal of their own (none, or all of weight 0): the rounds after would "
            "teach nothing; use weight_schedule: constant or give a reward a weight"
        )


def load_teacher(
    config: TeacherConfig, student: torch.nn.Module, student_tokenizer: PreTrainedTokenizerBase
) -> PreTrainedModel:
    """The frozen teacher, in eval mode without dropout, on its device and dtype; refused in one line when its
    vocabulary is not the student's (its log-prob of a token id would be another token's), or, for a
    vision-language student, when its processor encodes an image prompt otherwise (it is given the student's
    image inputs with the student's ids: ``vision/model_inputs.py: same_encoding``)."""
    name = config.model_name_or_path
    teacher_tokenizer = load_tokenizer(name, _SETTING)
    check_same_vocabulary(student_tokenizer, teacher_tokenizer, name)
    student_processor, teacher_processor = processor_of(student_tokenizer), processor_of(teacher_tokenizer)
    if student_processor is not None and teacher_processor is not None:
        differs = same_encoding(student_processor, teacher_processor)
        if differs is not None:
            raise ConfigError(
                f"model.teacher.model_name_or_path {name!r}: its processor encodes an image prompt otherwise than the "
                f"student's ({differs}); the teacher is given the student's image inputs: give it the student's "
                "image-processor settings"
            )
    student_param = next(student.parameters())
    dtype = student_param.dtype if config.dtype == "auto" else _DTYPES[config.dtype]
    if teacher_processor is not None:  # a vision-language teacher (also for a text student: it reads text too)
        teacher = load_vision_model(name, dtype)
    else:
        teacher = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
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


def distillation_advantages(gap: Tensor, mask: Tensor, weight: float) -> Tensor:
    """``[N, T]`` per-token advantages λ · (log π_T − log π_S) of the sampled tokens (``gap``), 0 outside ``mask``."""
    return weight * gap * mask


def reverse_kl_per_token(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``[..., ]`` KL(π_S ‖ π_T) = Σ_v π_S(v) (log π_S(v) − log π_T(v)) at each position, both at ``temperature``:
    the per-token divergence TRL's ``DistillationTrainer`` minimises at beta = 1."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # at least float32
    student = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    teacher = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    return (student.exp() * (student - teacher)).sum(-1)
