"""Partial rollouts on the vLLM engines, without vLLM: both engines take ``data.schedule.partial_rollouts``, and a
segment whose EOS ban outlasts its budget is asked of vLLM as a ban of the whole request (vLLM refuses
``min_tokens`` > ``max_tokens``). On vLLM itself: ``test_vllm_partial.py``, ``tests/runs/test_vllm_partial_runs.py``.
"""

from __future__ import annotations

from test_vllm_server_client import StandIn, stand_in  # noqa: F401 - the stand-in server fixture

from grpo_lightning.config import SamplingConfig, ScheduleConfig
from grpo_lightning.config_checks import check_partial_rollouts
from grpo_lightning.engines import SamplingParams
from grpo_lightning.integrations.vllm.engine import VLLMEngine, request_min_tokens
from grpo_lightning.integrations.vllm.server import VLLMServerEngine
from grpo_lightning.rollout.partial import left_padded


def test_both_vllm_engines_take_partial_rollouts():
    assert VLLMEngine.supports_partial_rollouts  # (building it needs vLLM installed)
    check_partial_rollouts(
        ScheduleConfig(rollout_lag=1, partial_rollouts=True),
        sampling=SamplingConfig(max_new_tokens=64),
        engine=VLLMServerEngine(),
        environment=None,
    )


def test_an_eos_ban_longer_than_the_request_bans_eos_throughout_it():
    assert request_min_tokens(SamplingParams(max_new_tokens=12, min_new_tokens=20)) == 12
    assert request_min_tokens(SamplingParams(max_new_tokens=12, min_new_tokens=3)) == 3
    assert request_min_tokens(SamplingParams(max_new_tokens=12, min_new_tokens=20, greedy=True)) == 0


def test_a_server_is_asked_no_more_min_tokens_than_max_tokens(stand_in):  # noqa: F811 - the fixture
    budget = 12
    StandIn.plan = [
        (200, {}),  # /health
        (200, {"data": [{"id": "tiny", "max_model_len": 128}]}),
        (200, {"choices": [{"index": 0, "token_ids": [5] * budget, "logprobs": {"token_logprobs": [-1.0] * budget}}]}),
    ]
    engine = VLLMServerEngine(base_urls=[stand_in], connect_timeout_s=5)
    engine.vocab_size, engine.eos_token_ids, engine.pad_token_id = 100, (2,), 0  # what setup reads from the policy
    ids, mask = left_padded([[7, 8, 9] + [5] * 30], 0, "cpu")  # a continued sequence: prompt + 30 tokens so far
    params = SamplingParams(max_new_tokens=budget, min_new_tokens=20, temperature=0.7)  # the ban outlasts the budget
    out = engine.generate(ids, mask, params, return_logprobs=True)
    body = StandIn.seen[-1][1]
    assert (body["max_tokens"], body["min_tokens"]) == (budget, budget)
    assert out.completion_mask.sum() == budget and bool(out.truncated[0])
