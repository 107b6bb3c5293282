"""Run untrusted, model-written Python against tests in a separate, limited process.

One process per call, started with a scrubbed environment (no API keys: the parent's variables are not passed) in
its own session. What limits it depends on the isolation level, chosen by ``isolation="auto"``:

* ``namespaces`` (root and ``unshare`` available): new network, PID, mount and IPC namespaces; every mount
  re-mounted read-only, fresh tmpfs on ``/tmp``, ``/var/tmp`` and ``/dev/shm``, a fresh ``/proc``; the code runs as
  a throw-away uid whose only writable place is ``/tmp/sandbox`` (a size-capped tmpfs, discarded with the
  namespace). When the harness (PID 1 of its namespace) ends or is killed, the kernel kills every process left.
* ``process``: resource limits, own session, a uid drop and a sweep of that uid's processes when running as root;
  no network / filesystem isolation beyond file permissions, so the Python guards (in the child) stop the rest.

Always: RLIMIT_AS/CPU/FSIZE/NOFILE/CORE (NPROC with a uid of its own), a wall clock enforced by the parent, a
per-test timer, capped output. ``guards=True`` adds an audit hook (best effort, bypassable through ``ctypes``) that
refuses sockets, new processes, signals and writes outside the work directory. docs/rewards.md has the full table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from grpo_lightning.errors import ConfigError, EnvironmentCrashed

logger = logging.getLogger(__name__)
Isolation = Literal["auto", "namespaces", "process"]
_UNSHARE_FLAGS = ("--net", "--pid", "--mount", "--ipc", "--fork", "--kill-child")
_NS_WORKDIR = "/tmp/sandbox"
_PREIMPORT = (
    "array bisect cmath collections copy dataclasses datetime decimal encodings.idna enum fractions functools heapq "
    "itertools json math numbers operator queue random re signal socket statistics string struct subprocess textwrap "
    "time typing unicodedata"
)
# The program the child runs (isolation, privilege drop, the tests): a file shipped with the package, read once and
# passed to ``python -I -B -c``, as it was when it stood here as a string.
_HARNESS = (resources.files("grpo_lightning") / "assets" / "sandbox_child.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run (all of a completion's tests run in one process)."""

    timeout_s: float = 10.0  # wall clock for the whole process, enforced by the parent
    test_timeout_s: float = 3.0  # per test, by a timer inside the process
    memory_mb: int = 1024  # RLIMIT_AS
    max_output_bytes: int = 1_000_000  # captured stdout (and stderr) per test
    max_processes: int = 64  # RLIMIT_NPROC, only when the code runs under a uid of its own
    max_file_mb: int = 16  # RLIMIT_FSIZE
    tmpfs_mb: int = 64  # size of the work directory's tmpfs (namespaces only)
    isolation: Isolation = "auto"
    guards: bool = True


@dataclass
class RunResult:
    """What one run reported: one dict per test (``ok``, plus ``out`` for stdin/stdout tests) in test order."""

    results: list[dict[str, Any]] = field(default_factory=list)
    timed_out: bool = False
    output_exceeded: bool = False
    returncode: int | None = None
    stderr: str = ""
    isolation: str = "process"
    uid: int | None = None
    pgid: int | None = None


class SandboxError(EnvironmentCrashed):
    """The sandbox itself failed (before the code ran), as opposed to the code failing its tests (exit status 4,
    ``errors.py``)."""


@functools.lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether the sandbox works in new namespaces here: root, ``unshare`` and a trial run that passes."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        trial = _run("x = 1", ["assert x == 1"], "assert", SandboxConfig(timeout_s=30), "namespaces")
    except (OSError, SandboxError) as err:
        logger.warning("sandbox: namespaces unavailable, falling back to process isolation (%s)", err)
        return False
    return trial.results == [{"ok": True, "out": ""}]


def resolve_isolation(isolation: Isolation) -> Literal["namespaces", "process"]:
    """The isolation level ``auto`` stands for here; an error when ``namespaces`` is asked for and unavailable."""
    if isolation == "auto":
        return "namespaces" if namespaces_available() else "process"
    if isolation == "namespaces" and not namespaces_available():
        raise ConfigError("sandbox isolation 'namespaces' needs root and a working `unshare`; use 'auto' or 'process'")
    if isolation not in ("namespaces", "process"):
        raise ValueError(f"isolation must be 'auto', 'namespaces' or 'process' (got {isolation!r})")
    return isolation


def _hidden_roots() -> list[str]:
    """Python install directories that other users cannot reach (e.g. under a 0700 ``/root``)."""
    roots = dict.fromkeys(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix))
    hidden = lambda path: not os.stat(path).st_mode & stat.S_IXOTH  # noqa: E731
    return [root for root in roots if any(hidden(p) for p in (root, *map(str, Path(root).parents)))]


def leftover_pids(pgid: int | None, uid: int | None) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid`` or running as ``uid``."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":
                continue
            if int(fields[2]) == pgid or (uid is not None and f"\t{uid}\t" in _status_line(entry, "Uid:")):
                pids.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _status_line(pid: str, key: str) -> str:
    with open(f"/proc/{pid}/status") as handle:
        return next((line + "\t" for line in handle if line.startswith(key)), "")


def _kill_leftovers(pgid: int | None, uid: int | None) -> None:
    """SIGKILL the process group and every process of the sandbox's uid, until none is left alive (≤ 2 s)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # a fork bomb may still be forking while we sweep
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        pids = leftover_pids(pgid, uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout / stderr until the harness says done, both close, the deadline passes or ``cap`` is exceeded."""
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    timed_out = exceeded = False
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map() and b'{"done": true}' not in buffers[proc.stdout]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fileobj] += chunk
                exceeded = exceeded or len(buffers[key.fileobj]) > cap
            if exceeded:
                break
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), timed_out, exceeded


def run_tests(code: str, tests: list[Any], kind: Literal["assert", "io"], config: SandboxConfig) -> RunResult:
    """Run ``code`` then each test in one sandboxed process and return what it reported.

    ``kind="assert"``: each test is a statement (usually an ``assert``) run after the code, in its namespace.
    ``kind="io"``: each test is a stdin string; the code runs afresh on it and its stdout comes back as ``out``.
    A test without a report (the process died, was killed or timed out) counts as failed.
    """
    return _run(code, tests, kind, config, resolve_isolation(config.isolation))


def _run(code: str, tests: list[Any], kind: str, config: SandboxConfig, isolation: str) -> RunResult:
    root = os.name == "posix" and os.geteuid() == 0
    uid = random.SystemRandom().randrange(2_000_000, 2_000_000_000) if root else None
    host_dir = None if isolation == "namespaces" else tempfile.mkdtemp(prefix="grpo-sandbox-")
    workdir = _NS_WORKDIR if host_dir is None else host_dir
    payload = {
        "code": code,
        "tests": tests,
        "kind": kind,
        "workdir": workdir,
        "namespaces": isolation == "namespaces",
        "uid": uid,
        "hidden_roots": _hidden_roots() if uid is not None else [],
        "preimport": _PREIMPORT if uid is not None and isolation == "process" else "",
        "test_timeout": config.test_timeout_s,
        "max_output": config.max_output_bytes,
        "tmpfs_mb": config.tmpfs_mb,
        "guards": config.guards,
        "rlimits": {
            "RLIMIT_AS": config.memory_mb << 20,
            "RLIMIT_CPU": int(config.timeout_s) + 1,
            "RLIMIT_FSIZE": config.max_file_mb << 20,
            "RLIMIT_NOFILE": 256,
            "RLIMIT_CORE": 0,
            **({"RLIMIT_NPROC": config.max_processes} if uid is not None else {}),
        },
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    env.update({"PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    command = [sys.executable, "-I", "-B", "-c", _HARNESS]
    if isolation == "namespaces":
        command = [shutil.which("unshare") or "unshare", *_UNSHARE_FLAGS, *command]
    result = RunResult(isolation=isolation, uid=uid)
    cap = (len(tests) + 1) * (2 * config.max_output_bytes + 4096)
    try:
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        proc = subprocess.Popen(command, env=env, cwd=host_dir or "/", start_new_session=True, **pipes)
        result.pgid = proc.pid
        deadline = time.monotonic() + config.timeout_s
        threading.Thread(target=_feed, args=(proc, json.dumps(payload).encode()), daemon=True).start()
        out, err, result.timed_out, result.output_exceeded = _collect(proc, deadline, cap)
        try:
            result.returncode = proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            result.timed_out = result.timed_out or b'{"done": true}' not in out
        _kill_leftovers(proc.pid, uid)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        result.stderr = err[-4000:].decode("utf-8", "replace")
        if b'{"ready": true}' not in out and not (result.timed_out or result.output_exceeded):
            tail = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
            raise SandboxError(f"the sandbox ({isolation}) failed before running the code: {tail[0]}")
        result.results = _parse_reports(out, len(tests))
    except BaseException:  # a caller's time limit (SIGALRM) while waiting above, too: nothing started outlives it
        _kill_leftovers(result.pgid, uid)
        raise
    finally:
        if host_dir is not None:
            shutil.rmtree(host_dir, ignore_errors=True)
    return result


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except OSError:  # the process died before reading everything
        pass


def _parse_reports(out: bytes, count: int) -> list[dict[str, Any]]:
    reports: list[dict[str, Any]] = [{"ok": False} for _ in range(count)]
    for line in out.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("i"), int) and 0 <= report["i"] < count:
            reports[report["i"]] = {"ok": bool(report.get("ok")), "out": str(report.get("out", ""))}
    return reports
