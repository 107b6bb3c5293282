"""Stop texts in token space: where a policy turn ends, and the token sequences an engine may stop at early.

**The rule** (``find_stop``): a turn ends right after the first token at which its decoded text, special tokens
kept, holds one of the environment's stop texts (a tool call's close tag, or an end-of-turn token such as
Llama-3's ``<|eom_id|>``). Special tokens are kept because a stop text may be one; the text is that of the turn's
tokens decoded together, so a stop text split across several tokens (``</``, ``tool``, ``>``) is found as well as
one token holding it with a leading-space marker (SentencePiece's ``▁</tool>``).

The scan is linear in the turn's length: the text grows token by token as vLLM's incremental detokenizer grows
it, decoding a small window of tokens around each new one (the window's first tokens give the context a
leading-space marker or a multi-byte character needs), never every prefix; a stop text is looked for in the new
text and the few characters before it.

**Early stopping** (``stop_sequences``): the engine is handed the token sequences a stop text is written as, to stop
as soon as one is drawn (``SamplingParams.stop_sequences``): the stop text tokenized on its own, and tokenized
after a few context characters (a tokenizer with a leading-space marker writes ``</tool>`` mid-text as different
ids than at the start; a byte-level one may merge the space before it into its first token), and a stop text that
is one added token gives that token's id. Every sequence is the shortest run of final tokens whose text holds its
stop text, so when an engine stops at one, the text rule's cut is at that token or before it, never after; the
rollout then cuts at the rule's token. The kept tokens are the same whether the engine stopped early, stopped
later or never: the tokens up to the cut were drawn the same way in every case. A tokenization not listed (a
context not tried) only means the engine goes on past the stop text, and the rollout cuts there afterwards.
"""

from __future__ import annotations

from typing import Any

# Characters a stop text is tokenized after, besides on its own: its in-text tokenizations.
_CONTEXTS = ("x", "a ", " ", "\n", ".", "1")


def decode(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids`` as the stop rule reads it: special tokens kept, no clean-up of spaces."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def find_stop(ids: list[int], stop_texts: tuple[str, ...], tokenizer: Any) -> tuple[int, bool]:
    """``(cut, found)``: the length of the shortest prefix of ``ids`` whose text holds a stop text, and whether one
    does (``(len(ids), False)`` when none does). Linear in ``len(ids)``: see the module docstring. Many turns with
    the same tokenizer: ``StopScanner``, which decodes each window once."""
    return StopScanner(stop_texts, tokenizer).find(ids)


class StopScanner:
    """``find_stop`` for many turns (a rollout's): the same cuts, each distinct window of tokens decoded once.

    Why: the scan decodes a window of one or two tokens per token of a turn, one Python call into the tokenizer
    each (~5-10 µs), and a rollout's turns repeat the same windows over and over (digits, a tool call's tags): on
    the calculator demo that was ~0.07 s of a round. A window's text is a function of its ids alone, so it is kept
    (up to ``max_windows`` distinct windows; past that, new ones are decoded every time). Keep a scanner for one
    tokenizer only; it holds no state between ``find`` calls besides those texts.
    """

    def __init__(self, stop_texts: tuple[str, ...], tokenizer: Any, max_windows: int = 1 << 16) -> None:
        """
        Args:
            stop_texts: the environment's stop texts (empty ones are ignored).
            tokenizer: the tokenizer whose ``decode`` gives a window's text (special tokens kept).
            max_windows: how many distinct windows' texts are kept at most.
        """
        self.stop_texts = tuple(s for s in stop_texts if s)
        self.tokenizer, self.max_windows = tokenizer, max_windows
        # Characters of the text before a new token that a stop text may span.
        self._keep = max((len(s) for s in self.stop_texts), default=1) - 1
        self._texts: dict[tuple[int, ...], str] = {}

    def text(self, ids: list[int]) -> str:
        """``decode(tokenizer, ids)``, from the kept texts when this window was decoded before."""
        key = tuple(ids)
        text = self._texts.get(key)
        if text is None:
            text = decode(self.tokenizer, list(key))
            if len(self._texts) < self.max_windows:
                self._texts[key] = text
        return text

    def find(self, ids: list[int]) -> tuple[int, bool]:
        """``find_stop(ids, stop_texts, tokenizer)``."""
        stop_texts = self.stop_texts
        if not stop_texts or not ids:
            return len(ids), False
        keep = self._keep
        recent = ""  # the last `keep` characters of the text of ids[:read]
        prefix, read = 0, 0  # ids[prefix:read]: the context window before the next token, its text already counted
        prefix_text = ""
        for k in range(len(ids)):
            window = self.text(ids[prefix : k + 1])
            new = window[len(prefix_text) :]
            # An unfinished multi-byte character (trailing U+FFFD) waits for the next token before the text grows;
            # the stop texts are still looked for in the text as the whole prefix decodes now.
            joined = recent + new
            if any(s in joined for s in stop_texts):
                return k + 1, True
            if len(window) > len(prefix_text) and not window.endswith("\ufffd"):
                recent = joined[max(0, len(joined) - keep) :]
                prefix, read = read, k + 1
                prefix_text = self.text(ids[prefix:read])
        return len(ids), False


def stop_sequences(stop_texts: tuple[str, ...], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The token sequences an engine stops at for ``stop_texts`` (deduplicated): see the module docstring."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    sequences: list[tuple[int, ...]] = []
    for text in (s for s in stop_texts if s):
        if text in added:  # one added (often special) token: its id, however the text alone tokenizes
            sequences.append((int(added[text]),))
        for context in ("", *_CONTEXTS):
            ids = tokenizer(context + text, add_special_tokens=False)["input_ids"]
            # The shortest run of final tokens whose text holds the stop text: the context's own tokens dropped, a
            # token that merged the context's end with the stop text's start (byte-level " </") kept.
            start = next((j for j in range(len(ids) - 1, -1, -1) if text in decode(tokenizer, ids[j:])), None)
            if start is not None:
                sequences.append(tuple(ids[start:]))
    return tuple(dict.fromkeys(sequences))
