"""Math accuracy: answer extraction, equivalence (a hand-written table), sympy time limits, the GSM8K / MATH tasks."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_lightning.rewards import get
from grpo_lightning.rewards import math as math_module
from grpo_lightning.rewards.combine import TimeLimitExceeded, time_limit
from grpo_lightning.rewards.math import extract_answer, is_equivalent, math_accuracy, reference_answer
from grpo_lightning.tasks import load_task

DATA = Path(__file__).parents[1] / "data"


def shared_dir() -> Path:
    """``$GRPO_SHARED_DIR``, else the ``shared/`` folder beside the repository (``/work/shared`` for ``/work/main``)."""
    if os.environ.get("GRPO_SHARED_DIR"):
        return Path(os.environ["GRPO_SHARED_DIR"])
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "shared" / "data").is_dir():
            return parent / "shared"
    return here.parents[2] / "shared"


GSM8K_TEST = shared_dir() / "data" / "gsm8k" / "test.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_rates(rows: list[dict]) -> tuple[float, float, float]:
    """(own answer = 1.0, other problem's answer = 0.0, naive neighbour = 0.0) rates for gold solutions.

    "Other problem": the next problem (cyclically) whose final answer is a different string, so that a shared
    answer (two problems both answering 18) is not counted as a wrong reward.
    """
    solutions = [row["answer"] for row in rows]
    raw = [s.rsplit("####", 1)[-1].strip().replace(",", "") for s in solutions]
    n = len(solutions)
    own = math_accuracy([""] * n, solutions, answer=solutions)
    other_refs = []
    for i in range(n):
        j = next(k % n for k in range(i + 1, i + n) if raw[k % n] != raw[i])
        other_refs.append(solutions[j])
    other = math_accuracy([""] * n, solutions, answer=other_refs)
    neighbour = math_accuracy([""] * n, solutions, answer=solutions[1:] + solutions[:1])
    # Where neighbours share an answer the reward must be 1.0, elsewhere 0.0: check against the raw strings.
    assert [v == 1.0 for v in neighbour] == [raw[i] == raw[(i + 1) % n] for i in range(n)]
    return own.count(1.0) / n, other.count(0.0) / n, neighbour.count(0.0) / n


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"no GSM8K test set at {GSM8K_TEST}")
def test_gsm8k_gold_solutions_score_against_their_own_answer_only() -> None:
    rows = read_jsonl(GSM8K_TEST)
    own, other, neighbour = gsm8k_rates(rows)
    print(f"GSM8K ({len(rows)} rows): own {own:.2%} = 1.0, other {other:.2%} = 0.0, neighbour {neighbour:.2%} = 0.0")
    assert own == 1.0 and other == 1.0  # issue #17: 100%, both ways


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"no GSM8K test set at {GSM8K_TEST}")
def test_gsm8k_answers_rewritten_in_other_layouts_still_match() -> None:
    rows = read_jsonl(GSM8K_TEST)
    refs = [row["answer"] for row in rows]
    work = [r.rsplit("####", 1)[0] for r in refs]
    final = [r.rsplit("####", 1)[1].strip() for r in refs]
    r1 = [f"<think>{w}</think>\n<answer>{a}</answer>" for w, a in zip(work, final, strict=True)]
    boxed = [f"{w}So the answer is $\\boxed{{{a}}}$." for w, a in zip(work, final, strict=True)]
    for completions in (r1, boxed):
        scores = math_accuracy([""] * len(rows), completions, answer=refs)
        assert scores.count(1.0) / len(rows) >= 0.995


def test_gsm8k_sample_file() -> None:
    own, other, _ = gsm8k_rates(read_jsonl(DATA / "gsm8k_sample.jsonl"))
    assert own == 1.0 and other == 1.0


# (completion, reference, expected reward) — written out by hand.
TABLE = [
    # extraction formats
    ("<think>3 + 4</think><answer>7</answer>", "7", 1.0),
    ("<think>hmm</think>\n<answer>\n 7 \n</answer>", "7", 1.0),
    ("<answer>8</answer> wait, <answer>7</answer>", "7", 1.0),
    ("<answer>The result is \\boxed{12}</answer>", "12", 1.0),
    ("so we get \\boxed{42}.", "42", 1.0),
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{4}}}", "\\frac{1}{2}", 1.0),
    ("\\boxed 5", "5", 1.0),
    ("\\fbox{9}", "9", 1.0),
    ("\\boxed{\\text{(C)}}", "C", 1.0),
    ("Work...\n#### 42", "42", 1.0),
    ("Work...\n#### 1,234", "1234", 1.0),
    ("The answer is 17.", "17", 1.0),
    ("The final answer is $\\frac{3}{4}$. I hope it is correct.", "0.75", 1.0),
    ("**Answer:** 64", "64", 1.0),
    ("I think it is 12 or maybe 13", "13", 0.0),  # no marked answer, last-number fallback is off
    ("", "5", 0.0),
    ("\\boxed{12", "12", 0.0),  # cut off before the closing brace
    # integers, separators, decimals
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{1\\,000}", "1000", 1.0),
    ("\\boxed{1,000}", "1000.1", 0.0),
    ("\\boxed{1,000,000}", "10^6", 1.0),
    ("The answer is 1,000 dollars.", "1000", 1.0),
    ("\\boxed{1,500\\%}", "15", 1.0),
    ("\\boxed{5.0}", "5", 1.0),
    ("\\boxed{0.50}", ".5", 1.0),
    ("\\boxed{0.5}", "5", 0.0),
    ("\\boxed{1000}", "100", 0.0),
    ("\\boxed{-3}", "-3.00", 1.0),
    ("\\boxed{-3}", "3", 0.0),
    ("\\boxed{2.5e3}", "2500", 1.0),
    # fractions
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\tfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "2", 0.0),
    ("\\boxed{2/4}", "\\frac{1}{2}", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{1\\frac{1}{2}}", "\\frac{3}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.333", 0.0),
    ("\\boxed{\\frac{2}{3}}", "\\frac{3}{2}", 0.0),
    ("\\boxed{\\frac{1}{0}}", "0", 0.0),
    # percentages, units, currency, degrees, spacing
    ("\\boxed{25\\%}", "25", 1.0),
    ("\\boxed{25\\%}", "0.25", 1.0),
    ("The answer is 25%.", "\\boxed{25\\%}", 1.0),
    ("\\boxed{25\\%}", "2.5", 0.0),
    ("The answer is $18.", "18", 1.0),
    ("\\boxed{\\$1,250.00}", "1250", 1.0),
    ("The answer is 18 dollars.", "18", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{5\\mbox{ meters}}", "5", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{30^{\\circ}}", "30", 1.0),
    ("\\boxed{\\left( 1, \\; 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{x = 4}", "4", 1.0),
    ("\\boxed{2x}", "2", 0.0),
    # symbolic (sympy)
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{1}{2}\\sqrt{3}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    ("\\boxed{x^2 + 2x + 2}", "(x+1)^2", 0.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{\\sqrt[3]{27}}", "3", 1.0),
    ("\\boxed{2\\pi r}", "2 r \\pi", 1.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{\\binom{5}{2}}", "10", 1.0),
    ("\\boxed{y = 2x + 1}", "1 + 2x", 1.0),
    ("\\boxed{9^{9^{9^{9}}}}", "1", 0.0),  # refused, never computed
    ("\\boxed{__import__('os').getcwd()}", "0", 0.0),  # never evaluated
    # tuples, intervals, sets, text
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{(2, 1)}", "(1,2)", 0.0),
    ("\\boxed{[0, 1)}", "[0,1)", 1.0),
    ("\\boxed{[0, 1)}", "[0,1]", 0.0),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", 1.0),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{3, 1}", "1, 3", 1.0),
    ("\\boxed{\\frac{1}{2}, 3}", "3, 0.5", 1.0),
    ("\\boxed{1, 2}", "1, 2, 3", 0.0),
    ("\\boxed{\\text{Monday}}", "Monday", 1.0),
    ("\\boxed{\\text{Tuesday}}", "Monday", 0.0),
    ("The answer is (B).", "B", 1.0),
    ("The answer is (B).", "C", 0.0),
]


ACCEPTED = [(completion, reference) for completion, reference, expected in TABLE if expected == 1.0]


@pytest.mark.parametrize(("completion", "reference"), ACCEPTED)
def test_an_accepted_answer_is_refused_against_its_reference_plus_one(completion: str, reference: str) -> None:
    """The judge is not lenient: every answer the table accepts scores 0 once its reference becomes another value
    (nothing in normalisation, number parsing, structures or sympy may explain the difference away)."""
    assert math_accuracy([""], [completion], answer=[f"{reference_answer(reference)} + 1"]) == [0.0]


@pytest.mark.parametrize(("completion", "reference", "expected"), TABLE)
def test_equivalence_table(completion: str, reference: str, expected: float) -> None:
    assert math_accuracy([""], [completion], answer=[reference]) == [expected]


def test_extract_answer_modes() -> None:
    assert extract_answer("\\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert extract_answer("<answer>3</answer> and \\boxed{4}") == "3"
    assert extract_answer("<answer>3</answer> and \\boxed{4}", modes=("boxed", "answer_tag")) == "4"
    assert extract_answer("so 12 apples, then 15") is None
    assert extract_answer("so 12 apples, then 1,500.", last_number=True) == "1,500"
    assert extract_answer("#### 7\n") == "7"
    assert extract_answer("<ANSWER> 5 </Answer>") == "5"
    assert extract_answer("<answer>so: <answer>6</answer>") == "6"  # nested: the innermost
    assert extract_answer("<answer>8</answer> then </answer>") == "8"
    assert extract_answer("</answer> <answer>9") is None
    assert extract_answer("The answer is: 9") == "9"
    with pytest.raises(ValueError, match="unknown extraction mode"):
        extract_answer("x", modes=("nope",))


def test_last_number_option_and_missing_reference() -> None:
    assert math_accuracy([""], ["I think it is 13"], answer=["13"], last_number=True) == [1.0]
    assert math_accuracy(["", ""], ["\\boxed{1}", "\\boxed{1}"], answer=[None, "1"]) == [None, 1.0]
    assert get("math_accuracy") is math_accuracy and math_accuracy.required_columns == ("answer",)


SLOW = ("\\tan(x+y+z)^{4}", "\\sin(x)")  # sympy's simplify takes seconds on this


def test_sympy_time_limit_in_main_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is stopped by its time limit (SIGALRM), not left to finish: no clock is read here, the sympy call
    itself reports whether it returned or was interrupted."""
    outcomes: list[str] = []
    real = math_module._sympy_equal

    def recorded(a: str, b: str) -> bool:
        try:
            result = real(a, b)
        except BaseException as err:
            outcomes.append(type(err).__name__)
            raise
        outcomes.append("finished")
        return result

    monkeypatch.setattr(math_module, "_sympy_equal", recorded)
    math_module._equivalent.cache_clear()  # a cached verdict would skip sympy altogether
    assert is_equivalent(*SLOW, timeout_s=0.3) is False
    assert outcomes == ["TimeLimitExceeded"]


def test_a_time_limit_that_lands_in_a_finalizer_fires_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python drops an exception raised inside ``__del__`` (the garbage collector runs finalizers at any allocation,
    and in a test suite full of torch and Lightning objects the alarm lands in one now and then): the limit must
    raise again rather than let the block run to its end. A one-shot alarm let sympy checks limited to 0.3 s run
    their full 7 s."""
    dropped: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(type(unraisable.exc_value).__name__))

    class SlowFinalizer:
        def __del__(self) -> None:
            while True:  # until the alarm raises in here, where Python can only report the exception and drop it
                pass

    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.05):
            finalizer = SlowFinalizer()
            del finalizer  # the first alarm lands in __del__
            give_up = time.monotonic() + 20  # a bound against hanging (400× the limit), not a measurement
            while time.monotonic() < give_up:
                pass
    assert dropped == ["TimeLimitExceeded"]


def test_sympy_time_limit_off_the_main_thread_uses_a_worker_process() -> None:
    """Off the main thread (no SIGALRM) the check runs in a worker process, killed when it overruns its limit and
    replaced by a fresh one for the next check. The checks that must finish get limits far beyond their needs."""
    results: dict[str, object] = {}

    def check() -> None:
        results["warm"] = is_equivalent("3x", "x+2x", timeout_s=120.0)  # starts the worker
        results["first"] = math_module._WORKER.process
        results["slow"] = is_equivalent(SLOW[0] + "+1", SLOW[1], timeout_s=0.3)
        results["fast"] = is_equivalent("4y", "y+3y", timeout_s=120.0)  # a fresh worker after the kill
        results["second"] = math_module._WORKER.process

    worker = threading.Thread(target=check)
    worker.start()
    worker.join(600)
    assert not worker.is_alive()
    assert results["warm"] is True and results["slow"] is False and results["fast"] is True
    assert results["first"] is not results["second"]  # the overrunning worker was replaced ...
    assert results["first"].returncode == -signal.SIGKILL  # ... after being killed at its limit


def test_gsm8k_task_from_local_file() -> None:
    data = load_task("gsm8k", data_files=str(DATA / "gsm8k_sample.jsonl"), test_size=3)
    assert len(data["train"]) == 7 and len(data["test"]) == 3
    row = data["train"][0]
    assert "<think>" in row["prompt"] and "<answer>" in row["prompt"] and row["question"] in row["prompt"]
    assert "####" in row["solution"] and "####" not in row["answer"] and "," not in row["answer"]
    scores = math_accuracy(data["train"]["prompt"], data["train"]["solution"], answer=data["train"]["answer"])
    assert scores == [1.0] * 7
    split = {"train": str(DATA / "gsm8k_sample.jsonl"), "test": str(DATA / "gsm8k_sample.jsonl")}
    assert len(load_task("gsm8k", data_files=split)["test"]) == 10


def test_math_task_from_local_file() -> None:
    data = load_task("math", data_files=str(DATA / "math_sample.jsonl"), test_size=2)
    rows = list(data["train"]) + list(data["test"])
    assert len(rows) == 8 and {"prompt", "answer", "problem", "solution", "level", "type"} <= set(rows[0])
    assert {row["answer"] for row in rows} >= {"\\frac{5}{6}", "5\\sqrt{2}", "(2, 1)", "25\\%"}
    scores = math_accuracy(
        [r["prompt"] for r in rows], [r["solution"] for r in rows], answer=[r["answer"] for r in rows]
    )
    assert scores == [1.0] * 8
    hard = load_task("math", data_files=str(DATA / "math_sample.jsonl"), test_size=2, levels=[4, 5])
    assert sum(len(split) for split in hard.values()) == 2
