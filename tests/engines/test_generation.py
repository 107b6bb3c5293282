"""The sampling loop: masks at EOS, padding and truncation; KV-cache decoding equals full recomputation."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.engines.lean import sample_completions
from grpo_lightning.engines.token_sampling import filter_logits
from grpo_lightning.models.logprobs import completion_logprobs, token_logprobs


def encode(tokenizer, prompts):
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def greedy_without_cache(model, ids, max_new_tokens, eos):
    """Reference greedy decoding: recompute the whole sequence at every step, one prompt at a time, no padding."""
    out = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids).logits[:, -1]
        token = logits.argmax(-1)
        out.append(int(token))
        if int(token) == eos:
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    return out


def test_greedy_with_cache_and_left_padding_equals_full_recomputation(tiny_llama, tokenizer):
    prompts = ["12+34=", "5+6=", "99+99="]  # different lengths: left padding in the batch
    ids, mask = encode(tokenizer, prompts)
    assert (mask == 0).any()
    out = sample_completions(
        tiny_llama,
        ids,
        mask,
        group_size=1,
        max_new_tokens=8,
        greedy=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for row, prompt in enumerate(prompts):
        single = torch.tensor([tokenizer(prompt)["input_ids"]])
        expected = greedy_without_cache(tiny_llama, single, 8, tokenizer.eos_token_id)
        length = int(out.completion_mask[row].sum())
        assert out.completion_ids[row, :length].tolist() == expected


def test_masks_at_eos_and_truncation(tiny_llama, tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids, mask = encode(tokenizer, ["1+1=", "23+4="])
    out = sample_completions(
        tiny_llama,
        ids,
        mask,
        group_size=16,
        max_new_tokens=6,
        eos_token_id=eos,
        pad_token_id=pad,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.completion_ids.shape[0] == 32 and out.prompt_ids.shape[0] == 32
    for row in range(32):
        tokens, m = out.completion_ids[row].tolist(), out.completion_mask[row].tolist()
        if eos in tokens:
            end = tokens.index(eos)
            assert m == [1] * (end + 1) + [0] * (len(tokens) - end - 1)  # EOS itself is in the loss
            assert all(t == pad for t in tokens[end + 1 :])
            assert not out.truncated[row]
        else:
            assert m == [1] * len(tokens) and len(tokens) == 6
            assert out.truncated[row]


def eos_bias(model, eos: int, value: float) -> None:
    """Add ``value`` to the EOS logit through an output-layer bias (which the lean decoder and the model's own
    forward both read): +50 makes EOS all but certain at every step, -50 all but impossible."""
    bias = torch.zeros(model.lm_head.out_features)
    bias[eos] = value
    model.lm_head.bias = torch.nn.Parameter(bias)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "model-forward"])
def test_eos_is_banned_before_min_new_tokens_and_the_length_limit_truncates(tiny_llama, tokenizer, lean):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids, mask = encode(tokenizer, ["7+8=", "12+30="])

    def sample(min_new_tokens: int):
        return sample_completions(
            tiny_llama,
            ids,
            mask,
            group_size=8,
            max_new_tokens=6,
            min_new_tokens=min_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            generator=torch.Generator().manual_seed(1),
            lean=lean,
        )

    eos_bias(tiny_llama, eos, 50.0)  # the model wants to end at once
    assert (sample(min_new_tokens=0).completion_ids[:, 0] == eos).all()  # the control: it does, unbanned
    out = sample(min_new_tokens=3)
    # Three tokens drawn with EOS banned, then EOS at the first step it is allowed: every completion is 4 long.
    assert out.completion_ids.shape == (16, 4)
    assert (out.completion_ids[:, :3] != eos).all() and (out.completion_ids[:, 3] == eos).all()
    assert out.completion_mask.all() and not out.truncated.any()  # EOS itself is in the loss

    eos_bias(tiny_llama, eos, -50.0)  # the model never ends by itself
    out = sample(min_new_tokens=0)
    # The length limit ends every completion: no EOS is written in its place, and each is flagged truncated
    # (what mask_truncated_completions and the overlong rewards read).
    assert out.completion_ids.shape == (16, 6) and (out.completion_ids != eos).all()
    assert out.completion_mask.all() and out.truncated.all()


def test_group_samples_share_prompt_and_differ(tiny_llama, tokenizer):
    ids, mask = encode(tokenizer, ["3+4=", "10+20="])
    out = sample_completions(
        tiny_llama,
        ids,
        mask,
        group_size=4,
        max_new_tokens=6,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(out.prompt_ids[:4], ids[0:1].expand(4, -1))
    assert torch.equal(out.prompt_ids[4:], ids[1:2].expand(4, -1))
    assert len({tuple(r) for r in out.completion_ids[:4].tolist()}) > 1  # random model, temperature 1


def test_logprobs_match_a_plain_log_softmax(tiny_llama, tokenizer):
    ids, mask = encode(tokenizer, ["12+3=", "4+5="])
    out = sample_completions(
        tiny_llama,
        ids,
        mask,
        group_size=2,
        max_new_tokens=5,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    lp, _ = completion_logprobs(
        tiny_llama,
        out.prompt_ids,
        out.prompt_mask,
        out.completion_ids,
        out.completion_mask,
        temperature=0.7,
        micro_batch_size=3,
    )
    for row in range(4):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        n = int(out.completion_mask[row].sum())
        full = torch.cat([prompt, out.completion_ids[row, :n]])[None]
        logits = tiny_llama(input_ids=full).logits[0, len(prompt) - 1 : -1] / 0.7
        expected = logits.log_softmax(-1).gather(-1, full[0, len(prompt) :, None]).squeeze(-1)
        # float32 log-probs of size ≤ ~5 from two passes summing in another order (batched and chunked vs one
        # row): a few ulps (~5e-7); measured ≤ 1% of this bound with AVX-512 and AVX2, at 1 and 2 threads.
        torch.testing.assert_close(lp[row, :n], expected, atol=1e-5, rtol=1e-5)


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, 1.0, 2.0]]])
    lp, ent = token_logprobs(logits, torch.tensor([[2]]), with_entropy=True)
    p = torch.tensor([1.0, 2.718281828, 7.389056099]) / (1 + 2.718281828 + 7.389056099)
    # float32 defaults (atol 1e-5, rtol 1.3e-6) against values computed from 10-digit constants: a handful of ulps.
    torch.testing.assert_close(lp, p[2].log().view(1, 1))
    torch.testing.assert_close(ent, (-(p * p.log()).sum()).view(1, 1))


def test_filter_logits_top_k_and_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    probs = logits.softmax(-1)[0]  # ≈ [0.644, 0.237, 0.087, 0.032]
    kept = ~torch.isinf(filter_logits(logits, top_p=0.7)[0])
    assert kept.tolist() == [True, True, False, False] and probs[0] < 0.7
    assert (~torch.isinf(filter_logits(logits, top_p=0.5)[0])).tolist() == [True, False, False, False]
