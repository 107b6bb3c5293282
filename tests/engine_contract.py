"""The rollout engine contract as checks on any engine, shared by ``test_engines.py`` and ``test_vllm.py``.

Greedy completions equal ``model.generate(do_sample=False)`` token for token; without filters the sampled tokens'
log-probs equal the trainer's (``completion_logprobs``) in float32, and with temperature, top-k, top-p and a
minimum length they are those of the filtered distribution the tokens were drawn from (``engines/base.py``);
masks, truncation and padding follow ``Completions``' rules and the same generator state gives the same
completions; the joint distribution of sampled token pairs passes a χ² test against the model's own (tempered,
top-k filtered) distribution. ``make_instruct_like_folder`` builds the model these run on a second time: a folder
shaped like a real instruct model's (two EOS ids, sampling defaults in its ``generation_config``), on which every
end id must end a completion and none of the defaults may reach the sampler.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from grpo_lightning.engines import RolloutEngine, SamplingParams
from grpo_lightning.engines.token_sampling import filter_logits
from grpo_lightning.importance import truncated_importance_weights
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.rollout.prompts import PromptEncoder

PROMPTS = ["12+34=", "5+6=", "99+99=", "7="]  # different lengths: left padding
# Longer than two of the test engines' 32-token KV blocks (and within their 128-token context): vLLM's prefix cache
# holds whole blocks only, so these are what it serves from the cache when seen again.
LONG_PROMPTS = ["+".join(map(str, range(30))) + "=", "*".join(map(str, range(40, 64))) + "="]


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


def check_logprobs_equal_the_trainers(engine: RolloutEngine, model: torch.nn.Module, tokenizer, atol: float) -> None:
    """Without filters, the engine's log-probs are the trainer's tempered ones (what ``old_logprobs: auto`` takes
    for π_old). ``atol`` 1e-5 for an engine running the trainer's own forward; vLLM's kernels round differently."""
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS[:2])
    params = SamplingParams(group_size=4, max_new_tokens=8, temperature=0.7)
    assert not params.filtered
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
    if out.policy_logprobs is not None:  # unfiltered: the same values
        torch.testing.assert_close(out.policy_logprobs, out.logprobs)


def sampling_logprobs(model: torch.nn.Module, out, params: SamplingParams, end_ids: tuple[int, ...]) -> torch.Tensor:
    """``[N, T]``: each completion token's log-prob under the distribution ``params`` describes, from the model's
    full logits (one unpadded forward per row): every end id banned before ``min_new_tokens``, then temperature,
    top-k and top-p (``engines.sampling.filter_logits``), renormalised."""
    expected = torch.zeros(out.completion_ids.shape)
    for row in range(out.completion_ids.size(0)):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        completion = out.completion_ids[row][out.completion_mask[row].bool()]
        with torch.no_grad():
            logits = model(torch.cat([prompt, completion])[None]).logits[0, prompt.numel() - 1 : -1].float()
        logits[: params.min_new_tokens, list(end_ids)] = float("-inf")
        scores = filter_logits(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        expected[row, : completion.numel()] = scores.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)
    return expected


def check_filtered_logprobs_are_the_sampling_distributions(
    engine: RolloutEngine, model: torch.nn.Module, tokenizer, atol: float
) -> None:
    """With temperature, top-k, top-p and a minimum length, the log-probs are the drawn tokens' under the filtered,
    renormalised distribution they came from (``engines/base.py``), for every engine alike."""
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS[:2])
    params = SamplingParams(group_size=4, max_new_tokens=8, min_new_tokens=2, temperature=0.7, top_k=5, top_p=0.9)
    assert params.filtered
    out = engine.generate(
        prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(3), return_logprobs=True
    )
    expected = sampling_logprobs(model, out, params, model_end_ids(model, tokenizer))
    mask = out.completion_mask.bool()
    assert torch.isfinite(expected[mask]).all()  # no token from outside the filtered support
    torch.testing.assert_close(out.logprobs[mask], expected[mask], atol=atol, rtol=atol)
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7
        )
    assert (out.logprobs[mask] > trainer[mask] + 1e-3).any()  # renormalised: above the trainer's where filtered
    if engine.shares_weights:  # the tempered policy's, beside them: π_old on the trainer's own weights
        assert out.policy_logprobs is not None
        torch.testing.assert_close(out.policy_logprobs[mask], trainer[mask], atol=atol, rtol=atol)
        assert (out.policy_logprobs[~mask] == 0).all()


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


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, banned: tuple[int, ...] = ()) -> torch.Tensor:
    """The distribution ``generate(do_sample=True)`` samples from, by transformers' own warpers (``banned``: the
    end ids a minimum length forbids)."""
    logits = logits.clone()
    logits[list(banned)] = float("-inf")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits[None])[0].softmax(-1)


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
        ends = model_end_ids(model, tokenizer)  # banned: min_new_tokens covers both tokens
        first = filtered_probs(model(prompt_ids).logits[0, -1], temperature, top_k, ends)
        expected = {}
        for t1 in first.nonzero().flatten().tolist():
            second = filtered_probs(
                model(torch.cat([prompt_ids[0], torch.tensor([t1])])[None]).logits[0, -1], temperature, top_k, ends
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


# ----------------------------------------------------------------------------- a real instruct model's shape
def make_instruct_like_folder(path: Path) -> tuple[str, int]:
    """A tiny Llama saved as a Hugging Face folder shaped like a real instruct model's; returns it and its second
    end id.

    - **Two EOS ids**: the tokenizer's ``<eos>`` and, in ``generation_config`` only, ``<|endoftext|>`` (as
      Qwen2.5-Instruct lists ``<|im_end|>`` and ``<|endoftext|>``). The model draws ``<|endoftext|>`` often (about
      one step in ten), so completions really end on an id the tokenizer does not call EOS.
    - **Sampling defaults** in ``generation_config`` that would change the distribution if any engine took them:
      repetition penalty, top-k, top-p, temperature, min-p, no repeated tokens.
    - Head size 32, which vLLM's CPU attention has kernels for.
    """
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    size = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    model = build_tiny_llama(size, tokenizer).eval()
    encoded = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.model(**encoded).last_hidden_state[encoded["attention_mask"].bool()].mean(0)
        # a logit of about 2 wherever the state looks like the average one: p ≈ 0.1 per step, spread 0.005–0.3
        model.model.embed_tokens.weight[end] = 2.0 * hidden / hidden.norm() ** 2
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, end],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=0.3,
        top_k=2,
        top_p=0.5,
        min_p=0.3,
        repetition_penalty=2.0,
        no_repeat_ngram_size=1,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), end


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, ends: tuple[int, ...]) -> list[int]:
    """Greedy decoding by hand: the argmax of the model's own logits at each step, up to any end id."""
    out: list[int] = []
    while len(out) < max_new and not (out and out[-1] in ends):
        with torch.no_grad():
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def model_end_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """The ids that end a completion, read from the model's files (not from the engine under test)."""
    extra = model.generation_config.eos_token_id
    return tuple(dict.fromkeys([tokenizer.eos_token_id, *([extra] if isinstance(extra, int) else extra or [])]))


def end_of(row: list[int], ends: tuple[int, ...], stops: tuple[tuple[int, ...], ...], min_new: int) -> int | None:
    """The length at which ``row`` ends by the engines' rule: the first end id or stop sequence whose last token is
    at index ``min_new`` or later; None when neither occurs."""
    for i in range(min_new, len(row)):
        if row[i] in ends or any(i + 1 >= len(s) and tuple(row[i + 1 - len(s) : i + 1]) == s for s in stops):
            return i + 1
    return None


def check_rows_end_by_the_rule(out, ends, stops, min_new: int, max_new: int, pad: int) -> None:
    """Every row ends where ``end_of`` says, or is truncated at ``max_new``; the mask covers no padding."""
    for ids, mask, truncated in zip(out.completion_ids.tolist(), out.completion_mask.tolist(), out.truncated.tolist()):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)
        assert all(token == pad for token in ids[length:])
        end = end_of(ids[:length], ends, stops, min_new)
        if truncated:
            assert end is None and length == max_new, (ids, length)
        else:
            assert end == length, (ids, length, end)


def check_every_end_id_ends_and_no_default_applies(engine: RolloutEngine, model: torch.nn.Module, tokenizer) -> None:
    """On ``make_instruct_like_folder``'s model: the engine knows both end ids, samples end on either, greedy is
    the argmax of the model's own logits (none of the folder's repetition penalty or n-gram ban)."""
    ends = model_end_ids(model, tokenizer)
    second = ends[1]
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(PROMPTS)
    params = SamplingParams(group_size=8, max_new_tokens=16, temperature=1.0)
    out = engine.generate(prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(0))
    check_rows_end_by_the_rule(out, ends, (), 0, 16, tokenizer.pad_token_id)
    last = out.completion_ids.gather(1, (out.completion_mask.sum(-1, keepdim=True) - 1).clamp(min=0)).flatten()
    assert (~out.truncated & (last == second)).sum() >= 4  # really ended on generation_config's id
    greedy = engine.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=16, greedy=True))
    for row in range(len(PROMPTS)):
        prompt = prompt_ids[row][prompt_mask[row].bool()].tolist()
        expected = reference_greedy(model, prompt, 16, ends)
        assert greedy.completion_ids[row][greedy.completion_mask[row].bool()].tolist() == expected
        assert bool(greedy.truncated[row]) == (expected[-1] not in ends)


def check_min_new_tokens_and_stop_sequences(engine: RolloutEngine, model: torch.nn.Module, tokenizer) -> None:
    """A stop sequence ends a completion like an end id does, never before ``min_new_tokens``: one completed
    earlier is sampled freely (not banned) and the completion goes on. The same tokens on every engine."""
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(["3+4="])
    with torch.no_grad():  # the model's favourite first token: a one-token stop sequence it draws early and often
        logits = model(prompt_ids).logits[0, -1]
        likely = int(logits.index_fill(0, torch.tensor(model_end_ids(model, tokenizer)), float("-inf")).argmax())
    stops = ((likely,), tuple(tokenizer("1+", add_special_tokens=False)["input_ids"]))
    params = SamplingParams(group_size=48, max_new_tokens=10, min_new_tokens=3, top_k=3, stop_sequences=stops)
    out = engine.generate(prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(1))
    check_rows_end_by_the_rule(out, model_end_ids(model, tokenizer), stops, 3, 10, tokenizer.pad_token_id)
    early = [ids[:3].count(likely) for ids in out.completion_ids.tolist()]
    assert sum(early) >= 5  # drawn before the minimum (so not banned), and those completions went on


def lora_with_a_trained_copy(model: torch.nn.Module, modules: tuple[str, ...] = ("lm_head",), seed: int = 0):
    """``model`` (a copy) with LoRA adapters and ``modules_to_save`` layers (``model.lora``'s own wrapping), whose
    trained copies have moved while the adapters are still at zero: only the copies make it differ from
    ``model``, so an engine that shows the difference received them (under names it knows)."""
    import copy

    from grpo_lightning.lora import LoraConfig, apply_lora

    wrapped = apply_lora(copy.deepcopy(model), LoraConfig(r=4, alpha=8, modules_to_save=list(modules))).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if ".modules_to_save." in name:
                parameter.add_(0.5 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return wrapped
