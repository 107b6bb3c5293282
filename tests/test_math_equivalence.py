"""Structured math answers (issue #17): the equivalence table by answer form, and the math-verify backend.

Every row is (completion, reference, expected reward), written out by hand; each group has right answers written
differently (both directions where it applies) and wrong answers beside them, none of which may be rewarded.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from grpo_lightning.rewards import RewardError, RewardSpec
from grpo_lightning.rewards import math_backends as backends
from grpo_lightning.rewards.combine import call_with_time_limit, time_limit
from grpo_lightning.rewards.math import is_equivalent, math_accuracy

PMATRIX = r"\begin{pmatrix} -\frac{1}{3} & 2 \\ 0 & \sqrt{8} \end{pmatrix}"

TABLE: dict[str, list[tuple[str, str, float]]] = {
    "matrices": [
        (r"\boxed{\begin{pmatrix} \frac{-1}{3} & 2 \\ 0 & 2\sqrt{2} \end{pmatrix}}", PMATRIX, 1.0),
        (rf"\boxed{{{PMATRIX}}}", r"\begin{pmatrix} \frac{-1}{3} & 2 \\ 0 & 2\sqrt{2} \end{pmatrix}", 1.0),
        (r"\boxed{\begin{bmatrix} -\dfrac13 & 2 \\ 0 & \sqrt{8} \end{bmatrix}}", PMATRIX, 1.0),
        (rf"\boxed{{{PMATRIX}}}", r"\begin{bmatrix} \frac{-1}{3} & 2 \\ 0 & 2\sqrt{2} \end{bmatrix}", 1.0),
        (r"\boxed{\begin{bmatrix} \frac{-1}{3} & 2 \\ 0 & 3 \end{bmatrix}}", PMATRIX, 0.0),
        (r"<answer>\begin{pmatrix} 2 \\ -1 \\ \end{pmatrix}</answer>", r"\begin{pmatrix} 2 \\ -1 \end{pmatrix}", 1.0),
        (r"\boxed{\begin{pmatrix} \frac{1}{3} & 2 \\ 0 & \sqrt{8} \end{pmatrix}}", PMATRIX, 0.0),
        (r"\boxed{\begin{pmatrix} 2 & -\frac{1}{3} \\ 0 & \sqrt{8} \end{pmatrix}}", PMATRIX, 0.0),
        (r"\boxed{\begin{pmatrix} -\frac{1}{3} & 2 & 0 & \sqrt{8} \end{pmatrix}}", PMATRIX, 0.0),
        (r"\boxed{\begin{vmatrix} -\frac{1}{3} & 2 \\ 0 & \sqrt{8} \end{vmatrix}}", PMATRIX, 0.0),
        (r"\boxed{\begin{pmatrix} -1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 2 \\ -1 \end{pmatrix}", 0.0),
        (r"\boxed{(2, -1)}", r"\begin{pmatrix} 2 \\ -1 \end{pmatrix}", 0.0),
        (r"\boxed{\begin{pmatrix} 0.5 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} \frac12 \\ 2 \end{pmatrix}", 1.0),
        (r"\boxed{\begin{pmatrix} 1 & 23 & 4 \end{pmatrix}}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", 0.0),
        (r"\boxed{\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}}", r"\begin{pmatrix} 1 & 23 & 4 \end{pmatrix}", 0.0),
        (r"\boxed{\begin{pmatrix} 1 & 3 \\ 2 & 4 \end{pmatrix}}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", 0.0),
        (r"\boxed{2\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", 0.0),
    ],
    "unions of intervals": [
        (r"\boxed{(9,36) \cup (0,9)}", r"(0,9) \cup (9,36)", 1.0),
        (r"\boxed{(0, 9) \cup (9, 36)}", r"(9,36) \cup (0,9)", 1.0),
        (r"\boxed{(3, \infty) \cup [-2, 1) \cup \{5\}}", r"[-2, 1) \cup \{5\} \cup (3, \infty)", 1.0),
        (r"\boxed{(9,36] \cup (0,9)}", r"(0,9) \cup (9,36)", 0.0),
        (r"\boxed{(0,36)}", r"(0,9) \cup (9,36)", 0.0),
        (r"\boxed{(0,9)}", r"(0,9) \cup (9,36)", 0.0),
        (r"\boxed{(0,9) \cup (9,35)}", r"(0,9) \cup (9,36)", 0.0),
    ],
    "plus or minus": [
        (r"\boxed{1 + \sqrt{19}, 1 - \sqrt{19}}", r"1 \pm \sqrt{19}", 1.0),
        (r"\boxed{1 - \sqrt{19}, 1 + \sqrt{19}}", r"1 \pm \sqrt{19}", 1.0),
        (r"\boxed{x = 1 \pm \sqrt{19}}", r"1 + \sqrt{19}, 1 - \sqrt{19}", 1.0),
        (r"\boxed{1 \pm \sqrt{19}}", r"1 - \sqrt{19}, 1 + \sqrt{19}", 1.0),
        (r"\boxed{1 \pm \sqrt{19}}", r"1 + \sqrt{19}", 0.0),
        (r"\boxed{1 \pm \sqrt{19}}", r"1 + \sqrt{19}, 1 - \sqrt{17}", 0.0),
        (r"\boxed{\pm 3}", r"3, -3", 1.0),
        (r"\boxed{1 + \sqrt{19}}", r"1 \pm \sqrt{19}", 0.0),
        (r"\boxed{1 \pm \sqrt{17}}", r"1 + \sqrt{19}, 1 - \sqrt{19}", 0.0),
        (r"\boxed{-1 \pm \sqrt{19}}", r"1 \pm \sqrt{19}", 0.0),
        (r"\boxed{1 + \sqrt{19}, 1 - \sqrt{19}, 3}", r"1 \pm \sqrt{19}", 0.0),
        (r"\boxed{3}", r"\pm 3", 0.0),
        (r"\boxed{2 \pm 1}", r"1, 3", 1.0),
        (r"\boxed{2 \pm 1}", r"1, 2", 0.0),
    ],
    "x in a set": [
        (r"\boxed{x \in [-2, 7]}", r"[-2, 7]", 1.0),
        (r"\boxed{[-2, 7]}", r"x \in [-2, 7]", 1.0),
        (r"\boxed{x \in (-\infty, 3]}", r"(-\infty, 3]", 1.0),
        (r"\boxed{x \in (-2, 7]}", r"[-2, 7]", 0.0),
        (r"\boxed{x \in [-2, 8]}", r"x \in [-2, 7]", 0.0),
        (r"\boxed{x_1 = 3}", r"x = 3", 1.0),
        (r"\boxed{\mathbf{v} = (1, 2)}", r"\vec{v} = (1, 2)", 1.0),
        (r"\boxed{y = 3}", r"x = 3", 0.0),  # two labels: the same letter (x = 3 and y = 3 are different lines)
        (r"\boxed{x = 3}", r"y = 3", 0.0),
        (r"\boxed{t \in [0, 1]}", r"x \in [0, 1]", 0.0),
        (r"\boxed{x = -2}", r"2", 0.0),
    ],
    "spacing inside numbers": [
        (r"\boxed{11111111100}", r"11,\! 111,\! 111,\! 100", 1.0),
        (r"\boxed{11,\! 111,\! 111,\! 100}", r"11111111100", 1.0),
        (r"The answer is 11,111,111,100.", r"11,\! 111,\! 111,\! 100", 1.0),
        (r"\boxed{1,\!000}", r"1000", 1.0),
        (r"\boxed{11111111110}", r"11,\! 111,\! 111,\! 100", 0.0),
        (r"\boxed{1111111100}", r"11,\! 111,\! 111,\! 100", 0.0),
        (r"\boxed{11, 111}", r"11111", 0.0),  # a list of two numbers, not a thousands separator
        (r"\boxed{1\,000\,000}", r"10^6", 1.0),
        (r"\boxed{12\ 500}", r"12,500", 1.0),
        (r"\boxed{12 500}", r"12500", 1.0),
        (r"\boxed{3\quad 4}", r"34", 0.0),  # spacing between digits that is not a thousands separator
        (r"\boxed{3\,4}", r"34", 0.0),
        (r"\boxed{3 4}", r"34", 0.0),
        (r"\boxed{3 4}", r"12", 0.0),  # nor a product
        (r"\boxed{12 5}", r"125", 0.0),
        (r"\boxed{1 2 3}", r"123", 0.0),
    ],
    "units with exponents": [
        (r"\boxed{15}", r"15\mbox{ cm}^2", 1.0),
        (r"\boxed{225}", r"15\mbox{ cm}^2", 0.0),  # the wrong acceptance of issue #17
        (r"\boxed{15\mbox{ cm}^2}", r"15", 1.0),
        (r"\boxed{15\mbox{ cm}^2}", r"225", 0.0),
        (r"\boxed{15\mbox{ cm}^2}", r"15\mbox{ cm}^2", 1.0),
        (r"\boxed{15}", r"15\text{cm}^2", 1.0),
        (r"\boxed{225}", r"15\text{cm}^2", 0.0),
        (r"\boxed{864 \mbox{ inches}^2}", r"864", 1.0),
        (r"\boxed{864 \mbox{ inches}^2}", r"746496", 0.0),
        (r"\boxed{5}", r"5\mbox{ m}^3", 1.0),
        (r"\boxed{5\mbox{ m}^3}", r"125", 0.0),
        (r"\boxed{15 \text{ cm}^2}", r"15\mbox{ cm}^2", 1.0),
        (r"\boxed{16 \text{ cm}^2}", r"15\mbox{ cm}^2", 0.0),
        (r"\boxed{15\text{ cm}^2}", r"15", 1.0),
        (r"\boxed{15 \text{cm}^{2}}", r"225", 0.0),
        (r"\boxed{864}", r"864 \mbox{ inches}^2", 1.0),
        (r"\boxed{746496}", r"864 \mbox{ inches}^2", 0.0),
        (r"The answer is 864 inches^2.", r"864", 1.0),
        (r"\boxed{5\mbox{ m}^3}", r"5", 1.0),
        (r"\boxed{125}", r"5\mbox{ m}^3", 0.0),
        (r"\boxed{15^2 \text{ cm}^2}", r"225", 1.0),
        (r"\boxed{16}", r"15\mbox{ cm}^2", 0.0),
        (r"\boxed{5 \text{ m}^{2}}", r"25", 0.0),
        (r"\boxed{2 x}", r"2", 0.0),  # a variable, not a unit
        (r"\boxed{2\text{ hours }30\text{ minutes}}", r"230", 0.0),  # only a unit that ends the answer is dropped
        (r"\boxed{3 \text{ cm}, 4 \text{ cm}}", r"4, 3", 1.0),
        (r"\boxed{(3\text{ cm}, 4\text{ cm})}", r"(3, 4)", 1.0),
        (r"\boxed{(3\text{ cm}^2, 4\text{ cm}^2)}", r"(9, 16)", 0.0),
    ],
    "unordered answers": [
        (r"\boxed{7, 5, 3}", r"3, 5, 7", 1.0),
        (r"\boxed{\{7, 3, 5\}}", r"3, 5, 7", 1.0),
        (r"\boxed{x = 3, x = 5}", r"5, 3", 1.0),
        (r"\boxed{3, 5}", r"3, 5, 7", 0.0),
        (r"\boxed{3, 5, 5}", r"3, 5, 7", 0.0),
        (r"\boxed{3, 5, 7, 9}", r"3, 5, 7", 0.0),
        (r"\boxed{b = 3, a = 2}", r"a = 2, b = 3", 1.0),
        (r"\boxed{a = 3, b = 2}", r"a = 2, b = 3", 0.0),  # labels that differ are kept
        (r"\boxed{\{1, 2\}}", r"(1, 2)", 0.0),
        (r"\boxed{3 \text{ or } 5}", r"5, 3", 1.0),
        (r"\boxed{x = 1 \text{ or } x = 2}", r"1, 2", 1.0),
        (r"\boxed{3, 5 \text{ and } 7}", r"7, 5, 3", 1.0),
        (r"The answer is 3 or 5.", r"3, 5", 1.0),
        (r"\boxed{3 \text{ or } 4}", r"34", 0.0),
        (r"\boxed{3 \text{ or } 4}", r"3", 0.0),
        (r"\boxed{x = 1 \text{ or } x = 3}", r"1, 2", 0.0),
    ],
    "ordered tuples and points": [
        (r"\boxed{(3, -1)}", r"(3,-1)", 1.0),
        (r"\boxed{\left( \frac{1}{2}, 4 \right)}", r"(0.5, 4)", 1.0),
        (r"\boxed{(-1, 3)}", r"(3,-1)", 0.0),
        (r"\boxed{3, -1}", r"(3,-1)", 0.0),
        (r"\boxed{(3, -1, 0)}", r"(3,-1)", 0.0),
    ],
    "equations": [
        (r"\boxed{y = 2x + 3}", r"2x + 3", 1.0),
        (r"\boxed{2x + 3}", r"y = 2x + 3", 1.0),
        (r"\boxed{y = 3 + 2x}", r"y = 2x + 3", 1.0),
        (r"\boxed{3y + 2x = 6}", r"2x + 3y = 6", 1.0),
        (r"\boxed{2x + 3y - 6 = 0}", r"2x + 3y = 6", 1.0),
        (r"\boxed{6 = 2x + 3y}", r"2x + 3y = 6", 1.0),
        (r"\boxed{y = 2x - 3}", r"y = 2x + 3", 0.0),
        (r"\boxed{x = 2y + 3}", r"y = 2x + 3", 0.0),
        (r"\boxed{4x + 6y = 12}", r"2x + 3y = 6", 0.0),  # a multiple: not the form asked for
        (r"\boxed{2x + 3y = 7}", r"2x + 3y = 6", 0.0),
        (r"\boxed{2x + 3 = y}", r"y = 2x + 3", 1.0),  # a label is also the left side of an equation
        (r"\boxed{y - 2x - 3 = 0}", r"y = 2x + 3", 1.0),
        (r"\boxed{y = 2x + 3}", r"-y + 2x + 3 = 0", 1.0),
        (r"\boxed{x - y = 0}", r"y = x", 1.0),
        (r"\boxed{x = 2x + 3}", r"2x + 3", 0.0),  # x on both sides: an equation, not a label
        (r"\boxed{2x + 3}", r"x = 2x + 3", 0.0),
        (r"\boxed{y = 2x + 3}", r"2x + 4 = y", 0.0),
    ],
    "units and currency": [
        (r"\boxed{\$18.50}", r"18.5", 1.0),
        (r"The answer is 18 dollars.", r"\$18", 1.0),
        (r"\boxed{5\text{ cm}}", r"5", 1.0),
        (r"\boxed{18 \text{ dollars}}", r"19", 0.0),
        (r"\boxed{50\text{ mm}}", r"5\text{ cm}", 0.0),  # no unit conversion
        (r"\boxed{\$1,850}", r"18.50", 0.0),
    ],
    "percent": [
        (r"\boxed{25\%}", r"25", 1.0),
        (r"\boxed{25\%}", r"0.25", 1.0),
        (r"\boxed{25}", r"25\%", 1.0),
        (r"\boxed{0.25}", r"25\%", 1.0),
        (r"\boxed{2.5\%}", r"25\%", 0.0),
        (r"\boxed{25\%}", r"2.5", 0.0),
        (r"\boxed{75\%}", r"25\%", 0.0),
        (r"\boxed{0.75\%}", r"75\%", 0.0),  # two percentages compare as they are
        (r"\boxed{75\%}", r"0.75\%", 0.0),
        (r"\boxed{75\%}", r"75\%", 1.0),
    ],
    "degrees": [
        (r"\boxed{30^\circ}", r"30", 1.0),
        (r"\boxed{30}", r"30^\circ", 1.0),
        (r"\boxed{30 degrees}", r"30^{\circ}", 1.0),
        (r"\boxed{\frac{\pi}{6}}", r"30^\circ", 0.0),  # no conversion between degrees and radians
        (r"\boxed{60^\circ}", r"30", 0.0),
        (r"\boxed{90^{\circ}}", r"90", 1.0),
        (r"\boxed{1}", r"90^\circ", 0.0),  # ^\circ is removed whole, never read as a power
        (r"\boxed{30^\circ}", r"900", 0.0),
    ],
    "numbers in another base": [
        (r"\boxed{52_8}", r"52_8", 1.0),
        (r"\boxed{52_{8}}", r"52_8", 1.0),
        (r"\boxed{52}", r"52_8", 1.0),  # bare digits are read in the reference's base
        (r"\boxed{1011_2}", r"1011_{2}", 1.0),
        (r"\boxed{42}", r"52_8", 0.0),  # 52_8 in decimal: not written in base 8
        (r"\boxed{528}", r"52_8", 0.0),
        (r"\boxed{52_8}", r"52", 0.0),
        (r"\boxed{101010_2}", r"52_8", 0.0),  # the same value in another base
        (r"\boxed{1101_2}", r"1011_2", 0.0),
        (r"\boxed{59}", r"52_8", 0.0),  # 9 is not a base-8 digit
        (r"\boxed{42_{10}}", r"42", 1.0),  # base 10 is the decimal number
        (r"\boxed{42}", r"42_{10}", 1.0),
        (r"\boxed{43_{10}}", r"42", 0.0),
        (r"\boxed{42_{10}}", r"52_8", 0.0),
        (r"\boxed{a3_{16}}", r"A3_{16}", 1.0),
        (r"\boxed{a3}", r"A3_{16}", 1.0),
        (r"\boxed{a4_{16}}", r"A3_{16}", 0.0),
        (r"\boxed{10}", r"a_{12}", 0.0),  # a subscripted variable, not a number in base 12
    ],
    "unsimplified radicals": [
        (r"\boxed{\sqrt{117}}", r"3\sqrt{13}", 1.0),
        (r"\boxed{3\sqrt{13}}", r"\sqrt{117}", 1.0),
        (r"\boxed{\frac{\sqrt{12}}{2}}", r"\sqrt{3}", 1.0),
        (r"\boxed{\sqrt{116}}", r"3\sqrt{13}", 0.0),
        (r"\boxed{3\sqrt{12}}", r"3\sqrt{13}", 0.0),
        (r"\boxed{\sqrt{39}}", r"3\sqrt{13}", 0.0),
    ],
    "close values and infinities": [
        (r"\boxed{\frac{\sqrt{6} + \sqrt{2}}{4}}", r"\frac{\sqrt{2 + \sqrt{3}}}{2}", 1.0),  # equal, shown numerically
        (r"\boxed{10^{-12}}", r"0", 0.0),  # no absolute slack near 0
        (r"\boxed{\frac{1}{10^{12}}}", r"0", 0.0),
        (r"\boxed{2^{-40}}", r"0", 0.0),
        (r"\boxed{10^{-9999}}", r"0", 0.0),
        (r"\boxed{0.7071067812}", r"\frac{\sqrt{2}}{2}", 0.0),  # an approximation, as 0.333 for 1/3
        (r"\boxed{1.0000001}", r"1", 0.0),
        (r"\boxed{\infty}", r"\infty", 1.0),
        (r"\boxed{\infty}", r"-\infty", 0.0),
        (r"\boxed{7}", r"\infty", 0.0),
        (r"\boxed{0}", r"\infty", 0.0),
        (r"\boxed{[2, \infty)}", r"[2, \infty)", 1.0),
        (r"\boxed{[2, 5)}", r"[2, \infty)", 0.0),  # a finite end for an infinite one
        (r"\boxed{(-\infty, 3]}", r"(\infty, 3]", 0.0),
        (r"\boxed{(0, \infty)}", r"(0, 10^{9})", 0.0),
    ],
    "letters and words": [
        (r"\boxed{\text{Monday}}", r"monday", 1.0),  # words: any case
        (r"\boxed{\text{(C)}}", r"C", 1.0),
        (r"\boxed{X}", r"x", 0.0),  # single letters and commands: their case
        (r"\boxed{E}", r"e", 0.0),
        (r"\boxed{\text{A}}", r"a", 0.0),
        (r"\boxed{\Pi}", r"\pi", 0.0),
        (r"\boxed{\text{(B)}}", r"C", 0.0),
    ],
    "several boxed answers": [
        (r"First \boxed{3}, no: so \boxed{5}.", r"5", 1.0),
        (r"First \boxed{3}, no: so \boxed{5}.", r"3", 0.0),
        (r"\boxed{3} and \boxed{5}", r"3, 5", 0.0),  # the last one counts, alone
        (r"\boxed{3, 5}", r"5, 3", 1.0),
        (r"<answer>\boxed{4}</answer> then \boxed{5}", r"4", 1.0),
        (r"<answer>\boxed{4}</answer> then \boxed{5}", r"5", 0.0),
    ],
}
ROWS = [(group, *row) for group, rows in TABLE.items() for row in rows]


def test_each_group_has_right_and_wrong_answers() -> None:
    for group, rows in TABLE.items():
        expected = [row[2] for row in rows]
        assert 1.0 in expected and 0.0 in expected, group
    assert len(ROWS) >= 100 and sum(row[3] == 0.0 for row in ROWS) >= 50


@pytest.mark.parametrize(("group", "completion", "reference", "expected"), ROWS)
def test_equivalence_by_answer_form(group: str, completion: str, reference: str, expected: float) -> None:
    assert math_accuracy([""], [completion], answer=[reference]) == [expected], group


def test_gsm8k_sample_scores_exactly() -> None:
    rows = [json.loads(line) for line in (Path(__file__).parent / "data" / "gsm8k_sample.jsonl").open()]
    solutions = [row["answer"] for row in rows]
    own = math_accuracy([""] * len(rows), solutions, answer=solutions)
    other = math_accuracy([""] * len(rows), solutions, answer=solutions[1:] + solutions[:1])
    assert own == [1.0] * len(rows) and other == [0.0] * len(rows)


def _gsm8k_test_file() -> Path:
    """``$GRPO_SHARED_DIR/data/gsm8k/test.jsonl``, else the ``shared/`` folder beside the repository."""
    if os.environ.get("GRPO_SHARED_DIR"):
        return Path(os.environ["GRPO_SHARED_DIR"]) / "data" / "gsm8k" / "test.jsonl"
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not _gsm8k_test_file().exists(), reason="no GSM8K test set in shared/")
def test_gsm8k_gold_solutions_score_one_against_their_answer_and_zero_against_others() -> None:
    solutions = [json.loads(line)["answer"] for line in _gsm8k_test_file().open() if line.strip()]
    finals = [s.rsplit("####", 1)[1].strip().replace(",", "") for s in solutions]
    n = len(solutions)
    others = [solutions[next(k % n for k in range(i + 1, i + n) if finals[k % n] != finals[i])] for i in range(n)]
    assert math_accuracy([""] * n, solutions, answer=solutions) == [1.0] * n
    assert math_accuracy([""] * n, solutions, answer=others) == [0.0] * n


def test_a_check_with_many_slow_parts_stays_within_its_time_limit() -> None:
    slow = r"\tan(x+y+z)^{4}"
    many = ", ".join(f"{slow} + {i}" for i in range(40))
    start = time.monotonic()
    assert is_equivalent(many, ", ".join(rf"\sin(x) + {i}" for i in range(40)), timeout_s=0.5) is False
    # A hang guard, not a speed test: unbounded, the 40 parts take minutes; 20x the limit absorbs a loaded machine.
    assert time.monotonic() - start < 20 * 0.5


# Answers that, unguarded, hang a check or run it for minutes: a huge power (refused, or stopped at the limit), deep
# nesting (parsed in linear time; too deep for sympy's parser or for Python's recursion: not equivalent), a slow
# simplification, and an answer past MAX_ANSWER_CHARS (compared as text only). (completion, reference, expected).
PATHOLOGICAL = [
    (r"\boxed{10^{10^{10}}}", "1", 0.0),
    (r"\boxed{9^{9^{9^{9}}}}", "1", 0.0),
    (r"\boxed{(10^{9999})^{9999}}", "1", 0.0),  # each exponent allowed, the value a 10^8-digit number
    (r"\boxed{2^{10000} \cdot 2^{10000} \cdot 2^{10000}}", "1", 0.0),
    ("\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}", "1", 0.0),
    ("\\boxed{" + "\\sqrt{" * 250 + "2" + "}" * 250 + "}", "1", 0.0),
    ("\\boxed{" + "(1," * 300 + "2" + ")" * 300 + "}", "(1," * 300 + "3" + ")" * 300, 0.0),
    ("\\boxed{" + "(" * 900 + "1" + ")" * 900 + "}", "2", 0.0),
    (r"\boxed{\sin(\sin(\sin(\sin(\sin(\sin(x+y+z)^{7})^5)^3)))}", r"\cos(x)", 0.0),
    (r"\boxed{(x+y+z+w)^{200}}", r"(w+x+y+z)^{200} + 1", 0.0),
    ("\\boxed{" + "1" * 100_000 + "}", "1" * 99_999 + "2", 0.0),
    ("\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}", "1", 0.0),
]


@pytest.mark.parametrize(("backend", "in_thread"), [("builtin", False), ("builtin", True), ("math_verify", False)])
def test_pathological_answers_finish_within_the_time_limit(backend: str, in_thread: bool) -> None:
    """Each check ends by its limit (SIGALRM in the main thread, a killed worker process elsewhere and for
    math-verify). Before each, a fresh easy check waits for a worker killed by the previous case to be back."""
    if backend != "builtin":
        pytest.importorskip("math_verify")
    limit, took, verdicts = 0.5, [], []

    def run() -> None:
        for i, (completion, reference, _) in enumerate(PATHOLOGICAL):
            warm = math_accuracy(
                [""], [rf"\boxed{{{i + 2}x}}"], answer=[f"x + {i + 1}x"], backend=backend, timeout_s=60
            )
            assert warm == [1.0]
            start = time.monotonic()
            verdicts.append(math_accuracy([""], [completion], answer=[reference], backend=backend, timeout_s=limit)[0])
            took.append(time.monotonic() - start)

    if in_thread:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(600)
    else:
        run()
    assert verdicts == [row[2] for row in PATHOLOGICAL]
    # A hang guard, not a speed test: the limit plus 3 s for a loaded machine (unguarded: minutes, or never).
    assert max(took) < limit + 3.0, [f"{t:.2f}" for t in took]


# ----------------------------------------------------------------------------------------- backends
def test_unknown_backend_is_refused_when_the_reward_is_built() -> None:
    with pytest.raises(RewardError, match="unknown backend 'sympy'; use one of builtin, math_verify, either"):
        RewardSpec("math_accuracy", kwargs={"backend": "sympy"}).build()
    with pytest.raises(RewardError, match="unknown extraction mode"):
        RewardSpec("math_accuracy", kwargs={"modes": ["boxed", "nope"]}).build()
    assert RewardSpec("math_accuracy", kwargs={"backend": "builtin"}).build()([""], ["\\boxed{2}"], answer=["2"]) == [
        1.0
    ]


@pytest.mark.parametrize("backend", ["math_verify", "either"])
def test_math_verify_backend_without_the_package_names_the_extra(monkeypatch, backend: str) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes ``import math_verify`` fail
    backends._math_verify_missing.cache_clear()
    try:
        with pytest.raises(RewardError) as err:
            RewardSpec("math_accuracy", kwargs={"backend": backend}).build()
        message = str(err.value)
        assert "\n" not in message and "math-verify" in message and "pip install 'grpo_lightning[math]'" in message
        with pytest.raises(RewardError) as err:  # called directly, without RewardSpec: the same line
            math_accuracy([""], [r"\boxed{2}"], answer=["3"], backend=backend)
        assert str(err.value) == message
        assert math_accuracy([""], [r"\boxed{2}"], answer=["2"], backend="builtin") == [1.0]  # builtin needs nothing
    finally:
        backends._math_verify_missing.cache_clear()


def _scores(backend: str, rows: list[tuple[str, str, str, float]]) -> list[float | None]:
    return math_accuracy([""] * len(rows), [r[1] for r in rows], answer=[r[2] for r in rows], backend=backend)


def test_math_verify_backend_reads_our_extracted_answers() -> None:
    pytest.importorskip("math_verify")
    completions = ["<answer>18</answer>", "#### 1,000", "The answer is $\\frac{1}{2}$.", "<answer>17</answer>"]
    references = ["18", "1000", "0.5", "18"]
    for backend in ("math_verify", "either"):
        scores = math_accuracy([""] * 4, completions, answer=references, backend=backend)
        assert scores == [1.0, 1.0, 1.0, 0.0], backend


# Where math-verify's policy differs from ours (docs/rewards.md): it reads a list or set as a tuple, matches an
# equation to its multiples, ignores a base subscript, accepts a decimal approximation of an irrational value, ignores
# the case of letters and drops ``x =`` before an expression in x. ``either`` inherits these acceptances.
MATH_VERIFY_ACCEPTS = {
    (r"\boxed{X}", r"x"),
    (r"\boxed{E}", r"e"),
    (r"\boxed{\text{A}}", r"a"),
    (r"\boxed{\Pi}", r"\pi"),
    (r"\boxed{x = 2x + 3}", r"2x + 3"),
    (r"\boxed{2x + 3}", r"x = 2x + 3"),
    (r"\boxed{0.7071067812}", r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{3, -1}", r"(3,-1)"),
    (r"\boxed{\{1, 2\}}", r"(1, 2)"),
    (r"\boxed{4x + 6y = 12}", r"2x + 3y = 6"),
    (r"\boxed{52_8}", r"52"),
}


def test_either_backend_rewards_every_right_answer_of_the_table() -> None:
    pytest.importorskip("math_verify")
    scores = _scores("either", ROWS)
    assert [row[1:3] for row, got in zip(ROWS, scores, strict=True) if row[3] == 1.0 and got != 1.0] == []
    accepted_wrong = {row[1:3] for row, got in zip(ROWS, scores, strict=True) if row[3] == 0.0 and got != 0.0}
    assert accepted_wrong == MATH_VERIFY_ACCEPTS


def test_math_verify_backend_from_threads_stays_within_its_time_limit() -> None:
    pytest.importorskip("math_verify")
    slow = (r"\boxed{\tan(x+y+z)^{4} + 7}", r"\sin(x) + 7")  # math-verify takes seconds on it

    def check(i: int) -> list[float | None]:
        completions = [rf"\boxed{{{i + 2}/4}}", slow[0] if i == 0 else rf"\boxed{{{i}}}"]
        return math_accuracy([""] * 2, completions, answer=[f"{(i + 2) / 4}", slow[1] if i == 0 else str(i)],
                             backend="math_verify", timeout_s=0.5)  # fmt: skip

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda i: call_with_time_limit(check, 60.0, i), range(3)))
    assert results == [[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert time.monotonic() - start < 30.0  # worker start-ups included; the slow check alone is cut at 0.5 s


def test_math_verify_backend_in_the_main_thread_keeps_an_enclosing_time_limit() -> None:
    pytest.importorskip("math_verify")
    assert threading.current_thread() is threading.main_thread()
    with time_limit(60.0):
        import signal

        before = signal.getitimer(signal.ITIMER_REAL)[0]
        assert math_accuracy([""], [r"\boxed{\frac{6}{8}}"], answer=["0.75"], backend="math_verify") == [1.0]
        assert math_accuracy([""], [r"\boxed{9^{9^{9^{9}}}}"], answer=["1"], backend="math_verify", timeout_s=1.0) == [
            0.0
        ]
        after = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 0 < after < before  # still armed, still counting down
