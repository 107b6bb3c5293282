"""Code execution reward and its sandbox: correct scoring, and hostile code contained within its limits.

Each hostile snippet would pass its test only if it escaped (read the secret, wrote the file, reached the socket,
signalled the parent...). It runs under the OS layers alone (namespaces, guards off), under OS layers plus the
Python guards, and in the plain process mode; the checks after each run look at the host, not at the score only.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from importlib import resources
from pathlib import Path

import pytest

from grpo_lightning.integrations.sandbox.code import code_execution, extract_code, normalize_tests, outputs_match
from grpo_lightning.integrations.sandbox.sandbox import SandboxConfig, leftover_pids, namespaces_available, run_tests
from grpo_lightning.rewards import get

IS_ROOT = os.geteuid() == 0
needs_ns = pytest.mark.skipif(not namespaces_available(), reason="needs root and a working `unshare`")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="the process-mode OS limits below need root (uid drop)")
MODES = [
    pytest.param("namespaces", False, id="namespaces-os-only", marks=needs_ns),
    pytest.param("namespaces", True, id="namespaces+guards", marks=needs_ns),
    pytest.param("process", True, id="process+guards"),
]


def run_contained(
    code: str, tests: list[str], isolation: str, guards: bool, timed_out: bool | None = None, **limits: float
) -> float:
    """Run ``code`` in the sandbox and check that nothing of it is left; return its score.

    ``timed_out``: whether the parent's wall clock must (True) or must not (False) have ended the run.
    """
    config = SandboxConfig(isolation=isolation, guards=guards, **{"timeout_s": 2.0, "test_timeout_s": 1.0, **limits})
    start = time.monotonic()
    result = run_tests(code, tests, "assert", config)
    # Only a bound against a hang, relative to the limit (a loaded machine may take several times the limit to
    # start and kill the process); whether the wall clock stopped the code is ``result.timed_out``.
    assert time.monotonic() - start < 20 * config.timeout_s
    if timed_out is not None:
        assert result.timed_out is timed_out
    assert leftover_pids(result.pgid, result.uid) == []  # nothing of its process group or uid is alive
    return sum(r["ok"] for r in result.results) / len(tests)


# ------------------------------------------------------------------------------------------------ scoring
def test_registered_with_required_column() -> None:
    assert get("code_execution") is code_execution and code_execution.required_columns == ("tests",)


def test_extract_code_takes_the_last_python_block() -> None:
    text = "Try:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\n```cpp\nint x;\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_normalize_tests_shapes() -> None:
    assert normalize_tests(["assert f(1) == 2"]) == ("assert", ["assert f(1) == 2"], None)
    assert normalize_tests([{"input": "1\n", "output": "2\n"}]) == ("io", ["1\n"], ["2\n"])
    assert normalize_tests({"inputs": ["1"], "outputs": ["2"]}) == ("io", ["1"], ["2"])
    assert normalize_tests('[{"input": "1", "output": "2"}]') == ("io", ["1"], ["2"])
    assert normalize_tests("assert f(1) == 2\nassert f(2) == 3") == (
        "assert",
        ["assert f(1) == 2", "assert f(2) == 3"],
        None,
    )
    assert normalize_tests(None) is None and normalize_tests([]) is None
    with pytest.raises(ValueError):
        normalize_tests(["assert x", {"input": "1", "output": "1"}])


def test_outputs_match() -> None:
    assert outputs_match("1 2\n3\n", "1 2 3")
    assert outputs_match("0.3333333", "0.33333334")
    assert not outputs_match("1 2", "1 3") and not outputs_match("1", "1 1")


def test_scores_assert_and_io_tests() -> None:
    add = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a * b\n```"
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]
    io = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8"}]
    program = "a, b = map(int, input().split())\nprint(a + b)"
    half = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b if a < 5 else 0)"
    scores = code_execution(
        [""] * 6,
        [add, wrong, program, half, "def add(a, b) return", program],
        tests=[asserts, asserts, io, io, asserts, None],
    )
    assert scores == [1.0, pytest.approx(1 / 3), 1.0, 0.5, 0.0, None]
    assert code_execution([""], [half], tests=[io], all_or_nothing=True) == [0.0]


def test_main_guard_exit_and_imports() -> None:
    program = (
        "import collections, heapq, math\n"
        "if __name__ == '__main__':\n"
        "    print(math.gcd(*map(int, input().split())))\n"
        "    raise SystemExit(0)"
    )
    assert code_execution([""], [program], tests=[[{"input": "12 18", "output": "6"}]]) == [1.0]


def test_per_test_time_limit_fails_only_that_test() -> None:
    code = "def f(n):\n    while n < 0:\n        pass\n    return n"
    tests = ["assert f(1) == 1", "assert f(-1) == -1", "assert f(2) == 2"]
    assert code_execution([""], [code], tests=[tests], test_timeout_s=0.5) == [pytest.approx(2 / 3)]


def test_64_completions_in_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_lightning.integrations.sandbox import code as code_module

    running, peak, lock = [0], [0], threading.Lock()
    score_code = code_module.score_code

    def counted(*args: object, **kwargs: object) -> float | None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return score_code(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(code_module, "score_code", counted)
    good = "def sq(x):\n    return x * x"
    bad = "def sq(x):\n    return x + x"
    completions = [good if i % 2 == 0 else bad for i in range(64)]
    tests = [["assert sq(3) == 9", "assert sq(2) == 4"]] * 64
    start = time.monotonic()
    scores = code_execution([""] * 64, completions, tests=tests, num_workers=4)
    print(f"64 completions scored in {time.monotonic() - start:.2f}s on {os.cpu_count()} cores")  # information only
    assert scores == [1.0 if i % 2 == 0 else 0.5 for i in range(64)]
    # Several sandboxes at once (4 workers; each run takes a process start, far longer than handing out a job).
    assert peak[0] > 1


# ----------------------------------------------------------------------------------------------- hostile
@pytest.mark.parametrize(("isolation", "guards"), MODES)
def test_infinite_loops(isolation: str, guards: bool) -> None:
    assert run_contained("while True:\n    pass", ["assert True"], isolation, guards) == 0.0
    stubborn = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass"
    # It swallows the per-test timer's exception: only the parent's wall clock stops it (RLIMIT_CPU would too,
    # later, and without setting timed_out).
    assert run_contained(stubborn, ["assert True"], isolation, guards, timed_out=True) == 0.0


@pytest.mark.parametrize(("isolation", "guards"), [*MODES, pytest.param("process", False, marks=needs_root)])
def test_fork_bomb(isolation: str, guards: bool) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except BaseException:\n        pass"
    assert run_contained(bomb, ["assert True"], isolation, guards) == 0.0


@pytest.mark.parametrize(("isolation", "guards"), [*MODES, pytest.param("process", False, marks=needs_root)])
def test_allocating_10_gb(isolation: str, guards: bool) -> None:
    assert run_contained("x = bytearray(10 * 1024**3)", ["assert len(x) > 0"], isolation, guards) == 0.0


@pytest.mark.parametrize(("isolation", "guards"), MODES)
def test_writing_outside_its_directory(isolation: str, guards: bool, tmp_path: Path) -> None:
    targets = [tmp_path / "escape.txt", Path(f"/tmp/grpo-escape-{uuid.uuid4().hex}"), Path("/dev/shm/grpo-escape")]
    code = (
        f"written = []\nfor path in {[str(t) for t in targets]!r}:\n    try:\n        open(path, 'w').write('x')\n"
        "        written.append(path)\n    except BaseException:\n        pass\nopen('inside.txt', 'w').write('ok')"
    )
    assert run_contained(code, ["assert written"], isolation, guards) == 0.0
    assert run_contained(code, ["assert open('inside.txt').read() == 'ok'"], isolation, guards) == 1.0
    assert not any(target.exists() for target in targets)


@needs_root
def test_process_mode_without_guards_cannot_write_root_files(tmp_path: Path) -> None:
    code = f"open({str(tmp_path / 'escape.txt')!r}, 'w').write('x')"
    assert run_contained(code, ["assert True"], "process", False) == 0.0
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.parametrize(("isolation", "guards"), [*MODES, pytest.param("process", False)])
def test_cannot_read_parent_environment(isolation: str, guards: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if isolation == "process" and not guards and not IS_ROOT:
        pytest.skip("/proc/<parent>/environ is readable by the same user")
    monkeypatch.setenv("GRPO_FAKE_API_KEY", "s3cr3t-value")
    code = (
        "import os\nseen = str(dict(os.environ))\n"
        f"for pid in ({os.getpid()}, os.getppid(), 1):\n    try:\n"
        "        seen += open(f'/proc/{pid}/environ').read()\n    except BaseException:\n        pass"
    )
    assert run_contained(code, ["assert 's3cr3t' in seen"], isolation, guards) == 0.0
    assert run_contained("import os", ["assert 'PATH' in os.environ"], isolation, guards) == 1.0


@pytest.mark.parametrize(("isolation", "guards"), MODES)
def test_cannot_open_a_socket(isolation: str, guards: bool) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = f"import socket\nconnection = socket.create_connection(('127.0.0.1', {port}), timeout=1)"
        assert run_contained(code, ["assert connection"], isolation, guards) == 0.0
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the host's loopback


@pytest.mark.parametrize(("isolation", "guards"), [*MODES, pytest.param("process", False)])
def test_printing_100_mb(isolation: str, guards: bool) -> None:
    assert run_contained("print('x' * 100_000_000)", ["assert True"], isolation, guards) == 0.0
    loop = "for _ in range(10**6):\n    print('y' * 100)"
    assert run_contained(loop, ["assert True"], isolation, guards) == 0.0
    raw = "import os\nfor _ in range(100):\n    os.write(1, b'z' * 1_000_000)"  # to /dev/null: harmless
    result = run_tests(raw, ["assert True"], "assert", SandboxConfig(isolation=isolation, guards=guards))
    assert len(result.stderr) < 5000 and result.results == [{"ok": True, "out": ""}]


@pytest.mark.parametrize(("isolation", "guards"), [*MODES, pytest.param("process", False, marks=needs_root)])
def test_cannot_signal_the_parent(isolation: str, guards: bool) -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        code = f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)\nsent = True"
        assert run_contained(code, ["assert sent"], isolation, guards) == 0.0
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []


def test_a_broken_sandbox_is_an_error_not_a_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_lightning.integrations.sandbox import sandbox

    monkeypatch.setattr(sandbox, "_HARNESS", "raise SystemExit(3)")
    with pytest.raises(sandbox.SandboxError, match="failed before running the code: exit status 3"):
        code_execution([""], ["x = 1"], tests=[["assert x == 1"]], isolation="process")


@pytest.mark.parametrize(("isolation", "guards"), [*MODES, pytest.param("process", False, marks=needs_root)])
def test_a_child_in_its_own_session_is_killed_too(isolation: str, guards: bool) -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)"
    run_contained(code, ["assert True"], isolation, guards)  # checks that no process of it is left alive


@pytest.mark.parametrize(("isolation", "guards"), MODES)
def test_the_child_runs_the_program_shipped_as_a_file(isolation: str, guards: bool) -> None:
    """The sandbox's child runs ``grpo_lightning/assets/sandbox_child.py`` (package data), not a copy in sandbox.py:
    the user code finds that file's docstring on the child's ``__main__``."""
    from grpo_lightning.integrations.sandbox import sandbox

    shipped = resources.files("grpo_lightning") / "assets" / "sandbox_child.py"
    first_line = shipped.read_text(encoding="utf-8").splitlines()[0].strip('"')
    code = "import __main__\ndoc = __main__.__doc__"
    assert run_contained(code, [f"assert doc.startswith({first_line!r})"], isolation, guards) == 1.0
    assert run_contained(code, ["assert doc.startswith('not the shipped program')"], isolation, guards) == 0.0
    assert "cfg = json.loads" not in Path(sandbox.__file__).read_text(encoding="utf-8")
