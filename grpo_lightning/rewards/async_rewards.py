"""``async def`` reward functions: run together on one event loop (``asyncio.gather``), as TRL runs them.

The loop runs in a daemon thread that lasts as long as the process (a forked child starts its own). Why not a fresh
``asyncio.run`` per batch: async clients (``httpx``, ``openai``) bind their connection pools to the loop they first
ran on, so a reward that keeps a client across calls needs the same loop every round; TRL keeps one loop for the
same reason. Each function gets its own time limit (``asyncio.wait``; a timed-out call is cancelled). An async
function that blocks the loop (``time.sleep`` instead of ``await asyncio.sleep``) cannot be cancelled: the caller
stops waiting a while after the limit, reports it, and the next batch gets a new loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AsyncOutcome", "PendingRewards", "event_loop", "run_one", "start"]


@dataclass
class AsyncOutcome:
    """How one async reward call ended: a value, an exception, past its limit, or unknown (the loop was blocked)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    blocked: bool = False


_lock = threading.Lock()
_current: dict[str, Any] = {"pid": None, "loop": None, "thread": None}


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for async rewards, started on first use in a daemon thread."""
    with _lock:
        thread = _current["thread"]
        if _current["pid"] != os.getpid() or thread is None or not thread.is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, daemon=True, name="async-rewards")
            thread.start()
            _current.update(pid=os.getpid(), loop=loop, thread=thread)
        return _current["loop"]


def _discard(loop: asyncio.AbstractEventLoop) -> None:
    """Stop using ``loop`` (blocked by a call): it stops when the call lets it go; the next batch gets a new one."""
    with _lock:
        if _current["loop"] is loop:
            _current.update(pid=None, loop=None, thread=None)
    loop.call_soon_threadsafe(loop.stop)


async def _bounded(make: Callable[[], Awaitable[Any]], seconds: float | None) -> AsyncOutcome:
    try:
        task = asyncio.ensure_future(make())
    except Exception as err:  # the call itself failed (e.g. a missing argument)
        return AsyncOutcome(error=err)
    # asyncio.wait, not wait_for: a reward's own TimeoutError (an HTTP client's) must not read as ours.
    done, _ = await asyncio.wait({task}, timeout=seconds if seconds and seconds > 0 else None)
    if not done:
        task.cancel()
        return AsyncOutcome(timed_out=True)
    try:
        return AsyncOutcome(value=task.result())
    except Exception as err:
        return AsyncOutcome(error=err)
    except asyncio.CancelledError as err:  # the reward cancelled itself
        return AsyncOutcome(error=err)


@dataclass
class PendingRewards:
    """Async reward calls under way on the loop (:func:`start`); :meth:`wait` collects them."""

    future: concurrent.futures.Future
    loop: asyncio.AbstractEventLoop
    outcomes: list[AsyncOutcome | None]
    seconds: float | None

    def wait(self) -> list[AsyncOutcome]:
        """Every call's outcome. Without a time limit, waits as long as they take; with one, gives up a while after
        it (the loop is then blocked) and marks the calls that had not ended ``blocked``."""
        backstop = None if not self.seconds or self.seconds <= 0 else self.seconds + max(1.0, self.seconds)
        try:
            self.future.result(timeout=backstop)
        except concurrent.futures.TimeoutError:
            self.future.cancel()
            _discard(self.loop)
        except BaseException:
            self.future.cancel()
            raise
        return [outcome if outcome is not None else AsyncOutcome(blocked=True) for outcome in self.outcomes]

    def cancel(self) -> None:
        """Abandon the calls (the caller failed before collecting them)."""
        self.future.cancel()


def start(makers: list[Callable[[], Awaitable[Any]]], seconds: float | None) -> PendingRewards:
    """Start every ``make()`` on the loop at once, each limited to ``seconds``; returns without waiting."""
    outcomes: list[AsyncOutcome | None] = [None] * len(makers)

    async def one(index: int, make: Callable[[], Awaitable[Any]]) -> None:
        outcomes[index] = await _bounded(make, seconds)

    async def together() -> None:
        await asyncio.gather(*(one(i, make) for i, make in enumerate(makers)))

    loop = event_loop()
    return PendingRewards(asyncio.run_coroutine_threadsafe(together(), loop), loop, outcomes, seconds)


def run_one(make: Callable[[], Awaitable[Any]], seconds: float | None) -> AsyncOutcome:
    """One async call on the loop, limited to ``seconds``, waited for."""
    return start([make], seconds).wait()[0]
