"""Math accuracy: pull the final answer out of a completion and check it against the reference by equivalence.

Two pure helpers do the work:

* :func:`extract_answer` (``math_extract``) finds the final answer in free text: ``<answer>…</answer>``,
  ``\\boxed{…}`` / ``\\fbox{…}``, GSM8K's ``#### 42``, "The answer is …", and, only when asked, the last number.
* :func:`is_equivalent` decides whether two answers are the same mathematical object: numbers with thousands
  separators, decimals, fractions (``a/b``, ``\\frac``, ``\\dfrac``, mixed ``1\\frac{1}{2}``), percentages, units,
  ``$`` and LaTeX spacing stripped (``math_forms.normalize``), matrices, unions, ``\\pm``, numbers in another base,
  tuples / intervals / sets (``math_forms.compare_structured``), equations, and symbolic expressions checked by
  sympy under a time limit that really stops it (SIGALRM in the main thread, a worker process elsewhere).

``math_accuracy(backend=...)`` can also judge with Hugging Face's ``math-verify`` (``math_backends``).
Model output never reaches ``eval``: LaTeX is turned into tokens from a small whitelist before sympy parses it.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from fractions import Fraction
from typing import Any

from grpo_lightning.rewards import register
from grpo_lightning.rewards.combine import TimeLimitExceeded, alarm_available, time_limit
from grpo_lightning.rewards.inputs import Completion, completion_texts
from grpo_lightning.rewards.math_backends import Worker, check_math_kwargs, math_verify_equivalent, stop_worker
from grpo_lightning.rewards.math_extract import DEFAULT_MODES, extract_answer, last_boxed, reference_answer
from grpo_lightning.rewards.math_extract import read_group as _read_group
from grpo_lightning.rewards.math_forms import compare_structured, label_of, normalize

__all__ = [
    "DEFAULT_MODES", "clear_caches", "extract_answer", "is_equivalent", "last_boxed", "latex_to_expression",
    "math_accuracy", "normalize", "reference_answer", "to_number",
]  # fmt: skip


def _compact(s: str) -> str:
    """``s`` without whitespace, words lower-cased; a space between two digits stays ("3 4" is not 34), and so does
    the case of single letters and of commands (``X`` is not ``x``, ``E`` not ``e``, ``\\Pi`` not ``\\pi``)."""
    s = re.sub(r"(?<=\d) (?=\d)", "\ue001", re.sub(r"\s+", " ", s)).replace(" ", "")
    return re.sub(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}", lambda m: m.group(0).lower(), s)


_SIGNED = r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


def to_number(s: str) -> tuple[Fraction, bool] | None:
    """``(value, is_percent)`` for a plain number, ``a/b``, ``\\frac{a}{b}`` or mixed ``1\\frac{1}{2}``; else None."""
    if re.search(r"\d\s+\d", s):
        return None  # "3 4": two numbers, not 34
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


# ------------------------------------------------------------------------------------------ sympy (guarded)
_LATEX_WORDS = dict(
    pair.split("=")
    for pair in r"\cdot=* \times=* \ast=* \div=/ \pi=pi \infty=oo \ln=log \log=log \exp=exp \sin=sin \cos=cos "
    r"\tan=tan \arcsin=asin \arccos=acos \arctan=atan".split()
)
_TOKEN = re.compile(r"\s*(\d+\.?\d*|\.\d+|[A-Za-z]+\d*|\*\*|[-+*/^(),])")


def _is_number(token: str) -> bool:
    return token[0].isdigit() or token[0] == "."


def latex_to_expression(s: str) -> str:
    """A sympy-parsable string for a LaTeX / plain-text expression; ``ValueError`` for anything outside the
    whitelist (numbers, one-letter symbols, + - * / ^ and parentheses, a few functions and constants)."""
    s = re.sub(r"_\{?(\w+)\}?", r"\1", s)  # x_{1} -> x1
    for word, repl in _LATEX_WORDS.items():
        s = s.replace(word, f" {repl} ")
    for command, template in ((r"\frac", "(({0})/({1}))"), (r"\binom", " binomial({0},{1})"), (r"\sqrt", "")):
        while (i := s.rfind(command)) >= 0:  # the last first: its arguments hold no other, so each is read once
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
            if out and _is_number(out[-1]) and _is_number(piece):
                raise ValueError(f"two numbers side by side: {out[-1]} {piece}")  # "3 4" is neither 34 nor 12
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
    if any(x.has(sympy.oo, sympy.zoo, sympy.nan) for x in (left, right)):
        return sympy.simplify(left) == sympy.simplify(right)  # oo - oo is nan: infinities compare by form
    difference = sympy.simplify(left - right)
    if difference == 0:
        return True
    if difference.free_symbols or left.free_symbols or right.free_symbols:
        return False
    # Equal values that simplify cannot prove equal (nested radicals...): the same to 12 significant digits, in
    # sympy's arbitrary-range floats (10^{-9999} is not 0), relative to the values: no absolute slack near 0.
    l, r, d = (sympy.N(x, 30) for x in (left, right, difference))
    if not all(x.is_finite for x in (l, r, d)):
        return False
    return bool(abs(d) <= sympy.Float("1e-12", 30) * sympy.Max(abs(l), abs(r)))
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


# Off the main thread: the same check in a long-lived worker process, killed (and restarted at once) when a check
# overruns its limit.
_WORKER = Worker(_SYMPY_CHECK, "sympy")


def _worker_check(a: str, b: str, timeout_s: float) -> bool:
    """Sympy equality in the worker process: False when it does not answer within ``timeout_s``."""
    return _WORKER.ask([a, b], timeout_s) is True


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
_BUDGET = threading.local()  # .deadline: time.monotonic() at which the check running in this thread must stop


def _time_left() -> float:
    deadline = getattr(_BUDGET, "deadline", None)
    return float("inf") if deadline is None else deadline - time.monotonic()


MAX_ANSWER_CHARS = 2000  # a longer answer (or reference) is compared as text only: it is not parsed


def is_equivalent(pred: str | None, ref: str | None, timeout_s: float = 2.0) -> bool:
    """Whether two extracted answers denote the same value (see the module docstring for what is understood).

    ``timeout_s`` bounds the whole check: each sympy call gets what is left of it, and whatever is still to be
    compared once it is spent counts as different. In the main thread the whole check, parsing included, is also
    interrupted at ``timeout_s`` (SIGALRM); elsewhere the parsing done in this process is linear in the answer,
    which is at most ``MAX_ANSWER_CHARS`` long (longer ones only match the same text).
    """
    if pred is None or ref is None or not str(pred).strip() or not str(ref).strip():
        return False
    pred, ref = str(pred), str(ref)
    if max(len(pred), len(ref)) > MAX_ANSWER_CHARS:
        return _compact(pred) == _compact(ref)
    outer = getattr(_BUDGET, "deadline", None)
    _BUDGET.deadline = time.monotonic() + timeout_s
    try:
        with time_limit(timeout_s) as token:
            return _check(pred, ref, timeout_s)
    except TimeLimitExceeded as err:
        if token is None or err.token is not token:
            raise  # an enclosing limit (e.g. score(timeout_s=...)) ran out
        return False
    except RecursionError:  # (1,(1,(1,... nested hundreds deep
        return False
    finally:
        _BUDGET.deadline = outer


# A label needs one of these (normalize reads ∈ as \in); without any, the labelled forms are the plain ones and
# the common case is spared two normalisations.
_LABEL_SIGNS = ("=", "\\in", "∈")


def _check(pred: str, ref: str, timeout_s: float) -> bool:
    plain = normalize(pred), normalize(ref)
    if not any(sign in x for x in (pred, ref) for sign in _LABEL_SIGNS):
        return _equivalent(*plain, timeout_s)
    labelled = normalize(pred, keep_label=True), normalize(ref, keep_label=True)
    if None not in (labels := [label_of(x) for x in labelled]) and labels[0] != labels[1]:
        return _equivalent(*labelled, timeout_s)  # "y = 3" is not "x = 3": both labels must be the same letter
    # With the label kept, "y = 2x + 3" is also the equation "2x + 3 = y" or "y - 2x - 3 = 0".
    return _equivalent(*plain, timeout_s) or (labelled != plain and _equivalent(*labelled, timeout_s))


def _sympy_within_budget(p: str, r: str, timeout_s: float) -> bool:
    left = min(timeout_s, _time_left())
    if left <= 0:
        return False
    try:
        a, b = (latex_to_expression(x.replace("%", "/100")) for x in (p, r))
        return _sympy_equal_limited(a, b, left)
    except Exception:  # outside the whitelist, or sympy cannot parse / compare it: not equivalent
        return False


@functools.lru_cache(maxsize=8192)
def _equivalent(p: str, r: str, timeout_s: float) -> bool:
    if _compact(p) == _compact(r):
        return True
    pn, rn = to_number(p), to_number(r)
    if pn is not None and rn is not None:
        if pn[1] == rn[1]:
            return pn[0] == rn[0]  # both percentages, or neither: 0.75% is not 75%
        percent, other = (pn[0], rn[0]) if pn[1] else (rn[0], pn[0])
        return other in (percent, percent / 100)  # 25% matches 25 and 0.25

    def same(a: str, b: str) -> bool:
        return _time_left() > 0 and _equivalent(a, b, timeout_s)

    structured = compare_structured(p, r, same)
    if structured is not None:
        return structured
    if p.count("=") == 1 and r.count("=") == 1:
        (pl, pr), (rl, rr) = p.split("="), r.split("=")
        if same(pl, rl) and same(pr, rr):
            return True
        # The same equation with terms moved (or its sides swapped): equal differences of the two sides.
        moved = f"({pl})-({pr})"
        return any(_sympy_within_budget(moved, other, timeout_s) for other in (f"({rl})-({rr})", f"({rr})-({rl})"))
    return _sympy_within_budget(p, r, timeout_s)


def clear_caches() -> None:
    """Forget every cached verdict and normalised answer, stop the worker processes (benchmarks start cold)."""
    _equivalent.cache_clear()
    normalize.cache_clear()
    _WORKER.stop()
    stop_worker()


def _judge(pred: str | None, ref: str, backend: str, timeout_s: float) -> bool:
    if pred is None or not pred.strip():
        return False
    if max(len(pred), len(ref)) > MAX_ANSWER_CHARS:
        return _compact(pred) == _compact(ref)  # too long to parse, for every backend
    if backend != "math_verify" and is_equivalent(pred, ref, timeout_s):
        return True
    return backend != "builtin" and math_verify_equivalent(pred, ref, timeout_s)


@register("math_accuracy")
def math_accuracy(
    prompts: list[str],
    completions: list[Completion],
    answer: list,
    *,
    modes: tuple[str, ...] | list[str] = DEFAULT_MODES,
    last_number: bool = False,
    timeout_s: float = 2.0,
    backend: str = "builtin",
    **_: object,
) -> list[float | None]:
    """1.0 when the completion's final answer is mathematically equivalent to the reference, else 0.0.

    The answer is found by :func:`extract_answer` (``modes``, ``last_number``); the reference is the ``answer``
    column (a bare answer, a GSM8K solution ending in ``#### N`` or a MATH solution with ``\\boxed{}``). A row whose
    reference is missing gives None. ``backend`` judges equivalence: ``builtin`` (:func:`is_equivalent`),
    ``math_verify`` (Hugging Face's math-verify, the ``math`` extra) or ``either`` (1.0 when one of them accepts).
    ``timeout_s`` bounds each check (per backend).
    """
    completions = completion_texts(completions)  # a conversation's completions are message lists
    check_math_kwargs(modes=modes, backend=backend)
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        ref = reference_answer(reference)
        pred = extract_answer(completion, tuple(modes), last_number) if ref is not None else None
        scores.append(None if ref is None else float(_judge(pred, ref, backend, timeout_s)))
    return scores


math_accuracy.required_columns = ("answer",)
math_accuracy.check_kwargs = check_math_kwargs  # RewardSpec.build calls it: a bad backend is refused before training
