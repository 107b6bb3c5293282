"""Time limits for reward functions and the code they call: :func:`time_limit` (SIGALRM, main thread) and
:func:`call_with_time_limit` (a daemon thread elsewhere). ``score(..., timeout_s=...)``, the math reward's sympy
checks and the tool environment use them.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class TimeLimitExceeded(BaseException):
    """Raised inside code that ran past a :func:`time_limit`.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that a reward function's own ``except Exception`` does not
    swallow it.
    """

    def __init__(self, seconds: float, token: object = None) -> None:
        super().__init__(f"ran longer than {seconds:g}s")
        self.seconds, self.token = seconds, token


def alarm_available() -> bool:
    """Whether :func:`time_limit` can interrupt code here: POSIX ``setitimer``, called from the main thread."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[object | None]:
    """Raise :class:`TimeLimitExceeded` in the block when it runs longer than ``seconds`` (wall clock).

    Uses ``SIGALRM`` via ``setitimer``, so it works only in the main thread (check :func:`alarm_available`;
    elsewhere the block runs without a limit) and interrupts Python code, not one long C call. Limits nest: an
    outer limit that expires first still fires, and the outer timer is re-armed when the inner block ends. The
    block gets a token (None when no timer of its own was set): ``err.token is token`` tells this limit's
    expiry from an enclosing one's.
    """
    if seconds is None or seconds <= 0 or not alarm_available():
        yield None
        return
    outer_remaining, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_remaining and outer_remaining <= seconds:
        yield None  # the enclosing limit ends first and raises its own exception
        return
    token = object()
    closed = [False]

    def on_alarm(signum: int, frame: Any) -> None:
        handling = sys.exc_info()[1]
        if closed[0] or (isinstance(handling, TimeLimitExceeded) and handling.token is token):
            return  # the block is ending, or this limit's exception is already on its way out of it
        raise TimeLimitExceeded(seconds, token)

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    # Fires again every ``min(seconds, 0.1)`` until the block ends. Why: Python discards an exception raised inside a
    # finalizer (``__del__``, weakref callbacks, run by the garbage collector at any allocation) or C code that
    # clears errors; the alarm lands there now and then, and a one-shot timer then let the block run to its end
    # (a sympy check limited to 0.3 s ran its full 7 s in the test suite, among torch's and Lightning's objects).
    signal.setitimer(signal.ITIMER_REAL, seconds, min(seconds, 0.1))
    try:
        yield token
    finally:
        closed[0] = True  # first: no further alarm raises, whatever is pending
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_remaining:
            remaining = max(outer_remaining - (time.monotonic() - start), 1e-4)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def call_with_time_limit(fn: Callable[..., Any], seconds: float | None, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, raising :class:`TimeLimitExceeded` after ``seconds``.

    In the main thread the call is interrupted by :func:`time_limit`. Elsewhere it runs in a daemon thread that
    is abandoned (not stopped: Python cannot kill a thread) when the limit passes.
    """
    if seconds is None or seconds <= 0:
        return fn(*args, **kwargs)
    if alarm_available():
        try:
            with time_limit(seconds) as token:
                return fn(*args, **kwargs)
        except TimeLimitExceeded as err:
            if token is not None and err.token is token:
                raise TimeLimitExceeded(seconds) from None
            raise
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the caller's thread below
            result["error"] = err

    worker = threading.Thread(target=target, daemon=True, name="reward-time-limit")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeLimitExceeded(seconds)
    if "error" in result:
        raise result["error"]
    return result["value"]
