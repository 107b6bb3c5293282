"""Finding the final answer in a completion or a reference (used by ``math_accuracy`` with every backend).

``<answer>…</answer>``, ``\\boxed{…}`` / ``\\fbox{…}`` (nested braces, ``\\boxed 5``), GSM8K's ``#### 42``,
"The answer is …", and, only when asked, the last number. When several are present the last one counts.
"""

from __future__ import annotations

import re

DEFAULT_MODES = ("answer_tag", "boxed", "hashes", "answer_is")

_OPEN_TAG, _CLOSE_TAG = re.compile("<answer>", re.IGNORECASE), re.compile("</answer>", re.IGNORECASE)
_HASHES = re.compile(r"####[ \t]*([^\n]+)")
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\s*:?|:|=)", re.IGNORECASE)
_BRACE = re.compile(r"[{}]")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def read_group(s: str, i: int) -> tuple[str, int]:
    """The argument of a LaTeX command at ``s[i]`` and the index after it: a braced group or a single character."""
    while s[i : i + 1] == " ":
        i += 1
    if s[i : i + 1] != "{":
        if i >= len(s):
            raise ValueError("missing argument")
        return s[i], i + 1
    depth = 0
    for brace in _BRACE.finditer(s, i):  # only the braces are visited: linear in them, not in the text
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return s[i + 1 : brace.start()], brace.end()
    raise ValueError("unbalanced braces")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` or ``\\fbox{…}`` (nested braces kept), or of ``\\boxed 5``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if text[i : i + 1] == "{":
        try:
            return read_group(text, i)[0].strip()
        except ValueError:
            return None  # unbalanced: the completion was cut off
    match = re.match(r"\s+([^\s$]+)", text[i:])
    return match.group(1) if match else None


def _answer_is(text: str) -> str | None:
    markers = list(_ANSWER_IS.finditer(text))
    if not markers:
        return None
    rest = text[markers[-1].end() :].split("\n", 1)[0]
    rest = re.split(r"\.\s", rest, maxsplit=1)[0].strip(" *:$")
    return rest.removesuffix(".").strip(" *$") or None


def _from_tag(text: str) -> str | None:
    # The last <answer> that a </answer> closes, found in linear time: a lazy "<answer>(.*?)</answer>" scans to the
    # end of the text from every unclosed tag (a completion repeating "<answer>" took seconds, outside any limit).
    closes = list(_CLOSE_TAG.finditer(text))
    opens = list(_OPEN_TAG.finditer(text, 0, closes[-1].start())) if closes else []
    if not opens:
        return None
    tag = text[opens[-1].end() : _CLOSE_TAG.search(text, opens[-1].end()).start()]
    return last_boxed(tag) or tag.strip()


def _from_hashes(text: str) -> str | None:
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else None


_EXTRACTORS = {"answer_tag": _from_tag, "boxed": last_boxed, "hashes": _from_hashes, "answer_is": _answer_is}


def check_modes(modes: tuple[str, ...] | list[str]) -> None:
    """Raise ``ValueError`` naming the valid modes when ``modes`` holds an unknown extraction mode."""
    for mode in modes:
        if mode not in _EXTRACTORS:
            raise ValueError(f"unknown extraction mode {mode!r}; use some of {', '.join(DEFAULT_MODES)}")


def extract_answer(text: str, modes: tuple[str, ...] = DEFAULT_MODES, last_number: bool = False) -> str | None:
    """The final answer written in ``text``, or ``None`` when it has none.

    ``modes`` are tried in order: ``answer_tag`` (the last ``<answer>…</answer>``; a ``\\boxed`` inside it wins),
    ``boxed``, ``hashes`` (``#### 42``) and ``answer_is`` ("The final answer is $5$."). ``last_number=True`` adds
    the last number of the text as a final fallback (off by default: it rewards rambling).
    """
    if not isinstance(text, str):
        return None
    check_modes(modes)
    for mode in modes:
        found = _EXTRACTORS[mode](text)
        if found:
            return found
    if last_number:
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return None


def reference_answer(reference: object) -> str | None:
    """The answer in a reference: after ``####`` or in ``\\boxed{}`` when present, else the whole text."""
    if reference is None:
        return None
    text = str(reference).strip()
    return extract_answer(text, modes=("hashes", "boxed")) or text or None
