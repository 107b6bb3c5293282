"""Tools and the tool environment: the calculator evaluates arithmetic only, the python tool runs in the sandbox,
and every failure of a tool (error, timeout, unknown tool, malformed call, hostile input) becomes an observation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from grpo_lightning.config import ConfigError
from grpo_lightning.environments import ToolEnvironment, ToolError, calculator, resolve_tool
from grpo_lightning.environments.formats import ChatTemplateFormat, TagFormat, tool_format
from grpo_lightning.environments.tools import PythonTool
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards.sandbox import SandboxConfig

QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{# tools: <tool_call>{...}</tool_call> #}"
)


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
    assert final.done and final.observation is None and final.metrics == {}


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


def test_long_results_are_cut():
    env = env_with(f"{__name__}:user_echo", max_result_chars=5)
    assert env.step("<tool>user_echo: abcdefghij</tool>").observation == "<result>jihgf</result>"


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


# ------------------------------------------------------------------------------------------------- formats
def test_auto_picks_the_chat_template_format_where_the_template_has_tool_calls():
    tokenizer = build_char_tokenizer()
    assert isinstance(tool_format("auto", tokenizer), TagFormat)
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    assert isinstance(tool_format("auto", tokenizer), ChatTemplateFormat)


def test_the_chat_template_format_parses_json_calls_and_renders_results_with_the_template():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    env = ToolEnvironment(tools=["calculator"], format="auto")
    env.setup(tokenizer)
    assert env.stop_texts == ("</tool_call>",)
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
    # After the assistant's text: its end of turn, the tool message and the next assistant header, as the
    # template writes them.
    assert step.observation == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    bad = env.step("<tool_call>not json</tool_call>")
    assert "error: a call is" in bad.observation
