"""Answer forms for ``math_accuracy``'s builtin backend: a canonical string, and answers made of several parts.

* :func:`normalize` drops what does not change the answer: ``$``, LaTeX spacing, ``\\left``/``\\right``, units
  (with their exponents: ``15\\mbox{ cm}^2`` is ``15``), degrees, a leading ``x =`` or ``x \\in``, thousands
  separators (also ``11,\\! 111``).
* :func:`compare_structured` compares answers that have parts, given the comparison to use for the parts:
  matrices (entry by entry, same shape), numbers in another base (``52_8``), unions of intervals (any order),
  ``a \\pm b`` (the two values, any order), lists and sets (any order) and tuples and intervals (in order).

The policy behind these choices is written down in ``docs/rewards.md`` ("What an answer's form implies").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from grpo_lightning.rewards.math_extract import last_boxed

ROW = "\ue000"  # LaTeX's row break ``\\`` once normalised (private use: not whitespace, which is collapsed)
MAX_PARTS = 100  # a list, union or matrix with more parts than this is not compared (and not rewarded)

_DROP = (r"\left", r"\right", r"\displaystyle")
_SPACING = (r"\!", r"\,", r"\;", r"\:", r"\qquad", r"\quad", "\\ ", "~")  # a space, not nothing: "3\quad 4" is not 34
# Spacing between digits before a group of three: a thousands separator (1\,000, 1\ 000, 12 500).
_SPACED_THOUSANDS = re.compile(r"(?<=\d)(?:\\[,!;: ]|~|\\q?quad|\s)+(?=\d{3}(?!\d))")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
# A unit in \text{} / \mbox{} goes with its exponent: "15\mbox{ cm}^2" is 15, never 15^2. Only a unit that ends the
# answer or one of its parts: "2\text{ hours }30\text{ minutes}" is not 230.
_TEXT_UNIT = re.compile(_TEXT_CMD.pattern + r"(?:\s*\^\s*(?:\{[^{}]*\}|\\circ|\w))?(?=\s*(?:$|[,;)\]}]|\\\}|\\cup))")
# "3 \text{ or } 5", "x = 1 \text{ and } x = 2": a list of answers.
_CONNECTIVE = re.compile(r"\\(?:text|textrm|mbox|mathrm)\s*\{\s*(?:or|and)\s*\}|\s+(?:or|and)\s+")
_UNICODE = {
    "−": "-", "–": "-", "×": r"\times", "÷": "/", "·": r"\cdot", "∞": r"\infty", "π": r"\pi", "√": r"\sqrt",
    "∪": r"\cup", "±": r"\pm", "∓": r"\mp", "²": "^2", "³": "^3", "∈": r"\in",
}  # fmt: skip
# "x =", "x_1 =", "\mathbf{v} =", "x \in" before the answer: a label, not part of it.
_LABEL = re.compile(r"^\s*(?:[a-zA-Z]|\\mathbf\{[a-zA-Z]\}|\\vec\{[a-zA-Z]\})(?:_\{?\w+\}?)?\s*(=|\\in(?![a-zA-Z]))")
# "18 dollars", "5 cm", "864 inches^2": words after a number (one-letter words only when they are common units).
_PLAIN_UNIT = re.compile(r"(-?[\d.,]*\d%?)((?:\s+(?:[a-zA-Z]{2,}|[mgsLh])\.?(?:\s*\^\s*\{?\d\}?)?)+)")
_MATRIX = re.compile(r"\\begin\{([pbBvV]?|small)matrix\}(.*)\\end\{\1matrix\}", re.DOTALL)
# Digits in a base: upper-case letters, or lower-case with a digit among them (a3_{16}; a_{12} is a variable).
_DIGITS = r"(?:[0-9A-Z]+|(?=[a-z]*\d)[0-9a-z]+)"  # (linear: no nested choice of where the digit is)
_BASE = re.compile(rf"\(?({_DIGITS})\)?_\{{?(\d+)\}}?")


def strip_label(s: str) -> str:
    """``s`` without a leading ``x =`` / ``x \\in`` (one letter, maybe subscripted or bold) when it has one."""
    match = _LABEL.match(s)
    if not match or (match.group(1) == "=" and s.count("=") != 1) or (match.group(1) != "=" and "=" in s):
        return s
    rest = s[match.end() :].strip()
    letter = re.search(r"[a-zA-Z](?=\}?\s*(?:_|=|\\in))", match.group(0)).group(0)
    if re.search(rf"(?<![\\a-zA-Z]){letter}(?![a-zA-Z])", rest):
        return s  # "x = 2x + 3" is an equation in x, not a label
    return rest


def label_of(s: str) -> str | None:
    """The letter of the label that :func:`strip_label` would remove (``x`` for ``x_1 = 3``), else None."""
    if strip_label(s) == s:
        return None
    return re.search(r"[a-zA-Z](?=\}?\s*(?:_|=|\\in))", _LABEL.match(s).group(0)).group(0)


@functools.lru_cache(maxsize=8192)  # a reference is normalised once for all the completions of its prompt
def normalize(answer: str, keep_label: bool = False) -> str:
    """A canonical string for an answer: delimiters, ``$``, spacing, units, degrees, labels and ``\\text`` removed.

    ``keep_label=True`` keeps a leading ``x =`` / ``x \\in`` (for two answers labelled with different letters).
    """

    def unlabel(x: str) -> str:
        return x if keep_label else strip_label(x)

    s = answer.strip()
    boxed = last_boxed(s)
    s = boxed if boxed is not None else s
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    s = re.sub(r"(\d),\\!\s*(?=\d{3}(?!\d))", r"\1,", s)  # 11,\! 111,\! 100: thousands separators
    s = s.replace("\\\\", ROW)
    s = _SPACED_THOUSANDS.sub("", s)
    for token in _DROP:
        s = s.replace(token, "")
    for token in _SPACING:
        s = s.replace(token, " ")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|°|\bdegrees?\b", "", s)
    s = s.replace("\\%", "%").replace("\\$", "").replace("$", "").replace("{,}", ",")
    s = unlabel(re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s.strip()))
    without = _TEXT_UNIT.sub(" ", s)
    s = _TEXT_CMD.sub(lambda m: m.group(1), without if re.search(r"\d", without) else s)
    s = re.sub(r"\s+", " ", s).strip().removesuffix(".").strip()
    s = unlabel(_CONNECTIVE.sub(", ", s) if re.search(r"\d", s) else s)
    unit = _PLAIN_UNIT.fullmatch(s)
    if unit and not re.search(r"\\", s):
        s = unit.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?", s):
        s = s.replace(",", "")  # thousands separators
    letter = re.fullmatch(r"\(?([A-Ea-e])\)", s)
    return letter.group(1) if letter else s.strip()


def split_top_level(s: str, separator: str = ",") -> list[str]:
    """The parts of ``s`` between top-level ``separator`` (outside any bracket), stripped."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        char = s[i]
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth == 0 and s.startswith(separator, i):
            parts.append(s[start:i].strip())
            i = start = i + len(separator)
            continue
        i += 1
    parts.append(s[start:].strip())
    return parts


def _enclosed(s: str) -> bool:
    """Whether the bracket that opens ``s`` is the one that closes it: ``(1, 2)``, not ``(0,1) \\cup (2,3)``."""
    if len(s) < 2 or s[0] not in "([{" or s[-1] not in ")]}":
        return False
    depth = 0
    for char in s[:-1]:
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth <= 0:
            return False
    return True


def split_items(s: str) -> tuple[str, list[str]] | None:
    """``(brackets, items)`` for ``(a, b)``, ``[a, b)``, ``\\{a, b\\}`` or a bare ``a, b``; None for one item.

    Items that all carry the same label (``x = 3, x = 5``) lose it; different labels (``a = 2, b = 3``) stay.
    """
    s = s.replace("\\{", "{").replace("\\}", "}")
    brackets = ""
    if _enclosed(s):
        brackets, s = s[0] + s[-1], s[1:-1]
    items = split_top_level(s)
    if len(items) < 2:
        return None
    labels = {match.group(0).replace(" ", "") if (match := _LABEL.match(item)) else None for item in items}
    if len(labels) == 1 and None not in labels:  # "x = 3, x = 5": one unknown's values; "a = 2, b = 3" keeps its labels
        items = [strip_label(item) for item in items]
    return brackets, items


def _matrix(s: str) -> tuple[str, list[list[str]]] | None:
    match = _MATRIX.fullmatch(s.strip())
    if not match:
        return None
    rows = match.group(2).split(ROW)
    if len(rows) > 1 and not rows[-1].strip():
        rows.pop()  # a trailing \\ before \end
    kind = "determinant" if match.group(1) in ("v", "V") else "matrix"  # pmatrix, bmatrix, matrix: the same
    return kind, [[entry.strip() for entry in row.split("&")] for row in rows]


def _base_number(s: str) -> tuple[int, int] | None:
    """``(value, base)`` for ``52_8``, ``52_{8}``, ``(52)_8``, ``A3_{16}``; None for anything else."""
    match = _BASE.fullmatch(re.sub(r"\s+", "", s))
    if not match or not 2 <= int(match.group(2)) <= 36:
        return None
    try:
        return int(match.group(1), int(match.group(2))), int(match.group(2))
    except ValueError:
        return None


def _expand_pm(s: str) -> str | None:
    """``a \\pm b`` as the list ``a + b, a - b`` (``\\mp`` takes the other sign); None without a ``\\pm``."""
    if "\\pm" not in s and "\\mp" not in s:
        return None
    items = split_items(s)
    if items is not None and items[0] not in ("", "{}"):
        return None  # inside a tuple or an interval: no reading of it is safe
    values = []
    for item in items[1] if items else [s]:
        for sign, other in (("+", "-"), ("-", "+")):
            value = item.replace("\\pm", sign).replace("\\mp", other).strip()
            values.append(value[1:].strip() if value.startswith("+") else value)
    return ", ".join(values)


def _match_unordered(left: list[str], right: list[str], same: Callable[[str, str], bool]) -> bool:
    if len(left) != len(right) or len(left) > MAX_PARTS:
        return False
    unused = list(right)
    for item in left:
        match = next((x for x in unused if same(item, x)), None)
        if match is None:
            return False
        unused.remove(match)
    return True


def compare_structured(p: str, r: str, same: Callable[[str, str], bool]) -> bool | None:
    """Whether normalised answers ``p`` and ``r`` are equal when either has parts; None when neither has.

    ``same`` compares two parts (normalised strings). Matrices need the same shape and equal entries;
    a number in base ``b`` (``52_8``) matches the same digits in base ``b`` (``52`` or ``52_{8}``), never a
    number in another base; unions of intervals, lists, sets and ``a \\pm b`` match in any order; tuples and
    intervals need the same brackets and equal items in order.
    """
    p_matrix, r_matrix = _matrix(p), _matrix(r)
    if p_matrix or r_matrix:
        if not (p_matrix and r_matrix) or p_matrix[0] != r_matrix[0]:
            return False
        p_rows, r_rows = p_matrix[1], r_matrix[1]
        shape = [len(row) for row in p_rows]
        if shape != [len(row) for row in r_rows] or sum(shape) > MAX_PARTS:
            return False
        return all(same(a, b) for p_row, r_row in zip(p_rows, r_rows) for a, b in zip(p_row, r_row))
    p_base, r_base = _base_number(p), _base_number(r)
    if p_base and p_base[1] == 10 and not r_base:
        return same(str(p_base[0]), r)  # 42_{10} is the decimal 42
    if p_base or r_base:
        if r_base is None:
            return False  # the reference is not written in a base: a based number is another answer
        if p_base is None:
            digits = re.sub(r"\s+", "", p)
            try:
                p_base = (int(digits, r_base[1]), r_base[1]) if re.fullmatch(_DIGITS, digits) else None
            except ValueError:
                return False  # a digit the base does not have
        return p_base == r_base
    p_union, r_union = split_top_level(p, "\\cup"), split_top_level(r, "\\cup")
    if len(p_union) > 1 or len(r_union) > 1:
        return _match_unordered(p_union, r_union, same)
    p_pm, r_pm = _expand_pm(p), _expand_pm(r)
    if p_pm is not None or r_pm is not None:
        return same(p_pm if p_pm is not None else p, r_pm if r_pm is not None else r)
    p_items, r_items = split_items(p), split_items(r)
    if not (p_items or r_items):
        return None
    if not (p_items and r_items):
        return False
    unordered = {"", "{}"}
    if p_items[0] in unordered and r_items[0] in unordered:  # bare lists and sets: order does not matter
        return _match_unordered(p_items[1], r_items[1], same)
    if p_items[0] != r_items[0] or len(p_items[1]) != len(r_items[1]) or len(p_items[1]) > MAX_PARTS:
        return False
    return all(same(a, b) for a, b in zip(p_items[1], r_items[1], strict=True))
