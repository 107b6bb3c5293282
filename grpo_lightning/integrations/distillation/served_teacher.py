"""A teacher served by vLLM (``model.teacher.url``): its log-prob of each token the student sampled, over HTTP.

For teachers too large to hold beside the student. A ``vllm serve <teacher>`` answers ``/v1/completions`` with
``prompt_logprobs: 0``: the log-prob of every token of the prompt given the tokens before it. The student's prompt
and completion, sent as token ids (never text: no re-tokenization), make that prompt, and the completion's part is
π_T(y_t | y_<t), the same quantity the local teacher's pass computes (``teacher.py``).

What the server can give limits what it can teach:

- **Temperature 1 only.** vLLM's prompt log-probs are the raw model's (sampling processors, the temperature
  among them, do not apply to prompt tokens), while the distillation advantage compares student and teacher at the
  sampling temperature. A run whose ``data.sampling.temperature`` is not 1 is refused before training (load the
  teacher locally instead: its pass applies the temperature).
- **The student's vocabulary.** Checked before training through the server's ``/tokenize`` and ``/detokenize``: a
  probe text (every special token, a spread of the vocabulary's pieces, a chat turn) must tokenize to the student's
  ids, and the spread of ids must exist on the server. That is a sample, not the whole vocabulary (vLLM offers no
  endpoint listing it without an opt-in flag); a teacher of the same family passes, another family fails at once.
- **Context**: the server's ``max_model_len`` (``/v1/models``) bounds prompt + ``max_new_tokens`` like a local
  teacher's context.

Faults follow ``engines/http.py``: a server down, slow or answering 5xx is retried (``retries`` times, 1, 2, 4 ...
seconds apart), then the run stops with one line naming it; a 4xx is the request's fault and is not retried.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo_lightning.config import ConfigError
from grpo_lightning.distillation import DistillationTeacher, TeacherConfig
from grpo_lightning.engines.http import ServerClient
from grpo_lightning.modality import TEXT, Modality

_PROBE_TEXT = "Question: what is 12 + 30?\nAnswer: 42. <think>carry the one</think> Ünïcödé 東京 🙂"


class ServedTeacher(DistillationTeacher):
    """The teacher of ``model.teacher.url`` (the contract: ``distillation.DistillationTeacher``)."""

    def __init__(self, config: TeacherConfig) -> None:
        self.config = config
        self.client = ServerClient(config.url, timeout_s=config.timeout_s, retries=config.retries)
        self.model_name: str | None = config.served_model_name
        self._models: list[dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return f"ServedTeacher({self.client.base_url})"

    # ------------------------------------------------------------------------------------------ checks
    def _served_models(self) -> list[dict[str, Any]]:
        if self._models is None:
            models = self.client.get("/v1/models").get("data") or []
            if not models:
                raise ConfigError(f"model.teacher.url {self.client.base_url} serves no model (/v1/models is empty)")
            names = [model["id"] for model in models]
            if self.model_name is None:
                if len(models) > 1:
                    raise ConfigError(
                        f"model.teacher.url {self.client.base_url} serves {len(models)} models ({', '.join(names)}): "
                        "name one with model.teacher.served_model_name"
                    )
                self.model_name = names[0]
            elif self.model_name not in names:
                raise ConfigError(
                    f"model.teacher.served_model_name {self.model_name!r} is not served by {self.client.base_url} "
                    f"(it serves {', '.join(names)})"
                )
            self._models = models
        return self._models

    def context_length(self) -> int | None:
        """The server's ``max_model_len`` for the teacher's model (None when it does not say)."""
        model = next(m for m in self._served_models() if m["id"] == self.model_name)
        return model.get("max_model_len")

    def check_temperature(self, temperature: float) -> None:
        """Refuse a sampling temperature the served log-probs cannot follow (they are the temperature-1 model's)."""
        if temperature != 1.0:
            raise ConfigError(
                f"model.teacher.url: a served teacher gives temperature-1 log-probs (vLLM's prompt_logprobs), but "
                f"the teacher's temperature is {temperature:g} (model.teacher.temperature, else "
                "data.sampling.temperature): set model.teacher.temperature to 1.0, or load the teacher locally "
                "(model.teacher.model_name_or_path) whose pass applies any temperature"
            )

    def check_student(self, student: Modality) -> None:
        """Refuse a student whose rows carry inputs beyond their ids (``Modality.has_row_inputs``: a vision-language
        student's images): the server scores token ids alone (vLLM's ``/v1/completions`` takes no images), so it
        would read the images' placeholders without the images."""
        if student.has_row_inputs:
            raise ConfigError(
                "model.teacher.url: a served teacher scores token ids without images (vLLM's /v1/completions takes "
                "none) and model.model_name_or_path is a vision-language model; load the teacher locally "
                "(model.teacher.model_name_or_path, a vision-language model with the student's processor)"
            )

    def build(self, student: torch.nn.Module, tokenizer: Any, modality: Modality = TEXT) -> None:
        """Check, before training, that the server's teacher reads the student's token ids as the student does."""
        self.check_student(modality)
        self._served_models()
        probe_ids = _probe_ids(tokenizer)
        answer = self.client.post("/detokenize", {"model": self.model_name, "tokens": probe_ids}, retry=True)
        text = _PROBE_TEXT + "".join(tokenizer.all_special_tokens) + tokenizer.decode(probe_ids)
        request = {"model": self.model_name, "prompt": text, "add_special_tokens": False}
        theirs = self.client.post("/tokenize", request)["tokens"]
        mine = tokenizer(text, add_special_tokens=False)["input_ids"]
        served_text = answer.get("prompt", "")
        if theirs != mine or served_text != tokenizer.decode(probe_ids):
            pairs = enumerate(zip(mine, theirs, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(mine), len(theirs)))
            raise ConfigError(
                f"model.teacher.url {self.client.base_url} ({self.model_name}) has another vocabulary than the "
                f"student (a probe text tokenizes to {len(theirs)} ids there, {len(mine)} here, first differing at "
                f"token {first}): on-policy distillation needs a teacher with the student's tokenizer"
            )

    # ------------------------------------------------------------------------------------------ the pass
    @torch.no_grad()
    def logprobs(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        **_: Any,
    ) -> Tensor:
        """The teacher's log-probs ``[N, T]`` of the completion tokens (0 where ``completion_mask`` is 0), one
        request per ``micro_batch_size`` rows (the local pass's chunking and packing options do not apply)."""
        self.check_temperature(temperature)
        out = torch.zeros(completion_ids.shape, dtype=torch.float32)
        rows = len(prompt_ids)
        step = micro_batch_size or rows
        for start in range(0, rows, step):
            batch = range(start, min(start + step, rows))
            prompts, lengths = [], []
            for i in batch:
                prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
                completion = completion_ids[i][completion_mask[i].bool()].tolist()
                prompts.append(prompt + completion)
                lengths.append((len(prompt), len(completion)))
            body = {
                "model": self.model_name,
                "prompt": prompts,
                "max_tokens": 1,  # vLLM generates at least one token; greedy and discarded
                "temperature": 0.0,
                "prompt_logprobs": 0,  # the log-prob of each prompt token itself, no alternatives
            }
            choices = sorted(self.client.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
            for i, choice, sequence, (prompt_length, completion_length) in zip(
                batch, choices, prompts, lengths, strict=True
            ):
                entries = choice.get("prompt_logprobs") or []
                values = [
                    _token_logprob(entries, position, sequence[position])
                    for position in range(prompt_length, prompt_length + completion_length)
                ]
                positions = completion_mask[i].bool().nonzero().flatten()
                out[i, positions] = torch.tensor(values, dtype=torch.float32)
        return out.to(prompt_ids.device)


def _token_logprob(entries: list[Any], position: int, token: int) -> float:
    """``entries[position]``'s log-prob of ``token`` (vLLM keys them by the token id, as a string in JSON)."""
    entry = entries[position] if position < len(entries) else None
    value = None if entry is None else entry.get(str(token))
    if value is None:
        raise RuntimeError(
            f"model.teacher.url: the server's prompt_logprobs lack token {token} at position {position}: is it vLLM?"
        )
    return float(value["logprob"])


def _probe_ids(tokenizer: Any, count: int = 64) -> list[int]:
    """Every special token's id and ``count`` ids spread over the vocabulary."""
    size = len(tokenizer)
    spread = torch.linspace(0, size - 1, min(count, size)).long().tolist()
    return sorted(set(spread) | set(tokenizer.all_special_ids))
