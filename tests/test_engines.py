"""The rollout engine contract, checked on every engine (``grpo_lightning.engines``).

For each engine: greedy completions equal ``model.generate(do_sample=False)`` token for token; the sampled tokens'
log-probs equal the trainer's (``completion_logprobs``) in float32; the joint distribution of sampled token pairs
passes a χ² test against the model's own (tempered, top-k filtered) distribution; masks, truncation and padding
follow ``Completions``' rules; the same generator state gives the same completions. Engines run on a tiny Llama
(the lean forward) and a tiny GPT-2 (any other causal LM).
"""

from __future__ import annotations

import pytest
import torch
from engine_contract import (
    check_greedy_equals_generate,
    check_logprobs_equal_the_trainers,
    check_mask_truncation_and_padding_rules,
    check_token_pairs_follow_the_model_distribution,
)
from transformers import GPT2Config, GPT2LMHeadModel

from grpo_lightning.engines import LeanEngine, RolloutEngine, TransformersEngine, build_engine

ENGINES = {
    "lean": lambda: LeanEngine(),
    "lean-model-forward": lambda: LeanEngine(lean_forward=False),
    "transformers": lambda: TransformersEngine(),
}


@pytest.fixture(params=["llama", "gpt2"])
def model(request, tiny_llama, tokenizer):
    if request.param == "llama":
        return tiny_llama
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config).eval()


def make_engine(name: str, model: torch.nn.Module, tokenizer) -> RolloutEngine:
    engine = ENGINES[name]()
    engine.setup(model, tokenizer)
    return engine


@pytest.mark.parametrize("name", list(ENGINES))
def test_greedy_completions_equal_generate(name, model, tokenizer):
    check_greedy_equals_generate(make_engine(name, model, tokenizer), model, tokenizer)


@pytest.mark.parametrize("name", list(ENGINES))
def test_sampled_logprobs_equal_the_trainers(name, model, tokenizer):
    check_logprobs_equal_the_trainers(make_engine(name, model, tokenizer), model, tokenizer, atol=1e-5)


@pytest.mark.parametrize("name", list(ENGINES))
def test_completions_follow_the_mask_truncation_and_padding_rules(name, model, tokenizer):
    check_mask_truncation_and_padding_rules(make_engine(name, model, tokenizer), tokenizer)


@pytest.mark.parametrize("name", list(ENGINES))
def test_sampled_token_pairs_follow_the_model_distribution(name, tiny_llama, tokenizer):
    check_token_pairs_follow_the_model_distribution(make_engine(name, tiny_llama, tokenizer), tiny_llama, tokenizer)


def test_engine_names_resolve_and_unknown_ones_are_refused():
    from grpo_lightning.config import ConfigError

    assert isinstance(build_engine("auto"), LeanEngine) and isinstance(build_engine("lean"), LeanEngine)
    assert isinstance(build_engine("transformers"), TransformersEngine)
    engine = TransformersEngine()
    assert build_engine(engine) is engine
    with pytest.raises(ConfigError, match="data.engine: unknown engine 'vlm'"):
        build_engine("vlm")


def test_engines_sharing_the_weights_are_always_current_and_their_logprobs_match_in_float32(tiny_llama, tokenizer):
    engine = make_engine("lean", tiny_llama, tokenizer)
    assert engine.shares_weights and engine.is_current(0) and engine.is_current(17)
    assert engine.logprobs_match_policy(tiny_llama)
    assert not engine.logprobs_match_policy(tiny_llama.to(torch.bfloat16))
