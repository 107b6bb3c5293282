"""JSON over HTTP to one vLLM server, with bounded retries; the standard library only.

A server that is down, drops a connection, answers 5xx or is slower than the time limit is retried (1, 2, 4, ...
seconds apart, ``retries`` times), then ``ServerError`` names it in one line. A 4xx answer is the request's fault:
no retry, the server's message in the error. Proxies from the environment are not used: the servers are reached
directly (a cluster's HTTP proxy rarely knows its compute nodes).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

from grpo_lightning.errors import ServiceError

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(ServiceError):
    """A vLLM server that cannot be used (down, dead, restarted, too slow, refusing): the run stops with this one
    line, which names the server (exit status 3, ``errors.py``). ``status``: the HTTP status of a refusal (None for
    the other faults)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerClient:
    """One server at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, *, timeout_s: float, retries: int, backoff_s: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def __repr__(self) -> str:
        return self.base_url

    def get(self, path: str, *, timeout_s: float | None = None, retry: bool = True) -> Any:
        return self.request("GET", path, None, timeout_s=timeout_s, retry=retry)

    def post(self, path: str, body: Any = None, *, timeout_s: float | None = None, retry: bool = True) -> Any:
        return self.request("POST", path, {} if body is None else body, timeout_s=timeout_s, retry=retry)

    def request(
        self,
        method: str,
        path: str,
        body: Any,
        *,
        timeout_s: float | None = None,
        retry: bool = True,
        before_retry: Any = None,
    ) -> Any:
        """The decoded JSON answer. ``before_retry()`` runs before each retry (it may raise to stop retrying)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))
                if before_retry is not None:
                    before_retry()
            try:
                return self._once(method, path, body, timeout)
            except urllib.error.HTTPError as err:
                detail = _detail(err)
                if err.code < 500:
                    message = f"the vLLM server {self.base_url} refused {method} {path}: {detail}"
                    raise ServerError(message, status=err.code) from None
                problem = f"answered {err.code} ({detail})"
            except TimeoutError:
                problem = f"gave no answer within {timeout:g} s"
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError) as err:
                reason = getattr(err, "reason", err)
                problem = f"is unreachable ({reason})"
        tries = f" after {attempts} tries" if attempts > 1 else ""
        raise ServerError(f"the vLLM server {self.base_url} {problem} on {method} {path}{tries}")

    def _once(self, method: str, path: str, body: Any, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with _OPENER.open(request, timeout=timeout) as answer:
            raw = answer.read()
        return json.loads(raw) if raw else None

    def wait_until_up(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200 (a server still loading its model), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        problem = "did not answer"
        while True:
            try:
                self._once("GET", "/health", None, min(10.0, max(timeout_s, 1.0)))
                return
            except Exception as err:  # noqa: BLE001 - any failure means: not up yet
                problem = f"did not answer ({getattr(err, 'reason', err)})"
            if time.monotonic() > deadline:
                raise ServerError(
                    f"data.engine: the vLLM server {self.base_url} {problem} within {timeout_s:g} s "
                    "(data.engine.init_args.connect_timeout_s): start it first (docs/vllm.md, vLLM servers) or fix "
                    "data.engine.init_args.base_urls"
                )
            time.sleep(1.0)


def _detail(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        return str(err.reason)
    message = body.get("detail") or body.get("error") or body.get("message") or err.reason
    if isinstance(message, dict):
        message = message.get("message", message)
    return " ".join(str(message).split())[:500]
