"""Every round of a tool environment logs each tool metric (``rollout/tool_calls_mean``, ``tool_errors``,
``tool_seconds``): 0 in a round in which no trajectory calls a tool, not missing (``tool_env.py: final_answer``),
for ``ToolEnvironment`` and TRL's environment classes alike.
"""

from __future__ import annotations

from test_multiturn import EOS, calculator_policy, run
from test_trl_environments import MATH, QUESTION, math_policy, rollout, set_up

from grpo_lightning.integrations.environments.tool_env import TOOL_METRICS


def test_a_round_without_a_tool_call_logs_every_tool_metric_as_0():
    out, _, _ = run(lambda context: "408" + EOS, prompts=("12*34=", "5*6=", "7*8="), group=3)
    assert {name: out.stats.get(name) for name in TOOL_METRICS} == dict.fromkeys(TOOL_METRICS, [0.0] * 9)


def test_a_round_with_tool_calls_logs_the_same_names():
    quiet, _, _ = run(lambda context: "408" + EOS)
    calling, _, _ = run(calculator_policy)
    assert quiet.stats.keys() == calling.stats.keys() >= set(TOOL_METRICS)
    assert calling.stats["tool_calls"] == [1.0] * 4 and calling.stats["tool_errors"] == [0.0] * 4


def test_a_trl_class_round_without_a_tool_call_logs_every_tool_metric_as_0():
    env = set_up(MATH)
    out, _ = rollout(env, {"prompt": [QUESTION, QUESTION]}, lambda context: "42<|im_end|>")
    assert {name: out.stats.get(name) for name in TOOL_METRICS} == dict.fromkeys(TOOL_METRICS, [0.0] * 4)
    calling, _ = rollout(env, {"prompt": [QUESTION]}, math_policy)
    assert calling.stats.keys() == out.stats.keys() and calling.stats["tool_calls"] == [1.0] * 2
