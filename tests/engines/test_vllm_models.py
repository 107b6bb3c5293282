"""The ``vllm`` engine on what the tiny test model does not show: a folder shaped like a real instruct model's,
filters, minimum lengths, a context it cannot hold, a head size its CPU kernels lack, and multi-turn rollouts.

Marked ``vllm`` and skipped where vLLM is not installed (docs/vllm.md). The folder is ``make_instruct_like_folder``:
two EOS ids (the second only in ``generation_config``, which vLLM stops at) and sampling defaults that must not
reach the requests. The checks are the engine contract's, the same the other engines pass (``test_engines.py``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from engine_contract import (  # noqa: E402
    PROMPTS,
    check_every_end_id_ends_and_no_default_applies,
    check_filtered_logprobs_are_the_sampling_distributions,
    check_min_new_tokens_and_stop_sequences,
    check_token_pairs_follow_the_model_distribution,
    make_instruct_like_folder,
)
from transformers import AutoModelForCausalLM  # noqa: E402

from grpo_lightning.config import ConfigError  # noqa: E402
from grpo_lightning.engines import LeanEngine, SamplingParams  # noqa: E402
from grpo_lightning.integrations.environments import Environment, Step  # noqa: E402
from grpo_lightning.integrations.environments.multiturn import generate_trajectories  # noqa: E402
from grpo_lightning.integrations.vllm.engine import VLLMEngine  # noqa: E402
from grpo_lightning.models.build import load_tokenizer  # noqa: E402
from grpo_lightning.models.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama  # noqa: E402
from grpo_lightning.rollout.prompts import PromptEncoder  # noqa: E402

pytestmark = pytest.mark.vllm
ATOL = 1e-4  # float32 through vLLM's kernels, as in test_vllm.py


@pytest.fixture(scope="module")
def instruct_like(tmp_path_factory):
    folder, _ = make_instruct_like_folder(tmp_path_factory.mktemp("instruct-like"))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), load_tokenizer(folder)
    engine = VLLMEngine(max_model_len=128, kv_cache_memory_bytes=32 << 20)
    engine.setup(model, tokenizer)  # vLLM reads the folder itself: its generation_config included
    engine.load_weights(model, 0)
    yield model, tokenizer, engine
    engine.close()


def test_every_eos_id_ends_a_completion_and_no_generation_default_applies(instruct_like):
    model, tokenizer, engine = instruct_like
    assert engine.eos_token_ids == (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    check_every_end_id_ends_and_no_default_applies(engine, model, tokenizer)
    check_token_pairs_follow_the_model_distribution(engine, model, tokenizer)


def test_filtered_logprobs_are_those_of_the_sampling_distribution(instruct_like):
    model, tokenizer, engine = instruct_like
    check_filtered_logprobs_are_the_sampling_distributions(engine, model, tokenizer, ATOL)


def test_min_new_tokens_and_stop_sequences_end_completions_as_on_the_other_engines(instruct_like):
    model, tokenizer, engine = instruct_like
    check_min_new_tokens_and_stop_sequences(engine, model, tokenizer)


def test_a_prompt_and_completion_longer_than_max_model_len_are_refused(instruct_like):
    model, tokenizer, engine = instruct_like
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS[:1])
    with pytest.raises(ConfigError, match="exceed the vllm engine's max_model_len of 128.*init_args.max_model_len"):
        engine.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=128 - prompt_ids.size(1) + 1))
    out = engine.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=128 - prompt_ids.size(1)))
    assert len(out) == 1  # the longest that fits is taken


def test_a_head_size_without_cpu_kernels_is_refused_in_one_line():
    """The calculator demo's model has heads of 16: vLLM's CPU attention fails on it with a raw RuntimeError."""
    tokenizer = build_char_tokenizer()
    size = TinyModelConfig(hidden_size=64, num_heads=4, num_layers=1, intermediate_size=64)
    model = build_tiny_llama(size, tokenizer)
    engine = VLLMEngine(max_model_len=64)
    with pytest.raises(
        ConfigError,
        match=r"^data.engine: vllm cannot run this model on CPU: its attention head size "
        r"is 16, and vLLM's CPU attention has kernels for 32, 64.*use data.engine: lean",
    ):
        engine.setup(model, tokenizer)
    assert engine.llm is None  # refused before vLLM was started


# ------------------------------------------------------------------------------------------- multi-turn
class Answering(Environment):
    """Answers every turn with ``<o>n</o>`` (n = the turn's length) until ``max_turns``. A turn ends at an end id
    (the folder's model draws ``<|endoftext|>`` about one step in ten) or at a digit (a one-token stop text the
    random model draws often), so trajectories of several turns and observations arise without a trained model."""

    @property
    def stop_texts(self):
        return tuple("0123456789")

    def reset(self, row):
        return None

    def step(self, turn):
        return Step(observation=self.fit_observation(str(len(turn)), lambda text: f"<o>{text}</o>"))


def trajectories(engine, tokenizer, **params):
    return generate_trajectories(
        {"prompt": PROMPTS},
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        environment=Answering(max_turns=3, max_turn_tokens=12, max_observation_tokens=16),
        params=SamplingParams(**{"group_size": 4, "max_new_tokens": 60, **params}),
        generator=torch.Generator().manual_seed(0),
        return_logprobs=True,
    )


def test_multi_turn_rollouts_on_vllm_are_token_exact_and_their_logprobs_the_trainers(instruct_like):
    model, tokenizer, engine = instruct_like
    out = trajectories(engine, tokenizer)
    c, policy = out.completions, out.action_mask.bool()
    assert max(out.stats["turns"]) == 3 and sum(out.stats["env_tokens"]) > 0  # several turns, observations
    lengths = c.completion_mask.sum(-1)
    assert torch.equal(c.completion_mask, (torch.arange(c.completion_mask.size(1)) < lengths[:, None]).long())
    assert not (policy & ~c.completion_mask.bool()).any()  # no padding taken for a policy token
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, c.prompt_ids, c.prompt_mask, c.completion_ids, c.completion_mask)
    torch.testing.assert_close(c.logprobs[policy], trainer[policy], atol=ATOL, rtol=ATOL)
    assert (c.logprobs[~policy] == 0).all()


def test_greedy_multi_turn_trajectories_on_vllm_equal_the_lean_engines(instruct_like):
    model, tokenizer, engine = instruct_like
    lean = LeanEngine()
    lean.setup(model, tokenizer)
    ours, theirs = (trajectories(e, tokenizer, greedy=True, group_size=1) for e in (lean, engine))
    assert max(ours.stats["turns"]) >= 2
    assert ours.transcripts == theirs.transcripts
    assert torch.equal(ours.completions.completion_ids, theirs.completions.completion_ids)
    assert torch.equal(ours.action_mask, theirs.action_mask) and torch.equal(
        ours.completions.truncated, theirs.completions.truncated
    )
