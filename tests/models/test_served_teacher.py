"""A teacher served by vLLM (``model.teacher.url``, ``grpo_lightning/integrations/distillation/served_teacher.py``),
against a stand-in.

The stand-in answers the four routes the served teacher uses (``/v1/models``, ``/tokenize``, ``/detokenize``,
``/v1/completions`` with ``prompt_logprobs``) in vLLM's JSON shapes, from a local Hugging Face model: a run taught
through it gives every token the advantage a locally loaded teacher gives; the settings, a temperature the server
cannot follow, another vocabulary and an unreachable server are refused in one line. The same against a real
``vllm serve``: ``test_served_teacher_vllm.py`` (vLLM environment).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import TINY, quiet_trainer
from lightning import seed_everything
from test_distillation import save_teacher

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError
from grpo_lightning.engines.http import ServerError
from grpo_lightning.integrations.distillation.served_teacher import ServedTeacher
from grpo_lightning.integrations.distillation.teacher import TeacherConfig
from grpo_lightning.integrations.vllm.weight_transfer import free_port
from grpo_lightning.models.build import load_tokenizer
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec


class StandIn:
    """vLLM's answers, computed by a local model (raw log-probs: temperature 1, as vLLM's prompt log-probs)."""

    def __init__(self, folder: str, tokenizer=None, max_model_len: int = 128) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.tokenizer = tokenizer or load_tokenizer(folder)
        self.max_model_len, self.requests = max_model_len, []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.answer({"data": [{"id": "teacher", "max_model_len": stand_in.max_model_len}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append((self.path, body))
                self.answer(stand_in.route(self.path, body))

            def answer(self, payload) -> None:
                raw = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port("127.0.0.1")), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def route(self, path: str, body: dict) -> dict:
        if path == "/tokenize":
            return {"tokens": self.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]}
        if path == "/detokenize":
            return {"prompt": self.tokenizer.decode(body["tokens"])}
        choices = []
        for index, ids in enumerate(body["prompt"]):
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0].float()
            logprobs = torch.log_softmax(logits, -1)
            entries = [None] + [
                {str(token): {"logprob": logprobs[position - 1, token].item(), "rank": 1}}
                for position, token in enumerate(ids)
                if position
            ]
            choices.append({"index": index, "text": "x", "prompt_logprobs": entries})
        return {"choices": choices[::-1]}  # out of order: the client sorts by index

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def stand_in(teacher_dir):
    server = StandIn(teacher_dir)
    yield server
    server.close()


def distil(tmp_path, teacher: TeacherConfig, temperature: float = 1.0) -> tuple[GRPOModule, RolloutDataModule]:
    seed_everything(3)  # the same student, so the same samples, for either teacher
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-3, teacher=teacher)
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer", weight=0.0)],
        sampling=SamplingConfig(group_size=2, max_new_tokens=6, temperature=temperature),
        prompts_per_round=3,
        val_split=None,
        seed=3,
    )
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(module, datamodule=data)
    return module, data


def test_a_served_teacher_gives_every_token_the_advantage_a_local_teacher_gives(tmp_path, teacher_dir, stand_in):
    _, local = distil(tmp_path / "local", TeacherConfig(teacher_dir, weight=0.5))
    module, served = distil(tmp_path / "served", TeacherConfig(url=stand_in.url, weight=0.5))
    a, b = local.last_rollout, served.last_rollout
    assert torch.equal(a.completion_ids, b.completion_ids)  # the same samples: the same seed, the same student
    assert torch.allclose(a.advantages, b.advantages, atol=1e-5)
    assert b.advantages[b.loss_mask.bool()].abs().min() > 0
    assert b.metrics["distill/reverse_kl_k1"] == pytest.approx(a.metrics["distill/reverse_kl_k1"], abs=1e-5)
    sent = [body for path, body in stand_in.requests if path == "/v1/completions"]
    assert all(body["prompt_logprobs"] == 0 and isinstance(body["prompt"][0], list) for body in sent)  # ids, not text
    assert isinstance(module.teacher, ServedTeacher)


def test_the_served_log_probs_land_on_the_completion_tokens_of_rows_of_any_length(stand_in):
    tokenizer = load_tokenizer(stand_in.model.name_or_path)
    teacher = ServedTeacher(TeacherConfig(url=stand_in.url))
    # left-padded prompts of different lengths, right-padded completions of different lengths, 2 rows per request
    prompt_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 0, 13]])
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.tensor([[14, 15, 16, 0], [17, 18, 19, 20], [21, 0, 0, 0]])
    completion_mask = (completion_ids != 0).long()
    out = teacher.logprobs(prompt_ids, prompt_mask, completion_ids, completion_mask, micro_batch_size=2)
    from grpo_lightning.models.logprobs import completion_logprobs

    with torch.no_grad():
        expected = completion_logprobs(stand_in.model, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
    assert torch.allclose(out * completion_mask, expected * completion_mask, atol=1e-5)
    assert (out[completion_mask == 0] == 0).all()
    assert len(tokenizer) > 0


def test_a_temperature_the_server_cannot_follow_is_refused_before_training(tmp_path, stand_in):
    with pytest.raises(ConfigError, match=r"^model.teacher.url: a served teacher gives temperature-1") as err:
        distil(tmp_path, TeacherConfig(url=stand_in.url), temperature=0.7)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^model.teacher.url: .* the teacher's temperature is 0.5"):
        distil(tmp_path, TeacherConfig(url=stand_in.url, temperature=0.5))  # τ_T itself must be 1


def test_teacher_temperature_1_lets_a_served_teacher_teach_a_student_sampling_at_another(
    tmp_path, teacher_dir, stand_in
):
    """``model.teacher.temperature: 1.0``: the teacher's raw log-probs, which the server gives, at any sampling
    temperature; the same advantages as the local teacher at τ_T = 1."""
    _, local = distil(tmp_path / "local", TeacherConfig(teacher_dir, temperature=1.0), temperature=0.7)
    _, served = distil(tmp_path / "served", TeacherConfig(url=stand_in.url, temperature=1.0), temperature=0.7)
    a, b = local.last_rollout, served.last_rollout
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.allclose(a.advantages, b.advantages, atol=1e-5)
    assert b.advantages[b.loss_mask.bool()].abs().min() > 0


def test_a_served_teacher_with_another_vocabulary_is_refused_before_training(tmp_path, teacher_dir):
    other = build_char_tokenizer()
    other.add_tokens(["carry"])  # "carry" in the probe text becomes one token there
    server = StandIn(teacher_dir, tokenizer=other)
    try:
        with pytest.raises(ConfigError, match=r"has another vocabulary than the student") as err:
            distil(tmp_path, TeacherConfig(url=server.url))
        assert "\n" not in str(err.value) and server.url in str(err.value)
    finally:
        server.close()


def test_an_unreachable_teacher_server_stops_the_run_in_one_line_naming_it(tmp_path):
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(ServerError, match=r"is unreachable") as err:
        distil(tmp_path, TeacherConfig(url=url, retries=1, timeout_s=2))
    assert url in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "needs exactly one of model_name_or_path"),
        ({"model_name_or_path": "folder", "url": "http://x:1"}, "needs exactly one of model_name_or_path"),
        ({"url": "http://x:1", "timeout_s": 0}, "timeout_s must be > 0"),
        ({"url": "http://x:1", "retries": -1}, "retries >= 0"),
    ],
)
def test_served_teacher_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        TeacherConfig(**settings)


def test_a_server_serving_several_models_needs_the_teachers_name(stand_in):
    teacher = ServedTeacher(TeacherConfig(url=stand_in.url, served_model_name="another"))
    with pytest.raises(ConfigError, match=r"served_model_name 'another' is not served"):
        teacher.context_length()
