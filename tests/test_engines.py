"""The rollout engine contract, checked on every engine (``grpo_lightning.engines``).

For each engine: greedy completions equal ``model.generate(do_sample=False)`` token for token; the sampled tokens'
log-probs equal the trainer's (``completion_logprobs``) in float32; the joint distribution of sampled token pairs
passes a χ² test against the model's own (tempered, top-k filtered) distribution; masks, truncation and padding
follow ``Completions``' rules; the same generator state gives the same completions. Engines run on a tiny Llama
(the lean forward) and a tiny GPT-2 (any other causal LM).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from grpo_lightning.engines import LeanEngine, RolloutEngine, SamplingParams, TransformersEngine, build_engine
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.rollout.prompts import PromptEncoder

ENGINES = {
    "lean": lambda: LeanEngine(),
    "lean-model-forward": lambda: LeanEngine(lean_forward=False),
    "transformers": lambda: TransformersEngine(),
}
PROMPTS = ["12+34=", "5+6=", "99+99=", "7="]  # different lengths: left padding


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
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    max_new = 12
    out = make_engine(name, model, tokenizer).generate(
        prompt_ids, prompt_mask, SamplingParams(max_new_tokens=max_new, greedy=True)
    )
    with torch.no_grad():
        theirs = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[:, prompt_ids.size(1) :]
    theirs = torch.nn.functional.pad(theirs, (0, max_new - theirs.size(1)), value=tokenizer.pad_token_id)
    width = out.completion_ids.size(1)
    assert torch.equal(out.completion_ids, theirs[:, :width])
    assert (theirs[:, width:] == tokenizer.pad_token_id).all()
    assert torch.equal(out.prompt_ids, prompt_ids)  # one completion per prompt when greedy


@pytest.mark.parametrize("name", list(ENGINES))
def test_sampled_logprobs_equal_the_trainers(name, model, tokenizer):
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS[:2])
    params = SamplingParams(group_size=4, max_new_tokens=8, min_new_tokens=2, temperature=0.7, top_k=5)
    generator = torch.Generator().manual_seed(3)
    out = make_engine(name, model, tokenizer).generate(
        prompt_ids, prompt_mask, params, generator=generator, return_logprobs=True
    )
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    with torch.no_grad():
        expected, _ = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7
        )
    mask = out.completion_mask.bool()
    torch.testing.assert_close(out.logprobs[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert (out.logprobs[~mask] == 0).all()


@pytest.mark.parametrize("name", list(ENGINES))
def test_completions_follow_the_mask_truncation_and_padding_rules(name, model, tokenizer):
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    params = SamplingParams(group_size=3, max_new_tokens=6, temperature=1.5)
    engine = make_engine(name, model, tokenizer)
    out = engine.generate(prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(0))
    assert out.completion_ids.size(0) == len(PROMPTS) * 3
    assert torch.equal(out.prompt_ids, prompt_ids.repeat_interleave(3, dim=0))  # groups adjacent
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for ids, mask, truncated in zip(out.completion_ids.tolist(), out.completion_mask.tolist(), out.truncated.tolist()):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)  # a prefix
        assert all(token == pad for token in ids[length:])
        assert eos not in ids[: length - 1]  # nothing after the first EOS
        assert truncated == (ids[length - 1] != eos) and (not truncated or length == 6)
    # The same generator state gives the same completions, and the stream moves on.
    again = engine.generate(prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, out.completion_ids)
    generator = torch.Generator().manual_seed(0)
    first = engine.generate(prompt_ids, prompt_mask, params, generator=generator)
    second = engine.generate(prompt_ids, prompt_mask, params, generator=generator)
    assert not torch.equal(first.completion_ids, second.completion_ids)


def chi2_critical(df: int, z: float = 4.26) -> float:
    """Upper χ² quantile by the Wilson–Hilferty approximation; z = 4.26 is a one-sided 1e-5 tail."""
    k = 2.0 / (9.0 * df)
    return df * (1.0 - k + z * math.sqrt(k)) ** 3


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution ``generate(do_sample=True)`` samples from, by transformers' own warpers."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0].softmax(-1)


@pytest.mark.parametrize("name", list(ENGINES))
def test_sampled_token_pairs_follow_the_model_distribution(name, tiny_llama, tokenizer):
    """χ² over the joint distribution of the first two tokens (top-k 3: 9 cells), exact from the model's logits:
    the first decoding step (from the shared prompt cache) and the next (from a sampled token) are both right."""
    temperature, top_k, draws = 0.8, 3, 6000
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(["3+4="])
    params = SamplingParams(
        group_size=draws, max_new_tokens=2, min_new_tokens=2, temperature=temperature, top_k=top_k, batch_size=draws
    )
    out = make_engine(name, tiny_llama, tokenizer).generate(
        prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(7)
    )
    pairs = out.completion_ids.tolist()
    with torch.no_grad():
        first = filtered_probs(tiny_llama(prompt_ids).logits[0, -1], temperature, top_k)
        expected = {}
        for t1 in first.nonzero().flatten().tolist():
            second = filtered_probs(
                tiny_llama(torch.cat([prompt_ids[0], torch.tensor([t1])])[None]).logits[0, -1], temperature, top_k
            )
            for t2 in second.nonzero().flatten().tolist():
                expected[(t1, t2)] = float(first[t1] * second[t2]) * draws
    counts: dict[tuple[int, int], int] = {}
    for t1, t2 in pairs:
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    assert set(counts) <= set(expected)  # no pair outside the filtered support
    chi2 = sum((counts.get(cell, 0) - e) ** 2 / e for cell, e in expected.items())
    assert chi2 < chi2_critical(len(expected) - 1), f"χ² = {chi2:.1f} over {len(expected)} cells"


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
