"""Later turns continue from the kept KV cache (``engines/continuation.py``): the same samples as a full prefill.

On ``lean`` (its lean forward and the model's own) and ``transformers``: turns whose contexts are longer than a
vector's or a block's width (left-padded prompts of 3 to 30 tokens, observations of 1 to 40), a group-sampled
first turn, rows that leave at different turns and turns the rollout cut short give the tokens of a full prefill
under the same seed, their log-probs within 1e-5. A cache never serves weights that changed after it was filled,
and ``generate_trajectories`` closes its session with the rollout. Finished rows leaving the decoding batch change
no sample.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.engines import LeanEngine, SamplingParams, TransformersEngine
from grpo_lightning.engines import lean as lean_engine
from grpo_lightning.engines.model_decoder import ModelDecoder
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.environments.multiturn import generate_trajectories
from grpo_lightning.models.build import load_tokenizer
from grpo_lightning.models.lean_decoder import LeanDecoder
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.rollout.prompts import PromptEncoder

ENGINES = {
    "lean": lambda: LeanEngine(),
    "lean-model-forward": lambda: LeanEngine(lean_forward=False),
    "transformers": lambda: TransformersEngine(),
}
PROMPTS = ["ab", "a much longer prompt of thirty", "x+y=", "0123456789", "hi", "tool?", "seventeen letters", "q"]
TINY_CALC = str(Path(__file__).resolve().parents[2] / "grpo_lightning" / "assets" / "tiny-calc")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    size = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=256)
    return build_tiny_llama(size, tokenizer).eval()


def make_engine(name, model, tokenizer):
    engine = ENGINES[name]()
    engine.setup(model, tokenizer)
    engine.eos_token_ids = tuple(range(1, 12))  # rows end at different steps (a random model rarely draws EOS)
    return engine


def left_padded(rows):
    width = max(len(row) for row in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return ids, mask


def real(ids, mask):
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


def turns(engine, tokenizer, continued, batch_size=64):
    """Four engine calls as a rollout makes them: a group-sampled first turn (6 per prompt), then each going row's
    context + its turn (some cut short) + an observation of its own length; rows leave at every turn."""
    generator, rng = torch.Generator().manual_seed(0), random.Random(0)
    ids, mask = PromptEncoder(tokenizer).encode(PROMPTS)
    params = SamplingParams(group_size=6, max_new_tokens=10, batch_size=batch_size)
    session = engine.open_session() if continued else None
    extra = {"session": session} if continued else {}
    out = engine.generate(ids, mask, params, generator=generator, return_logprobs=True, **extra)
    outs = [out]
    for turn in range(1, 4):
        contexts, turns_ = real(out.prompt_ids, out.prompt_mask), real(out.completion_ids, out.completion_mask)
        going = [i for i in range(len(contexts)) if (i + turn) % 5]  # every fifth row leaves
        rows = []
        for i in going:
            kept = turns_[i][: max(1, len(turns_[i]) - 3)] if i % 4 == 0 else turns_[i]  # the rollout cut it
            rows.append(contexts[i] + kept + [rng.randrange(3, 99) for _ in range(rng.randint(1, 40))])
        if continued:
            session.select(going)
        ids, mask = left_padded(rows)
        out = engine.generate(ids, mask, params.with_(group_size=1), generator=generator, return_logprobs=True, **extra)
        outs.append(out)
    return outs, session


def assert_same_samples(outs, reference):
    for out, ref in zip(outs, reference, strict=True):
        assert torch.equal(out.prompt_ids, ref.prompt_ids) and torch.equal(out.completion_ids, ref.completion_ids)
        assert torch.equal(out.completion_mask, ref.completion_mask) and torch.equal(out.truncated, ref.truncated)
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.policy_logprobs, ref.policy_logprobs, atol=1e-5, rtol=0)


# One chunk of rows per call; chunks of 16 rows, whose kept pieces mix in the next call's chunks.
@pytest.mark.parametrize(("name", "batch_size"), [(name, 64) for name in ENGINES] + [("lean", 16)])
def test_continued_turns_sample_what_a_full_prefill_samples(name, batch_size, model, tokenizer):
    engine = make_engine(name, model, tokenizer)
    continued, session = turns(engine, tokenizer, continued=True, batch_size=batch_size)
    reference, _ = turns(engine, tokenizer, continued=False, batch_size=batch_size)
    assert_same_samples(continued, reference)
    ended = [bool((out.completion_mask.sum(-1) < 10).any() and (~out.truncated).sum() < len(out)) for out in reference]
    assert all(ended)  # rows ended at different steps in every call
    # Only the new tokens were prefilled (the observations, of 20 tokens on average): fewer than were reused.
    assert session.reused_tokens > session.prefilled_tokens > 0


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_cache_never_serves_weights_that_changed_after_it_was_filled(name, model, tokenizer):
    engine = make_engine(name, model, tokenizer)
    ids, mask = PromptEncoder(tokenizer).encode(PROMPTS[:4])
    params = SamplingParams(group_size=2, max_new_tokens=10)
    session = engine.open_session()
    out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0), session=session)
    contexts = [
        c + t + [5, 6, 7]
        for c, t in zip(real(out.prompt_ids, out.prompt_mask), real(out.completion_ids, out.completion_mask))
    ]
    ids, mask = left_padded(contexts)
    with torch.no_grad():  # an optimizer step, as far as the cache can tell
        for param in model.parameters():
            param.mul_(0.9)
    kwargs = {"generator": torch.Generator().manual_seed(1), "return_logprobs": True}
    continued = engine.generate(ids, mask, params.with_(group_size=1), session=session, **kwargs)
    kwargs = {"generator": torch.Generator().manual_seed(1), "return_logprobs": True}
    assert_same_samples([continued], [engine.generate(ids, mask, params.with_(group_size=1), **kwargs)])
    assert session.reused_tokens == 0 and session.holds  # prefilled in full, and kept anew for the new weights
    session.close()
    assert not session.holds and session.closed
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(ids, mask, params.with_(group_size=1), session=session)


def test_a_continuing_call_must_pass_the_kept_rows(model, tokenizer):
    engine = make_engine("lean", model, tokenizer)
    ids, mask = PromptEncoder(tokenizer).encode(PROMPTS[:3])
    session = engine.open_session()
    engine.generate(ids, mask, SamplingParams(group_size=2, max_new_tokens=4), session=session)
    with pytest.raises(ValueError, match="6 kept rows"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=4), session=session)
    with pytest.raises(ValueError, match="one completion per row"):
        engine.generate(ids, mask, SamplingParams(group_size=2, max_new_tokens=4), session=session)


@pytest.mark.parametrize("lean_forward", [True, False])
def test_finished_rows_leaving_the_batch_change_no_sample(lean_forward, model, tokenizer, monkeypatch):
    engine = make_engine("lean", model, tokenizer)
    engine.lean_forward = lean_forward
    ids, mask = PromptEncoder(tokenizer).encode(PROMPTS)
    params = SamplingParams(group_size=8, max_new_tokens=20, top_p=0.9)  # 64 rows
    cuts = []
    for decoder in (LeanDecoder, ModelDecoder):
        select = decoder.select
        monkeypatch.setattr(
            decoder, "select", lambda self, rows, select=select: cuts.append(len(rows)) or select(self, rows)
        )
    cut = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0), return_logprobs=True)
    assert cuts and min(cuts) == lean_engine.MIN_BATCH_ROWS  # cut, down to the floor
    monkeypatch.setattr(lean_engine, "MIN_BATCH_ROWS", 10**9)  # never cut
    count = len(cuts)
    whole = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0), return_logprobs=True)
    assert len(cuts) == count
    assert_same_samples([cut], [whole])  # every row drew the same random numbers: the same tokens


@pytest.fixture(scope="module")
def calc():
    return AutoModelForCausalLM.from_pretrained(TINY_CALC).eval(), load_tokenizer(TINY_CALC)


@pytest.mark.parametrize("name", ["lean", "transformers"])
def test_multi_turn_rollouts_continue_and_equal_the_full_prefill_ones(name, calc, monkeypatch):
    model, tokenizer = calc
    engine = ENGINES[name]()
    engine.setup(model, tokenizer)
    sessions = []
    opened = engine.open_session
    monkeypatch.setattr(engine, "open_session", lambda: sessions.append(opened()) or sessions[-1])

    def rollout():
        return generate_trajectories(
            {"prompt": ["123*456=", "5071*938=", "2222*3333=", "640*1212="]},
            engine=engine,
            encoder=PromptEncoder(tokenizer),
            environment=ToolEnvironment(tools=["calculator"], format="tag", max_turns=3, max_turn_tokens=40),
            params=SamplingParams(group_size=4, max_new_tokens=96),
            generator=torch.Generator().manual_seed(0),
            return_logprobs=True,
        )

    continued = rollout()
    monkeypatch.setattr(engine, "supports_continuation", False)
    full = rollout()
    assert len(sessions) == 1 and sessions[0].closed and not sessions[0].holds  # released with the rollout
    assert sessions[0].reused_tokens > sessions[0].prefilled_tokens > 0
    assert max(continued.stats["turns"]) >= 2
    assert_same_samples([continued.completions], [full.completions])
    assert torch.equal(continued.action_mask, full.action_mask) and continued.transcripts == full.transcripts
    assert continued.env_rewards == full.env_rewards


def test_the_lean_decoder_resumes_from_its_kept_buffers(model, tokenizer):
    """``LeanDecoder.resume`` after ``kept``: the logits of a full prefill of the longer context."""
    ids, mask = PromptEncoder(tokenizer).encode(PROMPTS[:3])
    decoder = LeanDecoder(model)
    decoder.prefill(ids, mask, 1, 40)
    keys, values, valid = decoder.kept()
    new = torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8], [0, 0, 0, 9]])
    new_mask = (torch.arange(4)[None, :] >= torch.tensor([[2], [0], [3]])).long()
    positions = (mask.sum(-1, keepdim=True) + new_mask.cumsum(-1) - 1) * new_mask
    logits = decoder.resume(keys, values, valid, new, new_mask, positions)
    full = left_padded([c + n[m.bool()].tolist() for c, n, m in zip(real(ids, mask), new, new_mask)])
    torch.testing.assert_close(logits, LeanDecoder(model).prefill(*full, 1, 1), atol=1e-5, rtol=0)
