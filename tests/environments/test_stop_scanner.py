"""``StopScanner``: a rollout's stop-text scans with each window of tokens decoded once, and the cuts of
``find_stop`` (the rule: the shortest prefix whose text holds a stop text) for every tokenizer kind of
``test_stop_texts``; a rollout's worth of tool calls decodes each distinct window once, a second pass none."""

from __future__ import annotations

import random

import pytest
from test_stop_texts import TEXTS, TOKENIZERS, CountingDecodes, first_prefix_holding, ids_of

from grpo_lightning.integrations.environments.stops import StopScanner, decode, find_stop
from grpo_lightning.models.tiny import build_char_tokenizer

STOPS = (("</tool>",), ("<|stop|>",), ("</tool>", "<|stop|>"), ("é€",), ("", "</tool>"), ())


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_scanner_cuts_where_decoding_every_prefix_would(name):
    tokenizer = TOKENIZERS[name]()
    extra = ["x" * 5 + "</tool>", "</to" + "ol>", "1</tool>2</tool>", "é" * 3 + "</tool>", ""]
    for stops in STOPS:
        scanner = StopScanner(stops, tokenizer)
        for text in [*TEXTS, *extra] * 2:  # the second time from the kept windows' texts
            ids = ids_of(tokenizer, text)
            cut, found = scanner.find(ids)
            assert (cut, found) == find_stop(ids, stops, tokenizer), (text, stops)
            rule = first_prefix_holding(ids, [s for s in stops if s], tokenizer) if any(stops) else len(ids)
            assert cut == rule, (text, stops)
            assert found == any(s and s in decode(tokenizer, ids) for s in stops), (text, stops)  # as decoded


def calculator_turns(count: int, seed: int = 0) -> list[str]:
    """Turns as the calculator demo's policy writes them: a tool call, its close tag, sometimes trailing text."""
    rng = random.Random(seed)
    turns = []
    for _ in range(count):
        a, b = rng.randrange(100, 10000), rng.randrange(100, 10000)
        turns.append(f"<tool>calculator: {a}*{b}</tool>" + rng.choice(["", "x", " 12"]))
    return turns


def test_a_rollouts_turns_decode_each_window_once():
    counting = CountingDecodes(build_char_tokenizer())
    turns = [ids_of(counting.tokenizer, text) for text in calculator_turns(256)]  # a round of the demo's turn 1
    scanner = StopScanner(("</tool>",), counting)
    cuts = [scanner.find(ids) for ids in turns]
    assert cuts == [find_stop(ids, ("</tool>",), counting.tokenizer) for ids in turns]
    assert all(found for _, found in cuts) and all(cut <= len(ids) for (cut, _), ids in zip(cuts, turns))
    scanned = sum(cut for cut, _ in cuts)  # tokens scanned: ~two windows each without the kept texts
    # One decode per distinct window (single characters and pairs of them): far fewer than the ~2 per token
    # that decoding every window costs (8000 here).
    assert counting.calls == len(scanner._texts) and counting.calls < scanned / 10
    calls = counting.calls
    assert [scanner.find(ids) for ids in turns] == cuts and counting.calls == calls  # all kept: no decode


def test_the_kept_texts_are_bounded():
    counting = CountingDecodes(build_char_tokenizer())
    turns = [ids_of(counting.tokenizer, text) for text in calculator_turns(64, seed=1)]
    scanner = StopScanner(("</tool>",), counting, max_windows=7)
    cuts = [scanner.find(ids) for ids in turns]
    assert len(scanner._texts) == 7  # no more kept; the others are decoded each time, with the same cuts
    assert cuts == [find_stop(ids, ("</tool>",), counting.tokenizer) for ids in turns]
    assert counting.calls > 2 * sum(cut for cut, _ in cuts) * 0.5
