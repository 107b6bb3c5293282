"""Math accuracy: pull the final answer out of a completion and check it against the reference by equivalence.

Two pure helpers do the work:

* :func:`extract_answer` finds the final answer in free text: ``<answer>…</answer>``, ``\\boxed{…}`` / ``\\fbox{…}``
  (nested braces, ``\\boxed 5``), GSM8K's ``#### 42``, "The answer is …", and, only when asked, the last number.
* :func:`is_equivalent` decides whether two answers are the same mathematical object: numbers with thousands
  separators, decimals, fractions (``a/b``, ``\\frac``, ``\\dfrac``, mixed ``1\\frac{1}{2}``), percentages, units,
  ``$`` and LaTeX spacing stripped, tuples / intervals / sets element-wise, and symbolic expressions checked by
  sympy under a time limit that really stops it (SIGALRM in the main thread, a worker process elsewhere).

Model output never reaches ``eval``: LaTeX is turned into tokens from a small whitelist before sympy parses it.
"""

from __future__ import annotations

import functools
import json
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from subprocess import DEVNULL, PIPE
from typing import Any

from grpo_lightning.rewards import register
from grpo_lightning.rewards.combine import TimeLimitExceeded, alarm_available, time_limit

DEFAULT_MODES = ("answer_tag", "boxed", "hashes", "answer_is")

# ------------------------------------------------------------------------------------------------ extraction
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####[ \t]*([^\n]+)")
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\s*:?|:|=)", re.IGNORECASE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` or ``\\fbox{…}`` (nested braces kept), or of ``\\boxed 5``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if text[i : i + 1] == "{":
        try:
            return _read_group(text, i)[0].strip()
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
    tags = _ANSWER_TAG.findall(text)
    return (last_boxed(tags[-1]) or tags[-1].strip()) if tags else None


def _from_hashes(text: str) -> str | None:
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else None


_EXTRACTORS = {"answer_tag": _from_tag, "boxed": last_boxed, "hashes": _from_hashes, "answer_is": _answer_is}


def extract_answer(text: str, modes: tuple[str, ...] = DEFAULT_MODES, last_number: bool = False) -> str | None:
    """The final answer written in ``text``, or ``None`` when it has none.

    ``modes`` are tried in order: ``answer_tag`` (the last ``<answer>…</answer>``; a ``\\boxed`` inside it wins),
    ``boxed``, ``hashes`` (``#### 42``) and ``answer_is`` ("The final answer is $5$."). ``last_number=True`` adds
    the last number of the text as a final fallback (off by default: it rewards rambling).
    """
    if not isinstance(text, str):
        return None
    for mode in modes:
        if mode not in _EXTRACTORS:
            raise ValueError(f"unknown extraction mode {mode!r}; use some of {', '.join(DEFAULT_MODES)}")
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


# --------------------------------------------------------------------------------------------- normalisation
_DROP = (r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad", "\\ ", "~")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNICODE = {"−": "-", "–": "-", "×": r"\times", "÷": "/", "·": r"\cdot", "∞": r"\infty", "π": r"\pi", "√": r"\sqrt"}


def normalize(answer: str) -> str:
    """A canonical string for an answer: delimiters, ``$``, spacing, units, degrees and ``\\text`` removed."""
    s = answer.strip()
    boxed = last_boxed(s)
    s = boxed if boxed is not None else s
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    for token in _DROP:
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|°|\bdegrees?\b", "", s)
    s = s.replace("\\%", "%").replace("\\$", "").replace("$", "").replace("{,}", ",")
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s.strip())
    texts = _TEXT_CMD.findall(s)
    without = _TEXT_CMD.sub(" ", s)
    s = without if texts and re.search(r"\d", without) else _TEXT_CMD.sub(lambda m: m.group(1), s)
    s = s.strip().removesuffix(".").strip()
    if s.count("=") == 1 and re.match(r"^\s*[a-zA-Z](?:_\{?\w+\}?)?\s*=", s):
        s = s.split("=", 1)[1].strip()  # "x = 5" -> "5"
    unit = re.fullmatch(r"(-?[\d.,]*\d%?)(?:\s+[a-zA-Z]+\.?)+", s)
    if unit and not re.search(r"\\", s):
        s = unit.group(1)  # "18 dollars", "5 cm"
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?", s):
        s = s.replace(",", "")  # thousands separators
    letter = re.fullmatch(r"\(?([A-Ea-e])\)", s)
    return letter.group(1) if letter else s.strip()


def _compact(s: str) -> str:
    return re.sub(r"\s+", "", s).lower()


_SIGNED = r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


def to_number(s: str) -> tuple[Fraction, bool] | None:
    """``(value, is_percent)`` for a plain number, ``a/b``, ``\\frac{a}{b}`` or mixed ``1\\frac{1}{2}``; else None."""
    s = re.sub(r"\s+", "", s)
    percent = s.endswith("%")
    s = s.removesuffix("%")
    try:
        if re.fullmatch(_SIGNED, s):
            return Fraction(s), percent
        if m := re.fullmatch(rf"({_SIGNED})/({_SIGNED})", s):
            return Fraction(m.group(1)) / Fraction(m.group(2)), percent
        if m := re.fullmatch(r"(-?)(\d*)\\frac\{?(-?\d+)\}?\{?(-?\d+)\}?", s):
            value = Fraction(int(m.group(3)), int(m.group(4))) + int(m.group(2) or 0)  # 1\frac{1}{2} = 1.5
            return (-value if m.group(1) else value), percent
    except (ZeroDivisionError, ValueError, OverflowError):
        return None
    return None


def _split_top_level(s: str) -> tuple[str, list[str]] | None:
    """``(brackets, items)`` for ``(a, b)``, ``[a, b)``, ``\\{a, b\\}`` or a bare ``a, b``; None for one item."""
    s = s.replace("\\{", "{").replace("\\}", "}")
    opening, closing = "", ""
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}":
        opening, closing, s = s[0], s[-1], s[1:-1]
    items, depth, current = [], 0, ""
    for char in s:
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    items.append(current.strip())
    return (opening + closing, items) if len(items) > 1 else None


# ------------------------------------------------------------------------------------------ sympy (guarded)
_LATEX_WORDS = dict(
    pair.split("=")
    for pair in r"\cdot=* \times=* \ast=* \div=/ \pi=pi \infty=oo \ln=log \log=log \exp=exp \sin=sin \cos=cos "
    r"\tan=tan \arcsin=asin \arccos=acos \arctan=atan".split()
)
_TOKEN = re.compile(r"\s*(\d+\.?\d*|\.\d+|[A-Za-z]+\d*|\*\*|[-+*/^(),])")


def _read_group(s: str, i: int) -> tuple[str, int]:
    """The argument of a LaTeX command at ``s[i]``: a braced group or a single character."""
    while s[i : i + 1] == " ":
        i += 1
    if s[i : i + 1] != "{":
        if i >= len(s):
            raise ValueError("missing argument")
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    raise ValueError("unbalanced braces")


def latex_to_expression(s: str) -> str:
    """A sympy-parsable string for a LaTeX / plain-text expression; ``ValueError`` for anything outside the
    whitelist (numbers, one-letter symbols, + - * / ^ and parentheses, a few functions and constants)."""
    s = re.sub(r"_\{?(\w+)\}?", r"\1", s)  # x_{1} -> x1
    for word, repl in _LATEX_WORDS.items():
        s = s.replace(word, f" {repl} ")
    for command, template in ((r"\frac", "(({0})/({1}))"), (r"\binom", " binomial({0},{1})"), (r"\sqrt", "")):
        while (i := s.find(command)) >= 0:
            j = i + len(command)
            if command == r"\sqrt":
                root = None
                if s[j : j + 1] == "[":
                    end = s.index("]", j)
                    root, j = s[j + 1 : end], end + 1
                arg, j = _read_group(s, j)
                new = f" sqrt({arg})" if root is None else f"(({arg})**(1/({root})))"
            else:
                first, j = _read_group(s, j)
                second, j = _read_group(s, j)
                new = template.format(first, second)
            s = s[:i] + new + s[j:]
    s = s.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")")
    tokens, pos = [], 0
    while pos < len(s.rstrip()):
        match = _TOKEN.match(s, pos)
        if not match:
            raise ValueError(f"unsupported character {s[pos : pos + 10]!r}")
        tokens.append(match.group(1))
        pos = match.end()
    out: list[str] = []
    for token in tokens:
        pieces = [token]
        if token[0].isalpha() and token not in _FUNCTIONS | _CONSTANTS:
            word = re.match(r"[A-Za-z]+", token).group(0)
            pieces = list(word[:-1]) + [token[len(word) - 1 :]] if len(word) > 1 else [token]
        for piece in pieces:
            operand_start = piece[0].isalnum() or piece[0] in ".("
            if out and operand_start and (out[-1][-1].isalnum() or out[-1] == ")") and out[-1] not in _FUNCTIONS:
                out.append("*")  # implicit multiplication: 2x, 2(x+1), (a)(b)
            out.append("**" if piece == "^" else piece)
    return " ".join(out)


# Symbolic comparison, in source form so that the same code also runs in a worker process (``python -c``, no
# package import) for threads that cannot use SIGALRM. Its input is whitelisted by latex_to_expression.
_SYMPY_CHECK = r"""
import json, re, resource, sys
FUNCTIONS = {"sqrt", "sin", "cos", "tan", "log", "exp", "asin", "acos", "atan", "binomial", "Abs"}
CONSTANTS = {"pi", "oo"}
def too_big(expr):
    import sympy
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and not node.exp.free_symbols and node.base.is_number:
            if too_big(node.exp) or abs(complex(sympy.N(node.exp, 15))) > 10000:
                return True  # a power tower or a huge power: its value would not fit in memory
        if isinstance(node, sympy.Integer) and abs(node) > 10**300:
            return True
    return False
def sympy_equal(a, b):
    import sympy
    from sympy.parsing.sympy_parser import parse_expr
    names = set(re.findall(r"[A-Za-z]\w*", a + " " + b)) - FUNCTIONS - CONSTANTS
    symbols = {name: sympy.Symbol(name) for name in names}  # E, I, N, S, O, Q stay plain symbols
    left, right = (parse_expr(x, local_dict=dict(symbols), evaluate=False) for x in (a, b))
    if too_big(left) or too_big(right):
        return False
    difference = sympy.simplify(left - right)
    if difference == 0:
        return True
    if difference.free_symbols or right.free_symbols:
        return False
    scale = max(1.0, abs(complex(sympy.N(right, 30))))
    return abs(complex(sympy.N(difference, 30))) <= 1e-9 * scale
if __name__ == "__main__":
    import sympy
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            ok = sympy_equal(*json.loads(line))
        except Exception:
            ok = False
        print(json.dumps(ok), flush=True)
"""
_CHECK: dict[str, Any] = {"__name__": "grpo_lightning_sympy_check"}
exec(compile(_SYMPY_CHECK, "<sympy_check>", "exec"), _CHECK)
_sympy_equal, _FUNCTIONS, _CONSTANTS = _CHECK["sympy_equal"], _CHECK["FUNCTIONS"], _CHECK["CONSTANTS"]


_WORKER: list[subprocess.Popen] = []  # the worker process, once started
_WORKER_LOCK = threading.Lock()


def _worker_check(a: str, b: str, timeout_s: float) -> bool:
    """Sympy equality in a long-lived worker process, killed (and restarted on next use) when a check overruns."""
    with _WORKER_LOCK:
        if not _WORKER or _WORKER[0].poll() is not None:
            command = [sys.executable, "-I", "-c", _SYMPY_CHECK]
            _WORKER[:] = [subprocess.Popen(command, stdin=PIPE, stdout=PIPE, stderr=DEVNULL, text=True)]
            _WORKER[0].stdout.readline()  # "ready": sympy is imported
        proc = _WORKER[0]
        proc.stdin.write(json.dumps([a, b]) + "\n")
        proc.stdin.flush()
        if select.select([proc.stdout], [], [], timeout_s)[0]:
            line = proc.stdout.readline()
            return bool(line) and json.loads(line) is True
        proc.kill()
        proc.wait()
        _WORKER.clear()
        return False


def _sympy_equal_limited(a: str, b: str, timeout_s: float) -> bool:
    """Sympy equality stopped after ``timeout_s``: SIGALRM in the main thread, else in the worker process."""
    if not alarm_available():
        return _worker_check(a, b, timeout_s)
    try:
        with time_limit(timeout_s) as token:
            return _sympy_equal(a, b)
    except TimeLimitExceeded as err:
        if token is None or err.token is not token:
            raise  # an enclosing limit (e.g. score(timeout_s=...)) ran out
        return False


# ------------------------------------------------------------------------------------------------- equivalence
def is_equivalent(pred: str | None, ref: str | None, timeout_s: float = 2.0) -> bool:
    """Whether two extracted answers denote the same value (see the module docstring for what is understood)."""
    if pred is None or ref is None or not str(pred).strip() or not str(ref).strip():
        return False
    return _equivalent(normalize(str(pred)), normalize(str(ref)), timeout_s)


@functools.lru_cache(maxsize=8192)
def _equivalent(p: str, r: str, timeout_s: float) -> bool:
    if _compact(p) == _compact(r):
        return True
    pn, rn = to_number(p), to_number(r)
    if pn is not None and rn is not None:
        p_values = {pn[0], pn[0] / 100} if pn[1] else {pn[0]}
        r_values = {rn[0], rn[0] / 100} if rn[1] else {rn[0]}
        return bool(p_values & r_values)
    p_items, r_items = _split_top_level(p), _split_top_level(r)
    if p_items or r_items:
        if not (p_items and r_items) or (p_items[0], len(p_items[1])) != (r_items[0], len(r_items[1])):
            return False
        if p_items[0] in ("", "{}"):  # bare lists and sets: order does not matter
            left = list(r_items[1])
            for item in p_items[1]:
                match = next((x for x in left if _equivalent(item, x, timeout_s)), None)
                if match is None:
                    return False
                left.remove(match)
            return True
        return all(_equivalent(a, b, timeout_s) for a, b in zip(p_items[1], r_items[1], strict=True))
    if p.count("=") == 1 and r.count("=") == 1:
        (pl, pr), (rl, rr) = p.split("="), r.split("=")
        return _equivalent(pl, rl, timeout_s) and _equivalent(pr, rr, timeout_s)
    try:
        a, b = (latex_to_expression(x.replace("%", "/100")) for x in (p, r))
        return _sympy_equal_limited(a, b, timeout_s)
    except Exception:  # outside the whitelist, or sympy cannot parse / compare it: not equivalent
        return False


@register("math_accuracy")
def math_accuracy(
    prompts: list[str],
    completions: list[str],
    answer: list,
    *,
    modes: tuple[str, ...] | list[str] = DEFAULT_MODES,
    last_number: bool = False,
    timeout_s: float = 2.0,
    **_: object,
) -> list[float | None]:
    """1.0 when the completion's final answer is mathematically equivalent to the reference, else 0.0.

    The answer is found by :func:`extract_answer` (``modes``, ``last_number``); the reference is the ``answer``
    column (a bare answer, a GSM8K solution ending in ``#### N`` or a MATH solution with ``\\boxed{}``). A row whose
    reference is missing gives None. ``timeout_s`` bounds each sympy check.
    """
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        ref = reference_answer(reference)
        pred = extract_answer(completion, tuple(modes), last_number) if ref is not None else None
        scores.append(None if ref is None else float(is_equivalent(pred, ref, timeout_s)))
    return scores


math_accuracy.required_columns = ("answer",)
