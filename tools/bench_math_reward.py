"""Compare ``math_accuracy``'s backends (builtin, math_verify, either) on model-like completions.

    python tools/bench_math_reward.py                          # GSM8K test set and the hand-written table
    python tools/bench_math_reward.py data/gsm8k.jsonl --math data/math_test.jsonl --limit 500 --show 5

Cases, each a completion with the verdict it should get:

* GSM8K (jsonl of ``question`` / ``answer``, the answer ending in ``#### N``; default
  ``../shared/data/gsm8k/test.jsonl`` relative to the repository root): each worked solution becomes four right
  completions (the R1 layout ``<think>…</think><answer>N</answer>``, ``\\boxed{N}``, "The final answer is N." and
  ``#### N`` with N rewritten: ``1,234``, ``\\$1234``, ``1234.00``) and three wrong ones (N + 1, 10 × N, and the
  answer of the next problem whose answer differs), all scored against the gold solution.
* MATH-style files (``--math``, repeatable; jsonl with ``problem``, ``solution`` and ``answer``, or the answer in the
  solution's last ``\\boxed{}``): the solution itself, the R1 layout with its answer and the answer rewritten in
  an equal form (right); another problem's answer (a different string), for a number N + 1 and -N, for a number
  with a unit and an exponent (``15\\mbox{ cm}^2``) the number raised to it, a point or interval with its items
  swapped, an "all solutions" list with one dropped, a matrix with an entry changed (wrong).
* the equivalence table of ``tests/rewards/test_rewards_math_forms.py`` (``--no-table`` leaves it out).

Every backend runs cold: cached verdicts forgotten, the math-verify worker restarted and warmed up on an unrelated
pair before the clock starts. Printed: a Markdown table of accuracy, false positives (wrong answers rewarded, out of
the wrong cases), false negatives (right answers not rewarded, out of the right cases) and seconds per 1,000 checks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo_lightning.rewards.math import clear_caches, last_boxed, math_accuracy, to_number  # noqa: E402
from grpo_lightning.rewards.math_forms import split_top_level  # noqa: E402

Case = tuple[str, str, float]  # (completion, reference, expected reward)


def read_jsonl(path: Path, limit: int | None) -> list[dict]:
    """The first ``limit`` rows (all when None) of a jsonl file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def _plain(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def gsm8k_cases(rows: list[dict]) -> list[Case]:
    """Right and wrong completions for every GSM8K row (see the module docstring)."""
    solutions = [row["answer"] for row in rows]
    finals = [s.rsplit("####", 1)[1].strip().replace(",", "") for s in solutions]
    cases: list[Case] = []
    for i, (solution, final) in enumerate(zip(solutions, finals, strict=True)):
        work = solution.rsplit("####", 1)[0].strip()
        value = Fraction(final)
        rewritten = [f"{value.numerator:,}" if value.denominator == 1 else final, f"\\${final}", f"{final}.00"][i % 3]
        other = next(finals[k % len(finals)] for k in range(i + 1, i + len(finals)) if finals[k % len(finals)] != final)
        cases += [
            (f"<think>{work}</think>\n<answer>{final}</answer>", solution, 1.0),
            (f"{work}\nSo the answer is $\\boxed{{{final}}}$.", solution, 1.0),
            (f"{work}\nThe final answer is {final}.", solution, 1.0),
            (f"{work}\n#### {rewritten}", solution, 1.0),
            (f"<think>{work}</think>\n<answer>{_plain(value + 1)}</answer>", solution, 0.0),
            (f"{work}\nSo the answer is $\\boxed{{{_plain(value * 10)}}}$.", solution, 0.0),
            (f"<think>{work}</think>\n<answer>{other}</answer>", solution, 0.0),
        ]
    return cases


_UNORDERED = re.compile(
    r"separated by commas|all (?:the )?(?:possible |real |complex )?(?:solutions|values|roots)", re.I
)


def _skeleton(answer: str) -> str:
    """``answer`` without spacing, ``$``, ``\\left``/``\\right``, ``\\text{}``, a final period or an ``x =`` label."""
    s = re.sub(r"\\(?:left|right|[,!;]|text\s*)|\s|\$", "", answer).replace("dfrac", "frac").removesuffix(".")
    return re.sub(r"^[a-zA-Z]=", "", s)


def rewrite(answer: str, problem: str) -> str | None:
    """``answer`` written another way that a careful grader accepts (fractions as a/b, ``bmatrix``, unions and
    "all solutions" lists reordered, ``\\pm`` spelled out, thousands separators, ``x \\in`` before an interval...),
    or None when none applies."""
    s = re.sub(r"\\left|\\right", "", answer).replace("\\dfrac", "\\frac").strip()
    s = re.sub(r"^(-?)\\frac\{(\d+)\}\{(\d+)\}$", r"\1\2/\3", s)
    s = re.sub(r"\^\{?\\circ\}?$", "", s)
    if re.fullmatch(r"\d{4,}", s):
        s = f"{int(s):,}".replace(",", ",\\!" if len(problem) % 2 else ",")  # 1,234 or 1,\!234
    s = re.sub(r"-\\frac\{(\d+)\}", r"\\frac{-\1}", s)  # -\frac{1}{3} as \frac{-1}{3}
    s = s.replace("pmatrix", "bmatrix")
    s = re.sub(r"^\\text\{([^{}]*)\}$", r"\1", s)
    s = re.sub(r"^(\w+)_(\d+)$", r"\1_{\2}", s)
    if "\\pm" in s and "," not in s:
        s = f"{s.replace(chr(92) + 'pm', '+', 1)}, {s.replace(chr(92) + 'pm', '-', 1)}"
    parts = split_top_level(s, "\\cup")
    if len(parts) > 1:
        s = " \\cup ".join(reversed(parts))
    elif _UNORDERED.search(problem) and not re.match(r"[(\[]", s) and len(items := split_top_level(s)) > 1:
        s = ", ".join(reversed(items))
    if "interval notation" in problem and s[:1] in "([":
        s = f"x \\in {s}"
    return s if s != answer.strip() else None


def spoil(answer: str, problem: str) -> str | None:
    """A wrong answer of the same form: a point or interval with its two items swapped, an "all solutions" list
    with its last item dropped, a matrix with its first entry plus one; None for other answers."""
    plain = re.sub(r"\\left|\\right", "", answer).strip()
    if (match := re.fullmatch(r"\((.*)\)", plain)) and len(items := split_top_level(match.group(1))) == 2:
        return f"({items[1]}, {items[0]})" if _skeleton(items[0]) != _skeleton(items[1]) else None
    if _UNORDERED.search(problem) and len(items := split_top_level(answer)) > 1:
        return ", ".join(items[:-1])
    if match := re.search(r"\\begin\{pmatrix\}\s*([^&\\]+)", answer):
        return answer[: match.end(1)] + " + 1" + answer[match.end(1) :]
    return None


def math_cases(rows: list[dict]) -> list[Case]:
    """Right and wrong completions for every row of a MATH-style file (see the module docstring)."""
    answers = [row.get("answer") or last_boxed(row["solution"]) or "" for row in rows]
    skeletons = [_skeleton(a) for a in answers]
    cases: list[Case] = []
    for i, (row, answer) in enumerate(zip(rows, answers, strict=True)):
        if not answer:
            continue
        cases += [
            (row["solution"], answer, 1.0),
            (f"<think>{row['solution']}</think>\n<answer>{answer}</answer>", answer, 1.0),
        ]
        if (rewritten := rewrite(answer, row["problem"])) is not None:
            cases.append((f"So the answer is $\\boxed{{{rewritten}}}$.", answer, 1.0))
        others = [
            answers[k % len(rows)] for k in range(i + 1, i + len(rows)) if skeletons[k % len(rows)] != skeletons[i]
        ]
        if others and others[0]:
            cases.append((f"So the answer is $\\boxed{{{others[0]}}}$.", answer, 0.0))
        number = to_number(answer)
        if number is not None:
            cases.append((f"So the answer is $\\boxed{{{_plain(number[0] + 1)}}}$.", answer, 0.0))
            if number[0] != 0:
                cases.append((f"So the answer is $\\boxed{{{_plain(-number[0])}}}$.", answer, 0.0))  # sign flipped
        if match := re.fullmatch(r"(\d+)\s*\\(?:text|mbox)\{[^{}]*\}\^\{?([23])\}?", answer.strip()):
            power = int(match.group(1)) ** int(match.group(2))  # "15\mbox{ cm}^2": 225 is wrong
            cases.append((f"So the answer is $\\boxed{{{power}}}$.", answer, 0.0))
        if (spoiled := spoil(answer, row["problem"])) is not None:
            cases.append((f"<answer>{spoiled}</answer>", answer, 0.0))
    return cases


def table_cases() -> list[Case]:
    """The rows of the hand-written equivalence table in ``tests/rewards/test_rewards_math_forms.py``."""
    spec = importlib.util.spec_from_file_location(
        "equivalence_table", REPO / "tests" / "rewards" / "test_rewards_math_forms.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [(completion, reference, expected) for _, completion, reference, expected in module.ROWS]


def measure(cases: list[Case], backend: str, timeout_s: float) -> dict[str, object]:
    """Verdicts of ``backend`` on ``cases``, counted, and the seconds they took (after a cold start and warm-up)."""
    clear_caches()
    if backend != "builtin":
        math_accuracy([""], ["\\boxed{12345}"], answer=["54321"], backend=backend)  # starts the worker
    start = time.perf_counter()
    scores = math_accuracy([""] * len(cases), [c[0] for c in cases], answer=[c[1] for c in cases],
                           backend=backend, timeout_s=timeout_s)  # fmt: skip
    seconds = time.perf_counter() - start
    right = [s for s, c in zip(scores, cases, strict=True) if c[2] == 1.0]
    wrong = [s for s, c in zip(scores, cases, strict=True) if c[2] == 0.0]
    return {
        "checks": len(cases),
        "accuracy": sum(s == c[2] for s, c in zip(scores, cases, strict=True)) / len(cases),
        "fp": (sum(s == 1.0 for s in wrong), len(wrong)),
        "fn": (sum(s != 1.0 for s in right), len(right)),
        "s_per_1000": 1000 * seconds / len(cases),
        "misses": [(c, s) for s, c in zip(scores, cases, strict=True) if s != c[2]],
    }


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run every backend on every set of cases, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gsm8k", nargs="?", default=str(REPO / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"))
    parser.add_argument("--math", action="append", default=[], help="a MATH-style jsonl (problem, solution, answer)")
    parser.add_argument("--no-table", action="store_true", help="leave out the hand-written equivalence table")
    parser.add_argument("--backends", nargs="+", default=["builtin", "math_verify", "either"])
    parser.add_argument("--limit", type=int, default=None, help="use only the first N rows of each file")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--show", type=int, default=0, help="print up to N misjudged cases per set and backend")
    args = parser.parse_args(argv)

    sets: dict[str, list[Case]] = {}
    gsm8k = Path(args.gsm8k)
    if gsm8k.exists():
        sets[f"GSM8K {gsm8k.name} ({len(read_jsonl(gsm8k, args.limit))} problems)"] = gsm8k_cases(
            read_jsonl(gsm8k, args.limit)
        )
    else:
        print(f"no GSM8K file at {gsm8k}: skipped", file=sys.stderr)
    for path in map(Path, args.math):
        rows = read_jsonl(path, args.limit)
        sets[f"MATH-style {path.name} ({len(rows)} problems)"] = math_cases(rows)
    if not args.no_table:
        sets["equivalence table (tests/rewards/test_rewards_math_forms.py)"] = table_cases()

    print("| cases | backend | checks | accuracy | false positives | false negatives | s / 1,000 checks |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, cases in sets.items():
        for backend in args.backends:
            r = measure(cases, backend, args.timeout_s)
            (fp, wrong), (fn, right) = r["fp"], r["fn"]
            print(
                f"| {name} | {backend} | {r['checks']:,} | {r['accuracy']:.2%} | {fp} / {wrong} | {fn} / {right} "
                f"| {r['s_per_1000']:.2f} |",
                flush=True,
            )
            for (completion, reference, expected), got in r["misses"][: args.show]:
                print(
                    f"    expected {expected}, got {got}: {completion[-80:]!r} vs {reference[-60:]!r}", file=sys.stderr
                )
    clear_caches()


if __name__ == "__main__":
    main()
