"""The fast sampler draws from the right distribution: the one transformers' own sampling uses.

``sample_next`` filters logits (temperature → top-k → top-p, as ``generate()`` orders its warpers) and draws by
inverting the cumulative distribution. These tests check the filtered distribution against transformers'
``TemperatureLogitsWarper``/``TopKLogitsWarper``/``TopPLogitsWarper``, the empirical token frequencies against that
exact distribution (χ² bound), and greedy decoding token for token against ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import pytest
import torch
from engine_contract import chi2_critical
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpo_lightning.engines.lean import sample_completions
from grpo_lightning.engines.token_sampling import filter_logits, sample_next
from grpo_lightning.models.logprobs import completion_logprobs

# Distinct values (no ties, so top-k/top-p keep the same set whatever the sort order), none at a top-p boundary.
LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.1, 1.2, -0.3, 0.0, 2.6, -2.2, 0.9])
SETTINGS = [
    # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),
    (1.7, 0, 1.0),
    (1.0, 3, 1.0),
    (1.0, 0, 0.8),
    (0.7, 5, 0.9),
    (1.3, 4, 0.75),
]
DRAWS = 200_000


def transformers_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution ``generate(do_sample=True)`` samples from, built from transformers' own warpers."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0].softmax(-1)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_filtered_distribution_matches_transformers(temperature: float, top_k: int, top_p: float) -> None:
    ours = filter_logits(LOGITS[None], temperature=temperature, top_k=top_k, top_p=top_p)[0].softmax(-1)
    expected = transformers_probs(LOGITS, temperature, top_k, top_p)
    assert torch.equal(ours > 0, expected > 0)  # the same tokens survive the filters
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    kept = int((expected > 0).sum())
    if top_k:
        assert kept <= top_k
    if top_p < 1.0:  # the smallest set of top tokens holding at least top_p of the tempered, top-k mass
        before = filter_logits(LOGITS[None], temperature=temperature, top_k=top_k)[0].softmax(-1)
        kept_probs = before[expected > 0]
        assert kept_probs.sum() >= top_p > kept_probs.sum() - kept_probs.min()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_sampled_frequencies_match_the_filtered_distribution(temperature: float, top_k: int, top_p: float) -> None:
    generator = torch.Generator().manual_seed(1234)
    tokens = sample_next(
        LOGITS.expand(DRAWS, -1), temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
    )
    counts = torch.bincount(tokens, minlength=LOGITS.numel()).double()
    expected = transformers_probs(LOGITS, temperature, top_k, top_p).double() * DRAWS
    support = expected > 0
    assert counts[~support].sum() == 0  # filtered tokens are never drawn
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    assert chi2 < chi2_critical(int(support.sum()) - 1), f"χ² = {chi2:.1f}"


def test_sampled_frequencies_match_multinomial_on_a_large_vocabulary() -> None:
    """Both samplers on the same random logits (8k tokens): their frequencies of the 20 likeliest tokens agree."""
    logits = torch.randn(8_000, generator=torch.Generator().manual_seed(0)) * 3
    draws = 2048
    ours = sample_next(logits.expand(draws, -1), generator=torch.Generator().manual_seed(1))
    theirs = torch.multinomial(logits.softmax(-1).expand(draws, -1), 1, generator=torch.Generator().manual_seed(2))
    top = logits.topk(20).indices
    a = torch.stack([(ours == t).sum() for t in top]).double()
    b = torch.stack([(theirs[:, 0] == t).sum() for t in top]).double()
    used = (a + b) > 0
    chi2 = float(((a - b)[used] ** 2 / (a + b)[used]).sum())  # two-sample χ² on equal sample sizes
    assert chi2 < chi2_critical(int(used.sum()))


def test_extreme_uniform_draws_never_pick_a_filtered_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """u at both ends of [0, 1): the draw still lands on a token of non-zero probability."""
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 2.0, float("-inf")]])
    for value in (0.0, 1.0 - 2**-24):
        monkeypatch.setattr(torch, "rand", lambda *shape, value=value, **_: torch.full(shape, value))
        token = int(sample_next(logits)[0])
        assert token in (1, 3)


def test_greedy_equals_transformers_generate(tiny_llama, tokenizer) -> None:
    prompts = ["12+34=", "5+6=", "99+99=", "7="]  # different lengths: left padding
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    max_new = 12
    ours = sample_completions(
        tiny_llama,
        enc["input_ids"],
        enc["attention_mask"],
        group_size=1,
        max_new_tokens=max_new,
        greedy=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        theirs = tiny_llama.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[:, enc["input_ids"].size(1) :]
    theirs = torch.nn.functional.pad(theirs, (0, max_new - theirs.size(1)), value=tokenizer.pad_token_id)
    width = ours.completion_ids.size(1)
    assert torch.equal(ours.completion_ids, theirs[:, :width])
    assert (theirs[:, width:] == tokenizer.pad_token_id).all()


def test_fixed_length_sampling_matches_generate_with_min_new_tokens(tiny_llama, tokenizer) -> None:
    """min_new_tokens = max_new_tokens: every completion has exactly that length and no EOS, as with generate()."""
    enc = tokenizer(["3+4=", "10+20="], padding=True, return_tensors="pt")
    out = sample_completions(
        tiny_llama,
        enc["input_ids"],
        enc["attention_mask"],
        group_size=8,
        max_new_tokens=10,
        min_new_tokens=10,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.completion_ids.shape == (16, 10)
    assert (out.completion_ids != tokenizer.eos_token_id).all() and out.completion_mask.all() and out.truncated.all()


def test_returned_logprobs_are_the_policy_logprobs_of_the_drawn_tokens(tiny_llama, tokenizer) -> None:
    """Unfiltered, π_old from the sampler equals a full forward's log-probs (tempered), padding 0. (With top-k,
    top-p or a minimum length they are the filtered distribution's: ``engine_contract``, on every engine.)"""
    enc = tokenizer(["12+34=", "5+6="], padding=True, return_tensors="pt")
    out = sample_completions(
        tiny_llama,
        enc["input_ids"],
        enc["attention_mask"],
        group_size=4,
        max_new_tokens=8,
        temperature=0.7,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(3),
        return_logprobs=True,
    )
    with torch.no_grad():
        expected, _ = completion_logprobs(
            tiny_llama, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7
        )
    mask = out.completion_mask.bool()
    torch.testing.assert_close(out.logprobs[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert (out.logprobs[~mask] == 0).all()
