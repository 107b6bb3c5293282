"""An OpenEnv server that fails a run ends it with one ``error:`` line and the status of its kind, through the CLI's
entry point (``test_exit_status.cli_run``): a server at ``url`` that refuses the connection or never answers is an
unreachable service (3); an environment that raises on its server, or a server the run started that dies, is a
crashed environment (4). docs/checkpoints.md, exit status; ``integrations/environments/openenv_sessions.py``.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import textwrap

import pytest

pytest.importorskip("openenv", reason="openenv is not installed: pip install -e .[openenv]")
pytest.importorskip("uvicorn", reason="uvicorn (an openenv dependency) is not installed")

import openenv_guess  # noqa: E402
from openenv.core.env_server.http_server import create_app  # noqa: E402
from test_exit_status import cli_run, down  # noqa: E402
from test_openenv import served  # noqa: E402


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """``run(*flags, config=edits)``: ``main(fit ...)``'s exit status and ``error:`` lines (``test_exit_status``)."""
    return cli_run(tmp_path, monkeypatch, capsys)


def environment(**init_args) -> dict:
    """``data.environment``: an OpenEnv environment, one try per request, resets without arguments."""
    settings = {"max_retries": 0, "timeout_s": 1.0, "reset_columns": [], **init_args}
    return {
        "data.environment": {
            "class_path": "grpo_lightning.integrations.environments.OpenEnvEnvironment",
            "init_args": settings,
        }
    }


class CrashingReset(openenv_guess.GuessEnvironment):
    def reset(self, *args, **kwargs):
        raise RuntimeError("the environment crashed at reset")


crashing_app = create_app(
    CrashingReset, openenv_guess.GuessAction, openenv_guess.GuessObservation, env_name="crash", max_concurrent_envs=64
)


@contextlib.contextmanager
def silent_server():
    """A loopback port that accepts connections and never answers; its URL."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_server_that_refuses_the_connection_is_one_line_with_status_3(run):
    url = down()
    code, lines = run(config=environment(url=url))
    assert code == 3 and len(lines) == 1
    assert lines[0].startswith(f"error: data.environment: the OpenEnv environment at {url} (GenericEnvClient) failed")
    assert "refused" in lines[0]


def test_a_server_that_never_answers_is_one_line_with_status_3(run):
    with silent_server() as url:
        code, lines = run(config=environment(url=url))
    assert code == 3 and len(lines) == 1
    assert url in lines[0] and "(no answer within timeout_s = 1s)" in lines[0]


def test_an_environment_that_raises_on_its_server_is_one_line_with_status_4(run):
    with served(crashing_app) as url:
        code, lines = run(config=environment(url=url))
    assert code == 4 and len(lines) == 1
    assert url in lines[0] and "failed to reset after 1 tries" in lines[0]
    assert "the environment crashed at reset (code: EXECUTION_ERROR)" in lines[0]


def test_a_server_the_run_started_that_dies_is_one_line_with_status_4(run):
    """The server answers its health check, then exits: the run's first reset finds it gone."""
    once = textwrap.dedent(
        """
        import http.server, sys
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).handle_request()
        print("served one request, leaving", flush=True)
        sys.exit(7)
        """
    )
    code, lines = run(config=environment(server=[sys.executable, "-c", once, "{port}"], max_retries=1))
    assert code == 4 and len(lines) == 1
    assert lines[0].startswith("error: data.environment: the OpenEnv server the run started at http://127.0.0.1:")
    assert lines[0].endswith("exited with code 7; its last output: served one request, leaving")
