"""Hugging Face's ``math-verify`` as a backend of ``math_accuracy`` (the optional ``math`` extra).

``math_accuracy(backend=...)``: ``builtin`` (our own equivalence), ``math_verify``, or ``either`` (accepted when
one of them accepts). Every backend judges the answer that ``math_extract`` found, so ``<answer>`` tags, ``####``
and "The answer is" work with math-verify too; math-verify gets it, and the reference's answer, as ``\\boxed{…}``.

math-verify's own time limits use ``signal.alarm``: they fail outside the main thread, cancel an enclosing limit
such as ``score(timeout_s=...)``, and cannot stop one long C call (``9^{9^{9^{9}}}`` makes sympy compute a number
that never fits in memory). So its limits are off, and every check runs in a worker process that is killed when it
overruns ``timeout_s`` (or its 4 GiB address-space limit), from any thread; a fresh one starts at once.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import threading
from subprocess import DEVNULL, PIPE
from typing import Any

from grpo_lightning.rewards.combine import RewardError
from grpo_lightning.rewards.math_extract import check_modes

BACKENDS = ("builtin", "math_verify", "either")
INSTALL_HINT = "pip install 'grpo_lightning[math]'"

# The check, in source form so that the same code runs in the worker process (``python -I -c``).
_MV_CHECK = r"""
import json, re, sys
def wrap(answer):
    return "\\boxed{" + re.sub(r"(?<!\\)\$", "", answer) + "}"  # a bare $ is a math delimiter, \$ is currency
def mv_equal(pred, ref):
    from math_verify import parse, verify
    gold = parse(wrap(ref), parsing_timeout=None)
    target = parse(wrap(pred), parsing_timeout=None)
    return bool(gold) and bool(target) and bool(verify(gold, target, timeout_seconds=None))
if __name__ == "__main__":
    import logging, resource
    logging.disable(logging.CRITICAL)
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    import math_verify
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            ok = mv_equal(*json.loads(line))
        except Exception:
            ok = False
        print(json.dumps(ok), flush=True)
"""


@functools.cache
def _math_verify_missing() -> str | None:
    """None when math-verify (and the LaTeX parser it needs) imports, else the import error."""
    try:
        import math_verify  # noqa: F401
        from latex2sympy2_extended import latex2sympy  # noqa: F401
    except ImportError as err:
        return str(err)
    return None


def check_math_kwargs(**kwargs: Any) -> None:
    """Refuse, in one line (:class:`RewardError`), ``math_accuracy`` settings that cannot work.

    An unknown ``backend`` or extraction mode, or a ``math_verify`` / ``either`` backend without the math-verify
    package installed. ``RewardSpec.build`` calls it, so a bad setting stops the run before training starts.
    """
    backend = kwargs.get("backend", "builtin")
    if backend not in BACKENDS:
        raise RewardError(f"math_accuracy: unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    try:
        check_modes(kwargs.get("modes", ()))
    except ValueError as err:
        raise RewardError(f"math_accuracy: {err}") from None
    if backend != "builtin" and (missing := _math_verify_missing()) is not None:
        raise RewardError(
            f"math_accuracy backend {backend!r} needs the math-verify package, which cannot be imported "
            f"({missing}): {INSTALL_HINT}"
        )


class Worker:
    """A long-lived ``python -I -c source`` process answering one JSON line per request line.

    A request that takes longer than its time limit kills the process and starts the next one at once, so that
    its imports overlap with the caller's work. A forked child starts its own instead of sharing its parent's.
    """

    def __init__(self, source: str, name: str, hint: str = "", start_timeout_s: float = 120.0) -> None:
        self.source, self.name, self.hint, self.start_timeout_s = source, name, hint, start_timeout_s
        self.process: subprocess.Popen | None = None
        self.ready, self.owner = False, 0
        self.lock = threading.Lock()

    def _start(self) -> None:
        command = [sys.executable, "-I", "-c", self.source]
        self.process = subprocess.Popen(command, stdin=PIPE, stdout=PIPE, stderr=DEVNULL, text=True)
        self.ready, self.owner = False, os.getpid()

    def _read_line(self, timeout_s: float) -> str | None:
        assert self.process is not None and self.process.stdout is not None
        if select.select([self.process.stdout], [], [], timeout_s)[0]:
            return self.process.stdout.readline() or None
        return None

    def _restart(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self._start()

    def ask(self, request: list, timeout_s: float) -> Any:
        """The worker's answer to ``request``, or None when it did not answer within ``timeout_s``."""
        with self.lock:
            if self.process is None or self.owner != os.getpid() or self.process.poll() is not None:
                self._start()
            if not self.ready:
                if self._read_line(self.start_timeout_s) is None:
                    self.process.kill()
                    self.process.wait()
                    self.process = None
                    hint = f" ({self.hint})" if self.hint else ""
                    raise RewardError(f"math_accuracy: the {self.name} worker process did not start{hint}")
                self.ready = True
            assert self.process is not None and self.process.stdin is not None
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
                line = self._read_line(timeout_s)
            except (BrokenPipeError, OSError):
                line = None
            if line is None:
                self._restart()
                return None
            return json.loads(line)

    def stop(self) -> None:
        """Kill the process (the next request starts a new one)."""
        with self.lock:
            if self.process is not None and self.owner == os.getpid():
                self.process.kill()
                self.process.wait()
            self.process = None


_WORKER = Worker(_MV_CHECK, "math-verify", INSTALL_HINT)


def stop_worker() -> None:
    """Stop the math-verify worker process (the next check starts a new one) and forget cached verdicts."""
    _WORKER.stop()
    math_verify_equivalent.cache_clear()


@functools.lru_cache(maxsize=8192)
def math_verify_equivalent(pred: str, ref: str, timeout_s: float = 2.0) -> bool:
    """Whether math-verify finds the extracted answer ``pred`` equal to the reference answer ``ref``.

    Both are parsed as ``\\boxed{…}`` and compared with ``math_verify.verify(gold, target)`` in the worker process,
    stopped after ``timeout_s`` seconds (parsing included): False when it runs out. Needs the ``math`` extra.
    """
    if _math_verify_missing() is not None:
        check_math_kwargs(backend="math_verify")  # raises the one-line error
    return _WORKER.ask([pred, ref], timeout_s) is True
