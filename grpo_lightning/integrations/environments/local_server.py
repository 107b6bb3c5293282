"""An environment server the run starts and stops itself: an ASGI app (``pkg.module:app``) or a command.

``LocalServer.start`` runs the server on a free localhost port and waits until it answers ``GET /health`` (or
``startup_timeout_s`` passes, or it exits: then one line with its exit code and the end of its output). It is
stopped, with whatever it started, by ``stop`` (the environment's ``close``), at the interpreter's exit (``atexit``:
also after an exception), and when the process that started it dies (``PR_SET_PDEATHSIG`` on Linux, set before the
server's command runs: a trainer killed with SIGKILL leaves no server behind). It runs in a session of its own, so
``stop`` ends its whole process group (a server that forks workers).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import IO, Any

from grpo_lightning.config import ConfigError
from grpo_lightning.errors import EnvironmentCrashed, ServiceError

PORT = "{port}"  # where a command takes the port the run chose
# Run before the server's command: asks the kernel to SIGTERM it when its parent dies (Linux), checks that the
# parent did not die before that (then nothing would), then becomes the command (exec: the same process).
_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "except (AttributeError, OSError):\n"
    "    pass  # not Linux: stop and atexit only\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def server_command(server: str | list[str], setting: str) -> list[str]:
    """The argv of ``server``: ``pkg.module:app`` (an ASGI app, served by uvicorn), a command line, or a list of
    arguments; a command writes ``{port}`` where it takes the port. ``ConfigError`` (one line) otherwise."""
    if isinstance(server, str) and server.strip() and " " not in server.strip() and ":" in server:
        module, _, app = server.strip().partition(":")
        if not module or not app:
            raise ConfigError(f"{setting}: {server!r} is not pkg.module:app")
        uvicorn = [sys.executable, "-m", "uvicorn", server.strip(), "--host", "127.0.0.1", "--port", PORT]
        return [*uvicorn, "--log-level", "warning"]  # not a line per session: its errors are what failures quote
    argv = shlex.split(server) if isinstance(server, str) else list(server or [])
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise ConfigError(f"{setting} must be pkg.module:app or a command (a string or a list of strings)")
    if not any(PORT in arg for arg in argv):
        raise ConfigError(f"{setting}: write {PORT} where the command takes its port (got {shlex.join(argv)!r})")
    return argv


def open_url(url: str, timeout_s: float) -> Any:
    """``urllib.request.urlopen(url)``, past any HTTP proxy of the environment for a localhost URL (a proxy would
    answer for the local server, or refuse)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("localhost", "127.0.0.1", "::1"):
        return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=timeout_s)
    return urllib.request.urlopen(url, timeout=timeout_s)


def free_port() -> int:
    """A localhost port nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalServer:
    """One server process on ``127.0.0.1`` (see the module docstring); ``start`` returns its URL."""

    def __init__(self, argv: list[str], name: str, startup_timeout_s: float = 120.0) -> None:
        """``argv``: the command (``{port}`` in it); ``name``: what error messages call it."""
        self.argv, self.name, self.startup_timeout_s = argv, name, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.log: IO[bytes] | None = None  # the server's output: a file already unlinked, read through this handle

    def start(self) -> str:
        """Starts the server and waits until it is ready; its URL. A server that exits (``EnvironmentCrashed``) or
        does not answer within ``startup_timeout_s`` (``ServiceError``) is stopped and reported in one line."""
        port = free_port()
        argv = [arg.replace(PORT, str(port)) for arg in self.argv]
        handle, path = tempfile.mkstemp(prefix="grpo-env-server-", suffix=".log")
        # Unlinked at once, read through an open handle: nothing is left on disk however this process ends.
        self.log, self.url = open(path, "rb"), f"http://127.0.0.1:{port}"  # kept open until stop
        os.unlink(path)
        with os.fdopen(handle, "wb") as log:
            launcher = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *argv]
            self.process = subprocess.Popen(
                launcher, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._answers():
            if self.process.poll() is not None:
                reason = self.failure()
                self.stop()
                raise EnvironmentCrashed(f"data.environment: the {self.name} server ({shlex.join(argv)}) {reason}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(
                    f"data.environment: the {self.name} server ({shlex.join(argv)}) did not answer {self.url}/health "
                    f"within {self.startup_timeout_s:g}s; raise init_args.startup_timeout_s if it starts slowly"
                )
            time.sleep(0.1)
        return self.url

    def _answers(self) -> bool:
        try:
            with open_url(f"{self.url}/health", 2.0) as response:
                return response.status == 200
        except urllib.error.HTTPError as err:  # it answers, without a health route: ready all the same
            return err.code == 404
        except (OSError, ValueError):
            return False

    @property
    def alive(self) -> bool:
        """Started and not exited."""
        return self.process is not None and self.process.poll() is None

    def failure(self) -> str:
        """How the exited server ended: its exit code and the last line of its output."""
        code = self.process.poll() if self.process is not None else None
        lines = []
        if self.log is not None:
            self.log.seek(0)
            lines = [line for line in self.log.read().decode(errors="replace").splitlines() if line.strip()]
        said = f"; its last output: {lines[-1].strip()}" if lines else ""
        return f"exited with code {code}{said}"

    def stop(self) -> None:
        """Stops the server's process group (SIGTERM, then SIGKILL after 5 s) and closes its log; idempotent."""
        process, self.process = self.process, None
        atexit.unregister(self.stop)
        if process is not None and process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                try:
                    process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # what it started and left behind
        if self.log is not None:
            self.log.close()
            self.log = None
