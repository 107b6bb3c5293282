"""Math answers that must not hang a round, and the math-verify backend (issue #17).

Pathological answers (huge powers, deep nesting, slow simplifications, very long text) end by the check's time
limit on every backend, in the main thread (SIGALRM) and elsewhere (a killed worker process); ``backend:
math_verify | either`` is refused in one line without the package, reads our extracted answers, and keeps its
limits from any thread. The backends' verdicts on the equivalence table are in ``test_rewards_math_forms.py``.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_lightning.rewards import RewardError, RewardSpec
from grpo_lightning.rewards import math_backends as backends
from grpo_lightning.rewards.combine import call_with_time_limit, time_limit
from grpo_lightning.rewards.math import is_equivalent, math_accuracy


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
    ("<answer>" * 20_000, "1", 0.0),  # unclosed tags: found in linear time (a lazy regex: ~40 s)
    ("<answer>" * 20_000 + "2</answer>", "1", 0.0),
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


def test_math_verify_backend_reads_our_extracted_answers() -> None:
    pytest.importorskip("math_verify")
    completions = ["<answer>18</answer>", "#### 1,000", "The answer is $\\frac{1}{2}$.", "<answer>17</answer>"]
    references = ["18", "1000", "0.5", "18"]
    for backend in ("math_verify", "either"):
        scores = math_accuracy([""] * 4, completions, answer=references, backend=backend)
        assert scores == [1.0, 1.0, 1.0, 0.0], backend


def test_math_verify_backend_from_threads_stays_within_its_time_limit() -> None:
    pytest.importorskip("math_verify")
    slow = (r"\boxed{\tan(x+y+z)^{4} + 7}", r"\sin(x) + 7")  # math-verify takes seconds on it
    slow_took: list[float] = []

    def check(i: int) -> list[float | None]:
        # The easy checks get a limit far beyond their needs: one may run first in a worker just restarted after the
        # slow check's kill, and on a loaded machine that first check alone can take more than 0.5 s.
        easy = math_accuracy([""], [rf"\boxed{{{i + 2}/4}}"], answer=[f"{(i + 2) / 4}"], backend="math_verify",
                             timeout_s=20.0)  # fmt: skip
        if i == 0:
            began = time.monotonic()
            verdict = math_accuracy([""], [slow[0]], answer=[slow[1]], backend="math_verify", timeout_s=0.5)
            slow_took.append(time.monotonic() - began)
            return easy + verdict
        return easy + math_accuracy([""], [rf"\boxed{{{i}}}"], answer=[str(i)], backend="math_verify", timeout_s=20.0)

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda i: call_with_time_limit(check, 60.0, i), range(3)))
    assert results == [[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    # Hang guards, not speed tests: the slow check is cut at its 0.5 s (+ 3 s for waiting on the shared worker and a
    # loaded machine); all of it, worker start-ups included, well within 30 s.
    assert slow_took[0] < 0.5 + 3.0, slow_took
    assert time.monotonic() - start < 30.0


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
