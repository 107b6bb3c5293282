"""On-policy distillation as the core sees it: the settings ``model.teacher`` fills, the contract of a teacher, the
checks of a run with one, and the plug-in path that builds it.

The teacher itself (a local model, or one served by vLLM) is an integration (``integrations/distillation/teacher.py``,
``integrations/distillation/served_teacher.py``): the core never imports it. ``GRPOModule`` builds it with
``build_teacher``, which loads ``TEACHER_FACTORY`` (``plugins.load_plugin``) only when a run has a teacher, and talks to
it through ``DistillationTeacher``. The per-token advantage it gives is ``advantages.distillation_advantages``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from grpo_lightning.config import ConfigError
from grpo_lightning.modality import TEXT, Modality
from grpo_lightning.plugins import load_plugin

TEACHER_FACTORY = "grpo_lightning.integrations.distillation.teacher:make_teacher"
"""The ``"module:attr"`` path of the function that makes the teacher of a ``TeacherConfig``."""

TEACHER_DTYPES = ("float32", "bfloat16", "float16")
_SCHEDULES = ("constant", "linear", "cosine", "step")


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
        if self.dtype != "auto" and self.dtype not in TEACHER_DTYPES:
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


# Checkpoints saved before these settings moved here name them ``grpo_lightning.models.teacher.TeacherConfig`` in
# their pickle; Lightning reads checkpoints with ``torch.load(weights_only=True)``, which takes a class only under
# a name it was registered by (``GRPOModule`` registers the current one).
torch.serialization.add_safe_globals([(TeacherConfig, "grpo_lightning.models.teacher.TeacherConfig")])


class DistillationTeacher(ABC):
    """What the module asks of a teacher: built with the policy, checked before training, and its log-prob pass.

    Not an ``nn.Module`` child of the LightningModule: it keeps its own device and dtype, stays out of checkpoints
    and out of the optimizer. ``GRPOModule`` makes it with ``build_teacher`` when the config is read (it must load
    no weights yet), calls ``build`` once the student exists, the checks before training, then ``logprobs`` each
    round that has a teacher pass (``TeacherConfig.round_weight``). Each token's advantage gains
    λ × (teacher's log-prob − student's), λ = ``model.teacher.weight`` (``advantages.distillation_advantages``).
    """

    config: TeacherConfig
    """The ``model.teacher`` settings it was made from."""

    @abstractmethod
    def build(self, student: nn.Module, tokenizer: Any, modality: Modality = TEXT) -> None:
        """Make the teacher ready for the student (load it, reach its server), checked against it: its token ids
        must mean the student's (the same vocabulary); what cannot work is refused in one line (``ConfigError``).

        Args:
            student: the policy, built (its device and dtype are the teacher's defaults).
            tokenizer: the student's tokenizer.
            modality: the student's modality (``grpo_lightning/modality.py``).
        """

    @abstractmethod
    def context_length(self) -> int | None:
        """The longest sequence (prompt + completion, in tokens) the teacher reads, None when unknown; asked before
        any weights load, to check the data against it."""

    @abstractmethod
    def check_temperature(self, temperature: float) -> None:
        """Refuse, in one line (``ConfigError``), a temperature τ_T this teacher cannot score at (a served teacher
        returns the raw model's log-probs: temperature 1 only).

        Args:
            temperature: τ_T, ``model.teacher.temperature`` or else the sampling temperature.
        """

    @abstractmethod
    def check_student(self, student: Modality) -> None:
        """Refuse, in one line (``ConfigError``), a student whose rows this teacher cannot read as the student does
        (a vision-language student's images, for a text-only teacher).

        Args:
            student: the student's modality.
        """

    @abstractmethod
    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, **kwargs: Any
    ) -> Tensor:
        """The teacher's log-probs of the student's sampled completion tokens, without gradient.

        Args:
            prompt_ids: ``[N, P]`` the prompts, left-padded.
            prompt_mask: ``[N, P]`` 1 on the prompts' tokens.
            completion_ids: ``[N, T]`` the completions, right-padded.
            completion_mask: ``[N, T]`` 1 on the completions' tokens.
            **kwargs: the pass's options, as ``models/logprobs.py: completion_logprobs`` takes them:
                ``temperature`` (τ_T), ``micro_batch_size``, ``chunk_size``, ``lean``, ``pack_tokens``, and the
                rows' inputs (``vision``) with the student's ``modality``.

        Returns:
            ``[N, T]`` log-probs of each completion token at τ_T, on the inputs' device; the positions
                outside ``completion_mask`` are never read.
        """


def build_teacher(config: TeacherConfig) -> DistillationTeacher:
    """The teacher of ``config``, made by the plug-in ``TEACHER_FACTORY`` names (imported now, not before): a
    function ``make_teacher(config) -> DistillationTeacher`` that loads no weights yet (``build`` does)."""
    return load_plugin(TEACHER_FACTORY)(config)


def check_teacher_run(
    teacher: DistillationTeacher, temperature: float, rewards_teach: bool, student: Modality = TEXT
) -> None:
    """Refuse, before training, a temperature τ_T the teacher cannot score at, a teacher that cannot read the
    ``student`` modality's rows (a vision-language student's images), and a weight schedule that stops the teacher
    where the rewards give no signal of their own (``rewards_teach`` false): the rounds after it would teach
    nothing."""
    teacher.check_temperature(temperature)
    teacher.check_student(student)
    config = teacher.config
    if config.weight_schedule != "constant" and not rewards_teach:
        raise ConfigError(
            f"model.teacher.weight_schedule: {config.weight_schedule} stops the teacher after {config.weight_rounds} "
            "rounds but data.rewards give no signal of their own (none, or all of weight 0): the rounds after would "
            "teach nothing; use weight_schedule: constant or give a reward a weight"
        )
