"""The agents' HTTP gateway: an OpenAI-compatible endpoint that only the run's own sessions can use.

``Gateway`` is a stdlib ``ThreadingHTTPServer`` that lives for one round. It does no model work itself: a request
that passes its checks is queued, and the round's main thread (``integrations/agents/serving.py``) tokenizes it,
generates, records the call in its session and hands the answer back to the waiting handler. Routes, under a session's
base
URL ``http://HOST:PORT/s/<session>/v1``:

- ``POST .../chat/completions``, ``POST .../completions`` (served by ``serving.py``), ``GET .../models``.

Who may write training data through it:

- it binds ``127.0.0.1`` unless told otherwise (``AgentEnvironment``'s ``host``), on a free port;
- every request must carry ``Authorization: Bearer <token>``, a secret made for the gateway
  (``secrets.token_urlsafe(32)``) and handed to the run's agents only: without it, or with another, 401;
- the session in the path must be one the run opened and has not closed: an unknown one is 404, a closed one
  (its agent returned, or timed out) 403. A call is recorded only while its session is open, checked again when
  its completion is ready, so a request that outlives its session leaves no row.

A call is recorded only while its client still waits for the answer: a client that timed out (and retried: the
``openai`` client does, twice by default) has closed its connection, so its completion, which the agent never
saw, leaves no row; the main thread checks before generating and again before recording
(``PendingRequest.client_gone``), and counts it (``agent/abandoned_calls``).

Refused requests are counted (``refused``), for the round's ``agent/refused_requests``; requests that cannot be
read or served (``bad_requests``: a malformed ``Content-Length``, a body that is not JSON, ...) answered 400, for
``agent/bad_requests``. A fault of the gateway's own while handling a request is answered 500 and logged in one
line, never left unanswered.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import secrets
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.agents.calls import Call

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20  # a request body larger than this is refused (413): no agent sends that much text
ENDPOINTS = {"chat/completions": "chat", "completions": "completions"}


@dataclass
class Session:
    """One agent run: the calls it made, recorded in the order they were served."""

    id: str
    started: float = field(default_factory=time.monotonic)
    open: bool = True
    calls: list[Call] = field(default_factory=list)
    refused: int = 0  # requests refused because the session had hit its call limit


@dataclass
class PendingRequest:
    """A checked request waiting for the main thread's answer."""

    session: Session
    endpoint: str  # "chat" or "completions"
    body: dict[str, Any]
    connection: socket.socket | None = None  # the client's, while its handler waits (None: no client to lose)
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 500
    payload: dict[str, Any] = field(default_factory=dict)
    abandoned: bool = False  # its client had gone: nothing is written back

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        self.status, self.payload = status, payload
        self.done.set()

    def abandon(self) -> None:
        """Release the waiting handler without an answer: its client has gone."""
        self.abandoned = True
        self.done.set()

    def client_gone(self) -> bool:
        """Whether the client closed its connection (a timeout: it no longer waits for this answer).

        A client waiting for its answer sends nothing more, so its socket becomes readable only when it closes
        (end of stream, or a reset); the handler thread does not touch the socket meanwhile.
        """
        if self.connection is None:
            return False
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return not self.connection.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):  # reset by the peer, or already closed
            return True


def error(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped error body (the ``openai`` client raises it with this message)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class Gateway:
    """The HTTP side: sessions, the token, a queue of checked requests. See the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.token = secrets.token_urlsafe(32)
        self.sessions: dict[str, Session] = {}
        self.requests: queue.Queue[PendingRequest] = queue.Queue()
        self.lock = threading.Lock()
        self.refused, self.bad_requests = 0, 0
        self.closed = False
        server = _Server if ":" not in host else _IPv6Server
        try:
            self.server = server((host, port), _handler(self))
        except OSError as err:  # a port in use, an address this machine does not have
            raise ConfigError(f"data.environment.init_args.host/port: cannot listen on {host}:{port} ({err})") from err
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="agent-gateway", daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server is bound to."""
        return self.server.server_address[:2]

    def base_url(self, session: Session) -> str:
        """The session's OpenAI base URL (``base_url`` of ``openai.OpenAI``). A wildcard bind is reached locally."""
        host, port = self.address
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
        return f"http://{host}:{port}/s/{session.id}/v1"

    # ------------------------------------------------------------------------------------------ sessions
    def open_session(self) -> Session:
        """A new session (an unguessable id), open until ``close_session``."""
        session = Session(secrets.token_urlsafe(16))
        with self.lock:
            self.sessions[session.id] = session
        return session

    def close_session(self, session: Session) -> None:
        """No request of ``session`` is served or recorded any more."""
        with self.lock:
            session.open = False

    def record(self, session: Session, call: Call) -> bool:
        """Append ``call`` to ``session`` if it is still open; whether it was."""
        with self.lock:
            if session.open:
                session.calls.append(call)
            return session.open

    def refuse(self) -> None:
        with self.lock:
            self.refused += 1

    def bad_request(self) -> None:
        with self.lock:
            self.bad_requests += 1

    # ------------------------------------------------------------------------------------------ requests
    def check(self, path: str, authorization: str | None) -> tuple[int, dict[str, Any] | None, Session | None, str]:
        """``(status, error body or None, session, endpoint)`` for a request to ``path``."""
        if not hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode()):
            return 401, error("missing or wrong API key for this run's agent gateway", code="invalid_api_key"), None, ""
        parts = path.split("?", 1)[0].strip("/").split("/", 3)  # s, <session>, v1, <endpoint>
        if len(parts) != 4 or parts[0] != "s" or parts[2] != "v1":
            return 404, error(f"no such route {path!r}: use the session's base URL"), None, ""
        with self.lock:
            session = self.sessions.get(parts[1])
        if session is None:
            return 404, error("no such session: the run did not open it"), None, ""
        if not session.open:
            return 403, error("this session has ended: its calls are no longer served", code="session_ended"), None, ""
        return 200, None, session, parts[3]

    def next_requests(self, timeout: float) -> list[PendingRequest]:
        """Every queued request, waiting up to ``timeout`` seconds for the first."""
        try:
            pending = [self.requests.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                pending.append(self.requests.get_nowait())
            except queue.Empty:
                return pending

    def close(self) -> None:
        """Close every session, answer what is still queued (403), stop listening."""
        with self.lock:
            self.closed = True
            for session in self.sessions.values():
                session.open = False
        for request in self.next_requests(0.0):
            self.refuse()
            request.answer(403, error("the round has ended", code="session_ended"))
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler still waiting when the round ends does not hold the process
    request_queue_size = 1024  # every agent may connect at once: the default backlog of 5 resets the others

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed outside a request's handling (reset while its request line was read): one
        line in the debug log, not ``socketserver``'s traceback on standard error."""
        err = sys.exc_info()[1]
        log.debug("agent gateway: a connection failed: %s: %s", type(err).__name__, err)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


def content_length(headers: Any) -> tuple[int, tuple[int, dict[str, Any]] | None]:
    """The body's length from ``Content-Length`` (0 when absent), or the status and error that refuse it."""
    if "chunked" in (headers.get("Transfer-Encoding") or "").lower():
        return 0, (411, error("send the body with a Content-Length: a chunked body is not read"))
    raw = (headers.get("Content-Length") or "0").strip()
    if not (raw.isascii() and raw.isdigit()):  # int() would take "-5" (read to the end of the stream), "1_0"
        return 0, (400, error(f"Content-Length must be a number of bytes (got {raw[:40]!r})"))
    length = int(raw)
    if length > MAX_BODY_BYTES:
        return 0, (413, error(f"request body over {MAX_BODY_BYTES} bytes"))
    return length, None


def _handler(gateway: Gateway) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "grpo-lightning-agent-gateway"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.guarded(self.get)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.guarded(self.post)

        def guarded(self, handle: Any) -> None:
            """``handle()``; a fault of its own answered 500 and logged in one line (not a traceback)."""
            try:
                handle()
            except OSError as err:  # the client went away while it was answered: nobody to tell
                self.close_connection = True
                log.debug("agent gateway: %s: the client went away (%s)", self.command, err)
            except Exception as err:  # noqa: BLE001 - any fault: this request fails, the gateway goes on
                self.close_connection = True
                gateway.refuse()
                log.warning("agent gateway: a %s request failed: %s: %s", self.command, type(err).__name__, err)
                try:
                    self.reply(500, error(f"the agent gateway failed on this request: {type(err).__name__}: {err}"))
                except OSError:
                    pass

        def get(self) -> None:
            status, problem, session, endpoint = gateway.check(self.path, self.headers.get("Authorization"))
            if problem is None and endpoint != "models":
                status, problem = 404, error(f"no GET route {self.path!r}")
            if problem is not None:
                gateway.refuse()
                return self.reply(status, problem)
            self.reply(200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "grpo"}]})

        def post(self) -> None:
            status, problem, session, endpoint = gateway.check(self.path, self.headers.get("Authorization"))
            if problem is None and endpoint not in ENDPOINTS:
                status, problem = 404, error(f"no POST route {self.path!r}")
            if problem is not None:  # not the run's, or no such route: refused before its length is looked at
                gateway.refuse()
                self.close_connection = True  # its body is not read
                return self.reply(status, problem)
            length, unreadable = content_length(self.headers)
            if unreadable is not None:
                gateway.bad_request()
                self.close_connection = True  # its body is not read
                return self.reply(*unreadable)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError as err:
                gateway.bad_request()
                return self.reply(400, error(f"the body is not JSON: {err}"))
            if not isinstance(body, dict):
                gateway.bad_request()
                return self.reply(400, error("the body must be a JSON object"))
            request = PendingRequest(session, ENDPOINTS[endpoint], body, connection=self.connection)
            gateway.requests.put(request)
            while not request.done.wait(0.5):
                if gateway.closed:  # queued after the round's last look at the queue: nobody will serve it
                    gateway.refuse()
                    request.answer(403, error("the round has ended", code="session_ended"))
            if request.abandoned:  # its client has gone: nothing to write to
                self.close_connection = True
                return
            self.reply(request.status, request.payload)

        def reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            log.debug("agent gateway: " + format, *args)

    return Handler
