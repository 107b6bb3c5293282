"""The engine registry (``grpo_lightning.engines``): ``data.engine`` names an entry of one table of name -> engine
class, or -> ``"module:attr"`` for an integration's engine, loaded only when named (``plugins.load_plugin``).

A user's engine registered by name (as a class, or by its path) runs a round; a registered name joins the names the
unknown-name error lists; vLLM's engines are loaded only when named, with today's one-line error where vLLM is not
installed.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import TINY, quiet_trainer
from helpers import length_reward

import grpo_lightning.engines as engines
from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError
from grpo_lightning.engines import LeanEngine, TransformersEngine, build_engine, register_engine
from grpo_lightning.rewards import RewardSpec, register

register("engine_registry_length")(length_reward)


class RecordingEngine(LeanEngine):
    """The lean loop, recording each ``generate`` call in the class's ``calls`` (one list for every instance)."""

    name = "recording"
    calls: list[int] = []

    def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False):
        RecordingEngine.calls.append(prompt_ids.shape[0])
        return super().generate(prompt_ids, prompt_mask, params, generator=generator, return_logprobs=return_logprobs)


@pytest.fixture
def registry(monkeypatch):
    """The engine table as it is, restored after the test (a registration does not leak into other tests)."""
    monkeypatch.setattr(engines, "ENGINES", dict(engines.ENGINES))
    RecordingEngine.calls.clear()
    return engines.ENGINES


def one_round(tmp_path, engine: str) -> RolloutDataModule:
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-2)
    data = RolloutDataModule(
        rewards=[RewardSpec("engine_registry_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=4),
        engine=engine,
        prompts_per_round=2,
        task_kwargs={"test_size": 4},
    )
    quiet_trainer(tmp_path, max_epochs=1).fit(module, datamodule=data)
    return data


@pytest.mark.parametrize("target", [RecordingEngine, "test_engine_registry:RecordingEngine"])
def test_a_user_engine_registered_by_name_runs_a_round(registry, tmp_path, target):
    register_engine("recording", target)
    assert "recording" in engines.ENGINE_NAMES
    data = one_round(tmp_path, "recording")
    assert RecordingEngine.calls == [2]  # the round's 2 prompts, sampled by the registered engine (4 each)
    assert data.last_rollout.completion_ids.shape[0] == 8


def test_a_registered_name_is_listed_when_a_name_is_unknown(registry):
    register_engine("recording", RecordingEngine)
    with pytest.raises(ConfigError) as refused:
        build_engine("vlm")
    assert str(refused.value) == (
        "data.engine: unknown engine 'vlm'; choose one of auto, lean, transformers, vllm, vllm_server, recording, or "
        "give {class_path: ..., init_args: {...}} for a RolloutEngine subclass"
    )


def test_a_name_is_registered_once_and_only_for_an_engine(registry):
    register_engine("recording", RecordingEngine)
    register_engine("recording", RecordingEngine)  # the same again: fine (a module imported twice)
    with pytest.raises(ValueError, match="'recording' is already registered"):
        register_engine("recording", TransformersEngine)
    register_engine("not_an_engine", "grpo_lightning.config:ConfigError")
    with pytest.raises(ConfigError, match="data.engine: 'not_an_engine' names .*ConfigError.*not a RolloutEngine"):
        build_engine("not_an_engine")


def test_the_built_in_names_and_their_order_are_todays():
    assert engines.ENGINE_NAMES == ("auto", "lean", "transformers", "vllm", "vllm_server")
    assert isinstance(build_engine("auto"), LeanEngine) and isinstance(build_engine("transformers"), TransformersEngine)
    assert engines.ENGINES["vllm"] == "grpo_lightning.integrations.vllm.engine:VLLMEngine"  # a path: loaded when named


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_vllm_installed_gives_todays_one_line_error():
    from grpo_lightning.integrations.vllm.engine import NOT_INSTALLED

    with pytest.raises(ConfigError) as refused:
        build_engine("vllm")
    assert str(refused.value) == NOT_INSTALLED
