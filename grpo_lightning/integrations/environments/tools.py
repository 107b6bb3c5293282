"""Tools a policy can call: ``calculator`` (safe arithmetic), ``python`` (the code reward's sandbox), user functions.

A tool is a function ``fn(argument: str) -> str``: the text between the call's name and its close tag in, the
result's text out. ``resolve_tool`` finds one by name: a built-in, or an import path ``pkg.module:fn`` (or
``pkg.module.fn``). A tool may raise: ``ToolEnvironment`` turns a failure of the call (bad input, an exception, a
timeout) into an ``error: ...`` observation for the policy to read. A failure of the tool itself (its sandbox does
not start, a service it needs is down) is no answer to the call: the tool raises ``ToolBroken`` (the sandbox's own
``SandboxError`` counts as one), and the rollout stops with one line naming the tool instead of answering every
call with the same error.

- ``calculator`` parses the argument with ``ast`` and evaluates numbers, ``+ - * / // % **`` and parentheses
  only: no names, no calls, no ``eval``; exponents and results are bounded so ``9**9**9`` cannot hang it.
- ``python`` runs the argument as a program in ``integrations/sandbox/sandbox.py`` (the same process isolation, resource
  limits and guards as the ``code_execution`` reward, configured by the same ``SandboxConfig``) and returns what it
  printed; an exception, a timeout or an exceeded limit is an error. ``ToolEnvironment`` bounds its time limits by
  its own ``timeout_s``.
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.errors import EnvironmentCrashed
from grpo_lightning.integrations.sandbox.sandbox import SandboxConfig, SandboxError, run_tests

Tool = Callable[[str], str]


class ToolError(Exception):
    """A tool refused its input or failed; the message becomes the observation ``error: <message>``."""


class ToolBroken(EnvironmentCrashed):
    """The tool itself is broken (not the call): raised, it stops the rollout with one line naming the tool (exit
    status 4, ``errors.py``)."""


# ----------------------------------------------------------------------------------------------- calculator
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000
MAX_DIGITS = 1000
MAX_EXPRESSION_CHARS = 500
_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and abs(left) > 1 and isinstance(right, int):
            # Bounded before computing: log10(|a|^b) digits
            if right * math.log10(abs(left)) > MAX_DIGITS:
                raise ToolError(f"result has more than {MAX_DIGITS} digits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
        if isinstance(value, complex):
            raise ToolError("complex result")
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 4:
            raise ToolError(f"result has more than {MAX_DIGITS} digits")
        return value
    raise ToolError(f"unsupported expression: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (integers exact; a float with an integral value is shown as one)."""
    expression = expression.strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        # Leading zeros ("0639") are fine on a calculator, a syntax error in Python: dropped first.
        tree = ast.parse(_LEADING_ZEROS.sub("", expression.replace("^", "**")), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("result is not finite")
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


# --------------------------------------------------------------------------------------------------- python
class PythonTool:
    """Runs the argument as a Python program in the sandbox; its printed output is the result."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig(timeout_s=5.0, test_timeout_s=3.0)

    def bounded(self, seconds: float) -> PythonTool:
        """A copy whose sandbox ends the program within ``seconds`` (its wall clock and per-run timer)."""
        wall, per_run = min(self.config.timeout_s, seconds), min(self.config.test_timeout_s, seconds)
        return PythonTool(replace(self.config, timeout_s=wall, test_timeout_s=per_run))

    def __call__(self, code: str) -> str:
        try:
            result = run_tests(code, [""], "io", self.config)  # one run of the program, on empty stdin
        except SandboxError:
            raise
        except (OSError, RuntimeError, ValueError) as err:  # no process could start, an isolation level missing here
            raise ToolBroken(f"the sandbox cannot run here: {err}") from err
        if result.timed_out:
            raise ToolError(f"timed out after {self.config.test_timeout_s:g}s")
        if result.output_exceeded:
            raise ToolError("output limit exceeded")
        report = result.results[0] if result.results else {"ok": False}
        if not report.get("ok"):
            out = report.get("out", "").strip()
            raise ToolError("the program failed" + (f" after printing {out[-200:]!r}" if out else ""))
        return report.get("out", "").rstrip("\n")


# ------------------------------------------------------------------------------------------------- registry
def _python_tool() -> Tool:
    return PythonTool()


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": lambda: calculator, "python": _python_tool}


def resolve_tool(spec: str, setting: str = "data.environment.init_args.tools") -> Tool:
    """The tool ``spec`` names: a built-in (``calculator``, ``python``) or an import path ``pkg.mod:fn``."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]()
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        module_name, _, attribute = spec.rpartition(".")
    if not module_name or not attribute:
        raise ConfigError(
            f"{setting}: unknown tool {spec!r}; use {', '.join(BUILTIN_TOOLS)} or an import path pkg.module:fn"
        )
    try:
        fn: Any = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{setting}: cannot import the tool {spec!r}: {err}") from err
    if not callable(fn):
        raise ConfigError(f"{setting}: the tool {spec!r} is not callable")
    return fn
