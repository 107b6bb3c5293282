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
    check_every_end_id_ends_and_no_default_applies,
    check_filtered_logprobs_are_the_sampling_distributions,
    check_greedy_equals_generate,
    check_logprobs_equal_the_trainers,
    check_mask_truncation_and_padding_rules,
    check_min_new_tokens_and_stop_sequences,
    check_token_pairs_follow_the_model_distribution,
    make_instruct_like_folder,
)
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

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
def test_filtered_logprobs_are_those_of_the_sampling_distribution(name, model, tokenizer):
    check_filtered_logprobs_are_the_sampling_distributions(make_engine(name, model, tokenizer), model, tokenizer, 1e-5)


@pytest.mark.parametrize("name", list(ENGINES))
def test_min_new_tokens_and_stop_sequences_end_completions_alike(name, model, tokenizer):
    check_min_new_tokens_and_stop_sequences(make_engine(name, model, tokenizer), model, tokenizer)


@pytest.fixture(scope="module")
def instruct_like(tmp_path_factory):
    """``make_instruct_like_folder``: two EOS ids and sampling defaults in ``generation_config``, loaded back."""
    from grpo_lightning.models.build import load_tokenizer

    folder, _ = make_instruct_like_folder(tmp_path_factory.mktemp("instruct-like"))
    return AutoModelForCausalLM.from_pretrained(folder).eval(), load_tokenizer(folder)


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_eos_id_ends_a_completion_and_no_generation_default_applies(name, instruct_like):
    model, tokenizer = instruct_like
    engine = make_engine(name, model, tokenizer)
    assert engine.eos_token_ids == (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    check_every_end_id_ends_and_no_default_applies(engine, model, tokenizer)
    check_token_pairs_follow_the_model_distribution(engine, model, tokenizer)
    check_filtered_logprobs_are_the_sampling_distributions(engine, model, tokenizer, 1e-5)
    check_min_new_tokens_and_stop_sequences(engine, model, tokenizer)


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


def test_rows_from_raw_tokens_end_at_every_eos_id_and_never_count_padding():
    """``completions_from_tokens``, as the vllm engine uses it: rows of different generated lengths, padded with a
    pad id that is also an EOS id (as Qwen's base models have it), two EOS ids, a stop sequence and a minimum."""
    from grpo_lightning.engines.base import completions_from_tokens

    pad, eos, second = 0, 1, 9
    tokens = torch.tensor(
        [
            [5, 6, second, 0, 0, 0],  # ends on generation_config's id
            [5, 6, 7, 0, 0, 0],  # the engine stopped at 3 tokens without an end (vLLM at max_model_len)
            [5, 6, 7, 8, 5, 6],  # truncated at max_new_tokens
            [eos, 7, 5, 6, eos, 0],  # EOS before min_new_tokens=2 cannot end it (banned while sampling)
            [3, 4, 7, 3, 4, 0],  # stop (3, 4) ending at index 1 < 2 does not count; at index 4 it does
        ]
    )
    lengths = torch.tensor([3, 3, 6, 5, 5])
    out = completions_from_tokens(
        torch.ones(5, 1, dtype=torch.long),
        torch.ones(5, 1, dtype=torch.long),
        tokens,
        group_size=1,
        eos_token_id=(eos, second),
        pad_token_id=pad,
        max_new_tokens=6,
        stop_sequences=((3, 4),),
        lengths=lengths,
        min_new_tokens=2,
    )
    assert out.completion_mask.sum(-1).tolist() == [3, 3, 6, 5, 5]
    assert out.truncated.tolist() == [False, True, True, False, False]
    assert out.completion_ids[1].tolist() == [5, 6, 7, 0, 0, 0]  # padding kept out of the mask, not read as EOS
