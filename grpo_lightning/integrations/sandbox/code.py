"""Code execution reward: run the completion's Python against the row's tests in a sandbox (see ``sandbox.py``).

Tests come in the ``tests`` column, one value per row, in any of these shapes:

* a list of statements, usually ``assert``\\ s (``["assert add(1, 2) == 3", ...]``), run after the code in its
  namespace, each one a test;
* a list of ``{"input": ..., "output": ...}`` stdin / stdout pairs, the program run afresh on each input;
* an APPS-style ``{"inputs": [...], "outputs": [...]}`` dict, or a JSON string of any of the above;
* a string of Python source that is not JSON: each top-level statement is a test.

Program output matches the expected output when their whitespace-separated tokens are equal, numbers within
``1e-6`` (relative or absolute) counting as equal.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from grpo_lightning.integrations.sandbox.sandbox import Isolation, SandboxConfig, run_tests
from grpo_lightning.rewards import register
from grpo_lightning.rewards.inputs import Completion, completion_texts

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

TestKind = Literal["assert", "io"]


def extract_code(completion: str) -> str:
    """The last fenced Python block (```python, ```py, ```python3 or an untagged fence), else the whole text."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def normalize_tests(tests: Any) -> tuple[TestKind, list[str], list[str] | None] | None:
    """``(kind, inputs, expected_outputs)`` for a row's ``tests`` value, or None when the row has no tests.

    ``kind="assert"``: ``inputs`` are statements and there are no expected outputs. ``kind="io"``: ``inputs`` are
    stdin strings and ``expected_outputs`` the stdout each should produce.
    """
    if tests is None:
        return None
    if isinstance(tests, str):
        try:
            return normalize_tests(json.loads(tests))
        except ValueError:
            try:
                statements = [ast.get_source_segment(tests, node) for node in ast.parse(tests).body]
            except SyntaxError:
                statements = [tests]
            return ("assert", [s for s in statements if s], None) if any(statements) else None
    if isinstance(tests, dict):
        if "inputs" in tests and "outputs" in tests:
            pairs = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
            return normalize_tests(pairs)
        if "input" in tests and "output" in tests:
            return normalize_tests([tests])
        raise ValueError(f"a tests dict needs 'input'/'output' or 'inputs'/'outputs' keys (got {sorted(tests)})")
    tests = list(tests)
    if not tests:
        return None
    if all(isinstance(t, str) for t in tests):
        return "assert", tests, None
    if all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return "io", [_as_text(t["input"]) for t in tests], [_as_text(t["output"]) for t in tests]
    raise ValueError("tests must be all assert strings or all {'input': ..., 'output': ...} dicts")


def _as_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value) + "\n"
    return str(value)


def outputs_match(got: str, expected: str, tolerance: float = 1e-6) -> bool:
    """Token-wise equality of two outputs, ignoring whitespace layout; numbers equal within ``tolerance``."""
    got_tokens, expected_tokens = got.split(), expected.split()
    if len(got_tokens) != len(expected_tokens):
        return False
    for a, b in zip(got_tokens, expected_tokens, strict=True):
        if a == b:
            continue
        try:
            x, y = float(a), float(b)
        except ValueError:
            return False
        if not math.isclose(x, y, rel_tol=tolerance, abs_tol=tolerance):
            return False
    return True


def score_code(code: str, tests: Any, config: SandboxConfig, all_or_nothing: bool = False) -> float | None:
    """Fraction of ``tests`` that ``code`` passes in the sandbox (1.0 / 0.0 with ``all_or_nothing``)."""
    parsed = normalize_tests(tests)
    if parsed is None:
        return None
    kind, inputs, expected = parsed
    reports = run_tests(code, inputs, kind, config).results
    if kind == "io":
        assert expected is not None
        passed = [r["ok"] and outputs_match(r.get("out", ""), e) for r, e in zip(reports, expected, strict=True)]
    else:
        passed = [r["ok"] for r in reports]
    fraction = sum(passed) / len(passed)
    return float(fraction == 1.0) if all_or_nothing else fraction


@register("code_execution")
def code_execution(
    prompts: list[str],
    completions: list[Completion],
    tests: list[Any],
    *,
    all_or_nothing: bool = False,
    timeout_s: float = 10.0,
    test_timeout_s: float = 3.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 1_000_000,
    isolation: Isolation = "auto",
    guards: bool = True,
    num_workers: int | None = None,
    **_: object,
) -> list[float | None]:
    """Fraction of the row's ``tests`` that the completion's code passes when run in the sandbox.

    The code is the last fenced Python block of the completion (the whole completion when it has none). Each
    completion runs in its own sandboxed process (``timeout_s`` wall clock for all its tests, ``test_timeout_s``
    per test, ``memory_mb`` address space, ``max_output_bytes`` of output per test, see
    :class:`~grpo_lightning.integrations.sandbox.sandbox.SandboxConfig`), up to ``num_workers`` (default: CPU count) at
    once. ``all_or_nothing`` gives 1.0 only when every test passes. Rows without tests give None.
    """
    completions = completion_texts(completions)  # a conversation's completions are message lists
    config = SandboxConfig(
        timeout_s=timeout_s,
        test_timeout_s=test_timeout_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        isolation=isolation,
        guards=guards,
    )
    workers = max(1, min(num_workers or os.cpu_count() or 1, len(completions) or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        jobs = [
            pool.submit(score_code, extract_code(c), t, config, all_or_nothing)
            for c, t in zip(completions, tests, strict=True)
        ]
        return [job.result() for job in jobs]


code_execution.required_columns = ("tests",)
