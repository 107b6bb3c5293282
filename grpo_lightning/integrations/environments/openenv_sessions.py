"""OpenEnv sessions: one per trajectory, on one event loop shared by an ``OpenEnvEnvironment``'s copies.

``OpenEnvBackend`` is what the copies share: the event loop thread their sessions run on, the server the run
started (``local_server.py``), if any, and the sessions open now. ``OpenEnvSession`` is one trajectory's session: a
client of the configured class connected to the server, reset, stepped, closed.

Faults: every request is bounded by ``timeout_s``; a refused connection, a timeout, an error the server answers
(its environment raised) or a dropped session is retried ``max_retries`` times (``with_retries``, pauses of 0.25 s,
0.5 s, ...) on a new session, reset with the same arguments and the trajectory's actions replayed, each answer
compared with the first time's (metadata aside): a replay that answers differently is reported, never continued as
another episode. Then one line naming the environment and its URL: a ``ServiceError`` when the server could not
be reached, answered too late or was at capacity, an ``EnvironmentCrashed`` when the environment itself raised on the
server (or could not be made) or a replay diverged (``errors.py``: exit status 3 and 4). A server of the run's own
that has exited is reported at once (``EnvironmentCrashed``), with its exit code and last output; a request the
server refuses as invalid is a ``ConfigError``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
import urllib.error
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.errors import EnvironmentCrashed, ServiceError
from grpo_lightning.integrations.environments.local_server import LocalServer, open_url

SETTING = "data.environment.init_args"
_SERVER_ERROR = re.compile(r"\(code: ([A-Z_]+)\)\s*$")  # how an OpenEnv client words an error the server answered
# The codes (openenv's ``WSErrorCode``) of an answer that says the environment itself failed: it raised in reset or
# step, or could not be made. The others (capacity, a session error) and no answer at all are the service's.
_ENVIRONMENT_FAILED = ("EXECUTION_ERROR", "FACTORY_ERROR")


def one_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name when it has none)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def jsonable(value: Any) -> Any:
    """A pydantic model (a typed observation) as a dict; anything else as it is."""
    return value.model_dump() if hasattr(value, "model_dump") else value


def _answer(result: Any) -> dict[str, Any]:
    return {"observation": jsonable(result.observation), "reward": result.reward, "done": bool(result.done)}


def _replayable(answer: dict[str, Any]) -> dict[str, Any]:
    """What a replayed answer must repeat: all but the metadata (which may hold ids or timings of its own)."""
    observation = answer["observation"]
    if isinstance(observation, Mapping):
        observation = {k: v for k, v in observation.items() if k != "metadata"}
    return {**answer, "observation": observation}


async def _called(function: Callable[[], Any]) -> Any:
    return function()


class _Diverged(Exception):
    """A replayed session answered differently from the first one: the trajectory cannot be recovered."""


def get_json(url: str, timeout_s: float) -> dict[str, Any] | None:
    """``GET url`` as JSON; None when the server has no such route (404)."""
    try:
        with open_url(url, timeout_s) as response:
            return json.loads(response.read().decode() or "null")
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise ServiceError(f"GET {url}: HTTP {err.code}") from err


class OpenEnvBackend:
    """What every trajectory's copy of one ``OpenEnvEnvironment`` shares (see the module docstring)."""

    def __init__(self, url: str | None, server: list[str] | None, startup_timeout_s: float) -> None:
        self.fixed_url, self.server_argv, self.startup_timeout_s = url, server, startup_timeout_s
        self.server = LocalServer(server, "OpenEnv", startup_timeout_s) if server else None
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.sessions: set[Any] = set()  # the clients connected now
        self.checked = False  # the server's schema was checked against the settings

    def __reduce__(self) -> tuple:
        # Pickled into a background rollout process: a fresh backend there, which starts what it needs when used.
        return (OpenEnvBackend, (self.fixed_url, self.server_argv, self.startup_timeout_s))

    def describe(self, client_class: type) -> str:
        """How messages name the environment: its URL and client class."""
        url = self.server.url if self.server is not None else self.fixed_url
        return f"the OpenEnv environment at {url or 'a server not started yet'} ({client_class.__name__})"

    def url(self) -> str:
        """The server's URL; a server of the run's own is started on first use, and refused once it has exited."""
        if self.server is None:
            return self.fixed_url or ""
        with self.lock:
            if self.server.url is None:
                # Started from the sessions' thread, which lives until ``close``: the server's parent-death signal
                # follows the thread that started it, and a rollout's worker thread may end before the run does.
                asyncio.run_coroutine_threadsafe(_called(self.server.start), self._loop()).result()
            elif not self.server.alive:
                raise EnvironmentCrashed(
                    f"data.environment: the OpenEnv server the run started at {self.server.url} {self.server.failure()}"
                )
            return self.server.url

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, name="openenv-sessions", daemon=True)
            self.thread.start()
        return self.loop

    def run(self, coroutine: Awaitable[Any]) -> Any:
        """Runs ``coroutine`` on the sessions' event loop; its result (or exception), in the calling thread."""
        with self.lock:
            loop = self._loop()
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    def close(self) -> None:
        """Closes the open sessions, stops the event loop and the server the run started; idempotent."""
        if self.loop is not None:
            sessions, self.sessions = list(self.sessions), set()

            async def close_all() -> None:
                await asyncio.gather(*(asyncio.wait_for(s.close(), 5) for s in sessions), return_exceptions=True)

            self.run(close_all())
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self.thread is not None:
                self.thread.join(timeout=5)
            self.loop.close()
            self.loop, self.thread = None, None
        if self.server is not None:
            self.server.stop()
            self.server = LocalServer(self.server_argv, "OpenEnv", self.startup_timeout_s)  # a later use restarts


def with_retries(
    what: str,
    call: Callable[[str], Any],
    *,
    backend: OpenEnvBackend,
    where: Callable[[], str],
    timeout_s: float,
    max_retries: int,
    on_retry: Callable[[], None] = lambda: None,
) -> Any:
    """``call(url)``, tried ``1 + max_retries`` times on a fault of the server or the connection (``on_retry``
    before each retry); then one line naming the environment (``where()``) and the fault: ``EnvironmentCrashed``
    when the environment itself failed on the server (the last answer's code), else ``ServiceError``."""
    import websockets.exceptions  # openenv's transport (one of its dependencies)

    faults = (OSError, RuntimeError, asyncio.TimeoutError, websockets.exceptions.WebSocketException)
    reason, failed = "", ServiceError
    for attempt in range(max_retries + 1):
        url = backend.url()  # a server of the run's own: started, or its exit reported now
        try:
            return call(url)
        except _Diverged as err:
            raise EnvironmentCrashed(
                f"data.environment: {where()} dropped a trajectory's session and {err} (reset or step is not "
                "deterministic; pass the seed to reset through init_args.reset_columns)"
            ) from err
        except faults as err:
            reason, code = one_line(err), _SERVER_ERROR.search(str(err))
            if code and code.group(1) == "VALIDATION_ERROR":
                raise ConfigError(
                    f"{SETTING}: {where()} refused the {what} request as invalid ({reason}); check action_field "
                    "(the action's text field) and reset_columns"
                ) from err
            failed = EnvironmentCrashed if code and code.group(1) in _ENVIRONMENT_FAILED else ServiceError
            if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
                reason = f"no answer within timeout_s = {timeout_s:g}s"
            if attempt < max_retries:
                on_retry()
                time.sleep(min(0.25 * 2**attempt, 4.0))
    backend.url()  # a server of the run's own that has exited: its exit code rather than the symptom
    advice = (
        "the server serves fewer sessions at once than a round has trajectories: start it with "
        "max_concurrent_envs >= data.prompts_per_round × data.sampling.group_size"
        if "CAPACITY" in reason
        else "check the server, or raise init_args.timeout_s / max_retries"
    )
    tries = f"{max_retries + 1} tries"
    raise failed(f"data.environment: {where()} failed to {what} after {tries} ({reason}); {advice}")


class OpenEnvSession:
    """One trajectory's session: ``reset``, ``step`` (each answer as ``{observation, reward, done}``), ``close``."""

    def __init__(self, backend: OpenEnvBackend, client_class: type, timeout_s: float, max_retries: int) -> None:
        self.backend, self.client_class = backend, client_class
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.client: Any = None
        self.reset_kwargs: dict[str, Any] = {}
        self.reset_answer: dict[str, Any] | None = None
        self.history: list[tuple[Any, dict[str, Any]]] = []  # the actions sent and their answers, for a replay
        self.retries = 0

    def _retrying(self, what: str, operation: Callable[[str], Awaitable[Any]]) -> Any:
        def counted() -> None:
            self.retries += 1

        return with_retries(
            what,
            lambda url: self.backend.run(self._guarded(operation(url))),
            backend=self.backend,
            where=lambda: self.backend.describe(self.client_class),
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            on_retry=counted,
        )

    def reset(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Opens the session and resets it with ``kwargs``; reset's answer."""
        self.reset_kwargs, self.reset_answer, self.history = dict(kwargs), None, []
        self.reset_answer = self._retrying("reset", self._open)
        return self.reset_answer

    def step(self, action: Any) -> dict[str, Any]:
        """Sends ``action``; the answer."""
        answer = self._retrying("step", lambda url: self._step(url, action))
        self.history.append((action, answer))
        return answer

    def close(self) -> None:
        """Closes the session (best effort: a session is gone either way)."""
        if self.client is not None:
            self.backend.run(self._drop())

    def _new_client(self, url: str) -> Any:
        parameters = inspect.signature(self.client_class).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        wanted = {"connect_timeout_s": self.timeout_s, "message_timeout_s": self.timeout_s}
        return self.client_class(base_url=url, **{k: v for k, v in wanted.items() if takes_all or k in parameters})

    async def _timed(self, awaitable: Awaitable[Any]) -> Any:
        return await asyncio.wait_for(awaitable, self.timeout_s)

    async def _open(self, url: str) -> dict[str, Any]:
        """A new session, reset; after a fault, the trajectory's actions replayed on it (each answer compared)."""
        self.client = self._new_client(url)
        self.backend.sessions.add(self.client)
        await self._timed(self.client.connect())
        answer = _answer(await self._timed(self.client.reset(**self.reset_kwargs)))
        if self.reset_answer is not None and _replayable(answer) != _replayable(self.reset_answer):
            raise _Diverged("reset answered differently on a new session")
        for k, (action, expected) in enumerate(self.history):
            replayed = _answer(await self._timed(self.client.step(action)))
            if _replayable(replayed) != _replayable(expected):
                raise _Diverged(f"step {k + 1} answered differently when replayed on a new session")
        return answer

    async def _step(self, url: str, action: Any) -> dict[str, Any]:
        if self.client is None:  # the session was dropped by a fault: a new one, where the trajectory was
            await self._open(url)
        return _answer(await self._timed(self.client.step(action)))

    async def _guarded(self, operation: Awaitable[Any]) -> Any:
        """``operation``; a session it leaves in doubt (any failure) is dropped, so that a retry opens a new one."""
        try:
            return await operation
        except BaseException:
            await self._drop()
            raise

    async def _drop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            self.backend.sessions.discard(client)
            try:
                await asyncio.wait_for(client.close(), min(self.timeout_s, 5.0))
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - best effort: the session is gone either way
                pass
