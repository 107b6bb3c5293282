"""Tools and the tool environment: the calculator evaluates arithmetic only, the python tool runs in the sandbox,
every failure of a call (error, timeout, unknown tool, malformed call, hostile input) becomes an observation, and a
broken tool (its sandbox fails) stops the rollout instead. Chat-template formats: ``test_chat_formats.py``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from grpo_lightning import environments
from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments import ToolEnvironment, ToolError, calculator, resolve_tool
from grpo_lightning.integrations.environments.tools import PythonTool
from grpo_lightning.integrations.sandbox import sandbox
from grpo_lightning.integrations.sandbox.sandbox import SandboxConfig
from grpo_lightning.models.tiny import build_char_tokenizer


# ------------------------------------------------------------------------------------------- tools, user side
def user_raises(argument: str) -> str:
    raise KeyError("no such record")


def user_sleeps(argument: str) -> str:
    time.sleep(30)
    return "too late"


def user_spins(argument: str) -> str:
    while True:
        pass


def user_not_text(argument: str) -> int:
    return 42


def user_echo(argument: str) -> str:
    return argument[::-1]


def env_with(*tools: str, **kwargs) -> ToolEnvironment:
    kwargs.setdefault("max_observation_tokens", 128)  # a character per token: room for the whole error messages
    env = ToolEnvironment(tools=list(tools), format="tag", **kwargs)
    env.setup(build_char_tokenizer())
    return env


# ------------------------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*34", "408"),
        ("1234 * 5678", "7006652"),
        ("(2+3)*4", "20"),
        ("7/2", "3.5"),
        ("8/2", "4"),
        ("2**10", "1024"),
        ("2^10", "1024"),
        ("-3+1", "-2"),
        ("17//5", "3"),
        ("17%5", "2"),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd').read()",
        "x + 1",
        "[1, 2]",
        "9**9**9",
        "10**5000",
        "1/0",
        "lambda: 1",
        "'a' * 3",
        "1e308*10",
        "(10**999)*(10**999)*(10**999)",
        "1" * 600,
    ],
)
def test_the_calculator_refuses_everything_else_with_an_error(expression):
    with pytest.raises(ToolError):
        calculator(expression)


# ------------------------------------------------------------------------------------- the environment's step
def test_a_tool_call_is_answered_by_its_result():
    env = env_with("calculator")
    step = env.step("let me compute <tool>calculator: 12*34</tool>")
    assert step.observation == "<result>408</result>" and not step.done
    assert step.metrics["tool_calls"] == 1 and step.metrics["tool_errors"] == 0


def test_only_the_last_call_of_a_turn_runs_and_a_turn_without_one_is_final():
    env = env_with("calculator")
    assert env.step("<tool>calculator: 1+1</tool> <tool>calculator: 2+3</tool>").observation == "<result>5</result>"
    final = env.step("408")
    assert final.done and final.observation is None  # a final answer counts no call (0: logged every round)
    assert final.metrics == {"tool_calls": 0.0, "tool_errors": 0.0, "tool_seconds": 0.0}


@pytest.mark.parametrize(
    "turn, expected",
    [
        ("<tool>calculator: 1/0</tool>", "error: division by zero"),
        ("<tool>abacus: 1+1</tool>", "error: unknown tool 'abacus'"),
        ("<tool>calculator 1+1</tool>", "error: a call is written <tool>name: argument</tool>"),
        ("<tool>user_raises: x</tool>", "error: 'no such record'"),
        ("<tool>user_not_text: x</tool>", "error: the tool returned int, not text"),
    ],
)
def test_tool_failures_become_error_observations(turn, expected):
    env = env_with("calculator", f"{__name__}:user_raises", f"{__name__}.user_not_text")
    step = env.step(turn)
    assert step.observation.startswith("<result>" + expected), step.observation
    assert step.metrics["tool_errors"] == 1 and not step.done


@pytest.mark.parametrize("tool", ["user_sleeps", "user_spins"])
def test_a_tool_past_its_time_limit_becomes_a_timeout_observation(tool):
    env = env_with(f"{__name__}:{tool}", timeout_s=0.2)
    step = env.step(f"<tool>{tool}: x</tool>")
    assert step.observation == "<result>error: timed out after 0.2s</result>"
    assert step.metrics["tool_errors"] == 1


def user_broken(argument: str) -> str:
    raise environments.ToolBroken("the lookup service is down")


def test_long_results_are_cut_and_say_so():
    env = env_with(f"{__name__}:user_echo", max_result_chars=5)
    assert env.step("<tool>user_echo: abcdefghij</tool>").observation == (
        "<result>jihgf... [cut: 5 more characters]</result>"
    )


def test_unknown_tools_and_bad_settings_are_refused_when_configured():
    with pytest.raises(ConfigError, match="data.environment.init_args.tools: unknown tool 'abacus'"):
        ToolEnvironment(tools=["abacus"])
    with pytest.raises(ConfigError, match="cannot import the tool 'no_such_module:fn'"):
        ToolEnvironment(tools=["no_such_module:fn"])
    with pytest.raises(ConfigError, match="data.environment.init_args.max_turns must be >= 1"):
        ToolEnvironment(max_turns=0)
    with pytest.raises(ConfigError, match="data.environment.init_args.format must be"):
        ToolEnvironment(format="xml")
    with pytest.raises(ConfigError, match="tools is empty"):
        ToolEnvironment(tools=[])
    assert resolve_tool(f"{__name__}:user_echo")("ab") == "ba"


# ------------------------------------------------------------------------------------------ the python tool
@pytest.fixture(scope="module")
def python_tool() -> PythonTool:
    return PythonTool(SandboxConfig(timeout_s=5.0, test_timeout_s=1.0, memory_mb=512))


def test_the_python_tool_returns_what_the_program_prints(python_tool):
    assert python_tool("print(sum(range(10)))") == "45"


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('touch /tmp/grpo_tool_escape')\nprint('ran')",
        "open('/tmp/grpo_tool_escape', 'w').write('x')\nprint('ran')",
        "import subprocess\nsubprocess.run(['touch', '/tmp/grpo_tool_escape'])\nprint('ran')",
        "import socket\nsocket.create_connection(('127.0.0.1', 22))\nprint('ran')",
    ],
)
def test_hostile_python_is_contained_and_reported_as_an_error(python_tool, code):
    Path("/tmp/grpo_tool_escape").unlink(missing_ok=True)
    with pytest.raises(ToolError, match="the program failed"):
        python_tool(code)
    assert not Path("/tmp/grpo_tool_escape").exists()


def test_an_endless_python_program_times_out(python_tool):
    with pytest.raises(ToolError, match="timed out|failed"):
        python_tool("while True:\n    pass")


def test_the_environment_turns_hostile_python_into_observations():
    env = env_with("python")
    env.tools["python"] = PythonTool(SandboxConfig(timeout_s=5.0, test_timeout_s=1.0, memory_mb=512))
    for code in ("import os; os.remove('/etc/hostname')", "while True: pass", "raise SystemExit(3)"):
        step = env.step(f"<tool>python: {code}</tool>")
        assert step.observation.startswith("<result>error: ") and step.metrics["tool_errors"] == 1
    assert env.step("<tool>python: print(6*7)</tool>").observation == "<result>42</result>"


# ------------------------------------------------------------------------------------- a broken tool stops
def test_a_sandbox_that_fails_stops_the_rollout_with_one_line_naming_the_tool(monkeypatch):
    env = env_with("python")
    monkeypatch.setattr(sandbox, "_HARNESS", "import sys\nsys.exit('harness cannot start')")  # fails before the code
    with pytest.raises(RuntimeError) as raised:  # ToolBroken, not an observation
        env.step("<tool>python: print(1)</tool>")
    message = str(raised.value)
    assert isinstance(raised.value, environments.ToolBroken) and "'python' is broken" in message
    assert "harness cannot start" in message and "\n" not in message
    env.tools["lookup"] = user_broken  # a tool that reports its own failure: the same
    with pytest.raises(environments.ToolBroken, match="'lookup' is broken, not the policy's call: the lookup service"):
        env.step("<tool>lookup: x</tool>")


def test_a_sandbox_that_cannot_start_here_is_a_broken_tool_reported_in_one_line(monkeypatch):
    from grpo_lightning.cli import user_error

    def no_namespaces(isolation):
        raise RuntimeError("sandbox isolation 'namespaces' needs root and a working `unshare`; use 'auto' or 'process'")

    monkeypatch.setattr(sandbox, "resolve_isolation", no_namespaces)
    env = env_with("python")
    broken = "'python' is broken.*isolation 'namespaces' needs root"
    with pytest.raises(environments.ToolBroken, match=broken) as raised:
        env.step("<tool>python: print(1)</tool>")
    assert user_error(raised.value) is raised.value  # the command line prints it as one `error:` line


def test_a_tool_timeout_leaves_no_sandbox_process_behind(monkeypatch):
    started = []  # the sandbox's process group: its harness and everything the program started
    collect = sandbox._collect
    monkeypatch.setattr(sandbox, "_collect", lambda proc, *args: (started.append(proc.pid), collect(proc, *args))[1])
    env = env_with("python", timeout_s=0.5)
    env.tools["python"] = PythonTool(SandboxConfig(timeout_s=30.0, test_timeout_s=30.0))  # longer than the alarm
    try:
        step = env.step("<tool>python: import time; time.sleep(20)</tool>")
        assert step.observation == "<result>error: timed out after 0.5s</result>" and len(started) == 1
        deadline = time.monotonic() + 3.0
        while sandbox.leftover_pids(started[0], None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox.leftover_pids(started[0], None) == []
    finally:
        for pgid in started:
            sandbox._kill_leftovers(pgid, None)


def test_the_python_tools_sandbox_clock_is_bounded_by_the_environments_time_limit():
    env = ToolEnvironment(tools=["python"], format="tag", timeout_s=2.0)
    assert env.tools["python"].config.timeout_s == 2.0 and env.tools["python"].config.test_timeout_s == 2.0
