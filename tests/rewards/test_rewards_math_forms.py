"""Structured math answers (issue #17): the hand-written equivalence table, one group of rows per answer form.

Every row is (completion, reference, expected reward), written out by hand; each group has right answers written
differently (both directions where it applies) and wrong answers beside them, none of which may be rewarded. The
policy the groups follow is in docs/rewards.md ("What an answer's form implies"); ``tools/bench_math_reward.py``
scores every backend on these rows.
"""

from __future__ import annotations

import pytest

from grpo_lightning.rewards.math import math_accuracy

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
        (r"\boxed{x ∈ [-2, 7]}", r"[-2, 7]", 1.0),  # the Unicode sign is the same label
        (r"\boxed{t ∈ [0, 1]}", r"x \in [0, 1]", 0.0),
        (r"\boxed{x ∈ [0, 1]}", r"t ∈ [0, 1]", 0.0),
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
        (r"\boxed{3, 5, 7}", r"7, 5, 3", 1.0),
        (r"\boxed{3, 5, 7}", r"\{7, 5, 3\}", 1.0),
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


def _scores(backend: str, rows: list[tuple[str, str, str, float]]) -> list[float | None]:
    return math_accuracy([""] * len(rows), [r[1] for r in rows], answer=[r[2] for r in rows], backend=backend)


# Where math-verify's policy differs from ours (docs/rewards.md): it reads a list or set as a tuple, matches an
# equation to its multiples, ignores a base subscript, accepts a decimal approximation of an irrational value, ignores
# the case of letters, drops ``x =`` before an expression in x and ignores which letter is before a Unicode ``∈``.
# ``either`` inherits these acceptances.
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
    (r"\boxed{x ∈ [0, 1]}", r"t ∈ [0, 1]"),  # with the Unicode sign on both sides, the letters are not compared
}


def test_either_backend_rewards_every_right_answer_of_the_table() -> None:
    pytest.importorskip("math_verify")
    scores = _scores("either", ROWS)
    assert [row[1:3] for row, got in zip(ROWS, scores, strict=True) if row[3] == 1.0 and got != 1.0] == []
    accepted_wrong = {row[1:3] for row, got in zip(ROWS, scores, strict=True) if row[3] == 0.0 and got != 0.0}
    assert accepted_wrong == MATH_VERIFY_ACCEPTS
