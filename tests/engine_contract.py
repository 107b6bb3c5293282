"""The rollout engine contract as checks on any engine, shared by ``test_engines.py`` and ``test_vllm.py``.

Greedy completions equal ``model.generate(do_sample=False)`` token for token; the sampled tokens' log-probs equal
the trainer's (``completion_logprobs``) in float32; masks, truncation and padding follow ``Completions``' rules
and the same generator state gives the same completions; the joint distribution of sampled token pairs passes a
χ² test against the model's own (tempered, top-k filtered) distribution.
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from grpo_lightning.engines import RolloutEngine, SamplingParams
from grpo_lightning.loss import truncated_importance_weights
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.rollout.prompts import PromptEncoder

PROMPTS = ["12+34=", "5+6=", "99+99=", "7="]  # different lengths: left padding


def check_greedy_equals_generate(engine: RolloutEngine, model: torch.nn.Module, tokenizer) -> None:
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    max_new = 12
    out = engine.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=max_new, greedy=True))
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


def check_logprobs_equal_the_trainers(
    engine: RolloutEngine, model: torch.nn.Module, tokenizer, atol: float, filtered: bool = True
) -> None:
    """``atol`` 1e-5 for an engine running the trainer's own forward; vLLM's kernels round differently.

    ``filtered``: sample with top-k and a minimum length. The engines sharing the trainer's weights return the
    trainer's (unfiltered) log-probs; vLLM returns those of the filtered, renormalised distribution it sampled
    from, so it is checked without filters.
    """
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS[:2])
    params = SamplingParams(
        group_size=4, max_new_tokens=8, min_new_tokens=2 if filtered else 0, temperature=0.7, top_k=5 if filtered else 0
    )
    generator = torch.Generator().manual_seed(3)
    out = engine.generate(prompt_ids, prompt_mask, params, generator=generator, return_logprobs=True)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    with torch.no_grad():
        expected, _ = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7
        )
    mask = out.completion_mask.bool()
    torch.testing.assert_close(out.logprobs[mask], expected[mask], atol=atol, rtol=atol)
    assert (out.logprobs[~mask] == 0).all()


def check_mask_truncation_and_padding_rules(engine: RolloutEngine, tokenizer) -> None:
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    params = SamplingParams(group_size=3, max_new_tokens=6, temperature=1.5)
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


def check_token_pairs_follow_the_model_distribution(engine: RolloutEngine, model: torch.nn.Module, tokenizer) -> None:
    """χ² over the joint distribution of the first two tokens (top-k 3: 9 cells), exact from the model's logits:
    the first decoding step (from the shared prompt cache) and the next (from a sampled token) are both right."""
    temperature, top_k, draws = 0.8, 3, 6000
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(["3+4="])
    params = SamplingParams(
        group_size=draws, max_new_tokens=2, min_new_tokens=2, temperature=temperature, top_k=top_k, batch_size=draws
    )
    out = engine.generate(prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(7))
    pairs = out.completion_ids.tolist()
    with torch.no_grad():
        first = filtered_probs(model(prompt_ids).logits[0, -1], temperature, top_k)
        expected = {}
        for t1 in first.nonzero().flatten().tolist():
            second = filtered_probs(
                model(torch.cat([prompt_ids[0], torch.tensor([t1])])[None]).logits[0, -1], temperature, top_k
            )
            for t2 in second.nonzero().flatten().tolist():
                expected[(t1, t2)] = float(first[t1] * second[t2]) * draws
    counts: dict[tuple[int, int], int] = {}
    for t1, t2 in pairs:
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    assert set(counts) <= set(expected)  # no pair outside the filtered support
    chi2 = sum((counts.get(cell, 0) - e) ** 2 / e for cell, e in expected.items())
    assert chi2 < chi2_critical(len(expected) - 1), f"χ² = {chi2:.1f} over {len(expected)} cells"


def importance_weights_of(engine: RolloutEngine, policy: torch.nn.Module, tokenizer) -> tuple:
    """The engine's samples, the trainer's log-probs of them (π_old) and the TIS weights and metrics (C = 2)."""
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    params = SamplingParams(group_size=8, max_new_tokens=8, temperature=1.0)
    out = engine.generate(
        prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(0), return_logprobs=True
    )
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            policy, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask
        )
    weights, metrics = truncated_importance_weights(trainer, out.logprobs, out.completion_mask, cap=2.0)
    return out, trainer, weights, metrics


def check_a_perturbed_engine_is_caught(faithful: dict, perturbed: tuple) -> None:
    """``faithful``: the metrics of an engine on the policy's weights; ``perturbed``: ``importance_weights_of``
    an engine on a noisy copy. The mismatch metrics rise far above rounding, and each token's weight is below 1
    exactly where the engine gave the token more probability than the trainer (and never above C)."""
    out, trainer, weights, metrics = perturbed
    # noise of 0.3 std moves log-probs by ~0.04; a faithful engine differs by kernel rounding only
    assert metrics["mismatch_abs_logprob"] > max(0.01, 100 * faithful["mismatch_abs_logprob"])
    assert metrics["mismatch_kl"] > max(1e-4, 100 * faithful["mismatch_kl"])
    mask = out.completion_mask.bool()
    overrated = mask & (out.logprobs > trainer)
    assert overrated.any() and (weights[overrated] < 1).all()
    assert (weights[mask & ~overrated] >= 1).all() and (weights[mask] <= 2.0).all()
