"""Stop texts, token-exact and linear: a special token as a stop text, a SentencePiece-style tokenizer (``▁`` marks a
leading space, so a close tag mid-text is other ids than alone), multi-byte characters, and a scan that decodes a
bounded window per token instead of every prefix. The engine's stop sequences stop only where the text rule cuts.
"""

from __future__ import annotations

import string

import pytest
import torch
from test_multiturn import ScriptedEngine
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from grpo_lightning.engines.base import SamplingParams, stop_lengths
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.environments.multiturn import cut_at_stop_text, generate_trajectories, stop_sequences
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rollout.prompts import PromptEncoder


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Unigram model with a ``Metaspace`` pre-tokenizer and decoder, as SentencePiece (Llama-2, Mistral, Gemma)
    tokenizers are: ``</tool>`` alone is ``▁</tool>``; after ``x`` it is ``</``, ``tool``, ``>``. ``<|stop|>`` is an
    added special token."""
    pieces = [("<pad>", 0.0), ("<eos>", 0.0), ("<unk>", 0.0)]
    pieces += [(p, -1.0) for p in ["▁</tool>", "▁<tool>", "</", "tool", ">", "<", "▁x", "▁a", "▁12", "▁the", "▁"]]
    pieces += [(c, -5.0) for c in string.digits + string.ascii_letters + string.punctuation]
    pieces += [("▁" + c, -4.0) for c in string.digits + string.ascii_letters]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|stop|>"]})
    return tokenizer


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2, Llama-3, Qwen style), trained here: ``é`` and ``€`` are several byte tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["<tool>calculator: 12*34</tool> the answer", "a </tool> x</tool>"] * 5, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|stop|>"]})
    return tokenizer


TOKENIZERS = {
    "char": build_char_tokenizer,
    "sentencepiece": sentencepiece_tokenizer,
    "byte_level": byte_level_tokenizer,
}
TEXTS = [
    "<tool>calculator: 12*34</tool> and more",
    "a b c </tool>",
    "x</tool>tail",
    "</tool>",
    "no stop here at all",
    "café 12€ </tool> é",
    "é€é€</tool>",
    "hi<|stop|>ho",
]


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def first_prefix_holding(ids, stop_texts, tokenizer) -> int:
    """The rule, the slow way: decode every prefix (special tokens kept)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if any(s in text for s in stop_texts):
            return k
    return len(ids)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_scan_cuts_where_decoding_every_prefix_would(name):
    tokenizer = TOKENIZERS[name]()
    for text in TEXTS:
        ids = ids_of(tokenizer, text)
        for stops in (("</tool>",), ("<|stop|>",), ("</tool>", "<|stop|>"), ("é€",)):
            assert cut_at_stop_text(ids, stops, tokenizer) == first_prefix_holding(ids, stops, tokenizer), (text, stops)


def test_a_special_token_is_a_stop_text():
    tokenizer = sentencepiece_tokenizer()
    ids = ids_of(tokenizer, "hi<|stop|>ho")
    assert cut_at_stop_text(ids, ("<|stop|>",), tokenizer) == 3  # ▁h, i, <|stop|>
    stop_id = tokenizer.convert_tokens_to_ids("<|stop|>")
    assert (stop_id,) in stop_sequences(ToolEnvironmentWithStops("<|stop|>"), tokenizer)


class ToolEnvironmentWithStops(ToolEnvironment):
    def __init__(self, *stops: str) -> None:
        super().__init__(format="tag")
        self._stops = stops

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return self._stops


def test_the_engine_stops_at_a_close_tag_written_mid_text_by_a_sentencepiece_tokenizer():
    tokenizer = sentencepiece_tokenizer()
    sequences = stop_sequences(ToolEnvironment(format="tag"), tokenizer)
    generated = ids_of(tokenizer, "12*34</tool>babble")  # ▁12 * 3 4 </ tool > ...: not ▁</tool>
    stop = len(ids_of(tokenizer, "12*34</tool>"))
    assert stop_lengths(torch.tensor([generated]), sequences).tolist() == [stop]
    assert stop_lengths(torch.tensor([ids_of(tokenizer, "a </tool>x")]), sequences).tolist() == [2]  # ▁a ▁</tool>


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_sequences_only_ever_stop_where_the_text_rule_cuts(name):
    # Early stopping keeps the same tokens: wherever an engine stops at a stop sequence, the text rule has cut at
    # that token or before it, so cutting the engine's tokens by the rule gives the same turn.
    tokenizer = TOKENIZERS[name]()
    stops = ("</tool>", "<|stop|>")
    sequences = stop_sequences(ToolEnvironmentWithStops(*stops), tokenizer)
    for text in [*TEXTS, "x" * 5 + "</tool>", "</to" + "ol>", "1</tool>2</tool>"]:
        ids = ids_of(tokenizer, text)
        rule = cut_at_stop_text(ids, stops, tokenizer)
        engine = int(stop_lengths(torch.tensor([ids]), sequences)[0])
        assert engine >= rule, (text, engine, rule)
        if any(s in text for s in stops):  # written as one of the sequences here: the engine stops at the rule's token
            assert engine == rule, (text, engine, rule)


class CountingDecodes:
    """The tokenizer, counting what ``decode`` is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls, self.tokens = tokenizer, 0, 0

    def decode(self, ids, **kwargs):
        self.calls, self.tokens = self.calls + 1, self.tokens + len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_stop_scan_is_linear_in_the_turns_length(name):
    counting = CountingDecodes(TOKENIZERS[name]())
    repeats = 100
    while len(ids := ids_of(counting.tokenizer, "the 12 x a " * repeats + "</tool>")) < 2000:  # the stop last
        repeats += 10
    n = len(ids)
    assert cut_at_stop_text(ids, ("</tool>",), counting) == n
    assert counting.calls <= 3 * n and counting.tokens <= 10 * n  # a window per token, never every prefix (n²/2)


def test_a_rollout_stops_the_same_with_or_without_early_stopping_on_a_sentencepiece_tokenizer():
    tokenizer = sentencepiece_tokenizer()

    def policy(context: str) -> str:
        return "12<eos>" if "<result>" in context else "x<tool>calculator: 3*4</tool>babble"

    turns = []
    for honour_stops in (False, True):
        engine = ScriptedEngine(tokenizer, policy, honour_stops=honour_stops)
        env = ToolEnvironment(tools=["calculator"], format="tag")
        out = generate_trajectories(
            {"prompt": ["3*4="]},
            engine=engine,
            encoder=PromptEncoder(tokenizer),
            environment=env,
            params=SamplingParams(group_size=2, max_new_tokens=120),
        )
        assert out.stats["tool_calls"] == [1.0, 1.0] and out.final_texts == ["12", "12"]
        turns.append(out.completions.completion_ids.tolist())
    assert turns[0] == turns[1]
