"""Multi-turn rollouts on the real engines and through training: token-exact turns on ``lean`` and
``transformers``, the round's loss mask, π_old from the engine, and 3 + 3 rounds = 6 rounds with tool calls.

The model is the demo's ``tiny-calc`` (``tools/make_calculator_model.py``): it calls the calculator in a good share
of its samples, so the trajectories really have several turns (checked, so no test here passes on one-turn
rollouts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning import Callback, Trainer, seed_everything
from transformers import AutoModelForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks.checkpointing import RoundCheckpoint
from grpo_lightning.callbacks.completions import completion_rows
from grpo_lightning.checkpoint_io import AtomicCheckpointIO
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import UpdateConfig
from grpo_lightning.engines import LeanEngine, TransformersEngine
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.environments.multiturn import generate_trajectories
from grpo_lightning.models.build import load_tokenizer
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.rollout.prompts import PromptEncoder

TINY_CALC = str(Path(__file__).resolve().parents[2] / "grpo_lightning" / "assets" / "tiny-calc")
PROMPTS = ["123*456=", "5071*938=", "2222*3333=", "640*1212="]
ENGINES = {"lean": LeanEngine, "transformers": TransformersEngine}


class Recording:
    """Wraps an engine and records each call's contexts and outputs (real tokens only)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, prompt_mask, params, **kwargs):
        out = self.engine.generate(prompt_ids, prompt_mask, params, **kwargs)
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(out.prompt_ids, out.prompt_mask)]
        outputs = [ids[mask.bool()].tolist() for ids, mask in zip(out.completion_ids, out.completion_mask)]
        self.calls.append((contexts, outputs))
        return out


@pytest.fixture(scope="module")
def calc():
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    return model, load_tokenizer(TINY_CALC)


def trajectories(engine, tokenizer, **params):
    env = ToolEnvironment(tools=["calculator"], format="tag", max_turns=3, max_turn_tokens=40)
    from grpo_lightning.engines import SamplingParams

    return generate_trajectories(
        {"prompt": PROMPTS},
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        environment=env,
        params=SamplingParams(**{"group_size": 4, "max_new_tokens": 96, **params}),
        generator=torch.Generator().manual_seed(0),
        return_logprobs=True,
    )


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_each_turn_continues_the_trajectorys_own_tokens(name, calc):
    model, tokenizer = calc
    engine = ENGINES[name]()
    engine.setup(model, tokenizer)
    recording = Recording(engine)
    out = trajectories(recording, tokenizer)
    assert max(out.stats["turns"]) >= 2 and sum(out.stats["tool_calls"]) > 0  # real tool calls happened
    c = out.completions
    later: dict[tuple[int, ...], list[list[int]]] = {}  # context → what the engine sampled from it
    for contexts, outputs in recording.calls[1:]:
        for context, output in zip(contexts, outputs):
            later.setdefault(tuple(context), []).append(output)
    for row in range(len(out.final_texts)):
        full = c.completion_ids[row, : int(c.completion_mask[row].sum())].tolist()
        action = out.action_mask[row, : len(full)].tolist()
        prompt = c.prompt_ids[row][c.prompt_mask[row].bool()].tolist()
        starts = [i for i in range(len(full)) if action[i] == 1 and (i == 0 or action[i - 1] == 0)]
        for k, begin in enumerate(starts):
            end = next((i for i in range(begin, len(full)) if action[i] == 0), len(full))
            if k == 0:
                sampled = [recording.calls[0][1][row]]  # the first turn: the group sampling of the prompts
            else:  # a later turn: sampled from prompt + the trajectory so far, token for token
                sampled = later.get(tuple(prompt + full[:begin]), [])
            assert full[begin:end] in [output[: end - begin] for output in sampled], (row, k)


def test_lean_and_transformers_agree_on_greedy_trajectories(calc):
    model, tokenizer = calc
    results = {}
    for name, cls in ENGINES.items():
        engine = cls()
        engine.setup(model, tokenizer)
        results[name] = trajectories(engine, tokenizer, greedy=True, group_size=1)
    assert results["lean"].transcripts == results["transformers"].transcripts
    assert torch.equal(results["lean"].completions.completion_ids, results["transformers"].completions.completion_ids)


def test_the_engines_logprobs_equal_the_trainers_on_the_policys_tokens(calc):
    model, tokenizer = calc
    engine = LeanEngine()
    engine.setup(model, tokenizer)
    out = trajectories(engine, tokenizer)
    c = out.completions
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, c.prompt_ids, c.prompt_mask, c.completion_ids, c.completion_mask)
    policy = out.action_mask.bool()
    torch.testing.assert_close(trainer[policy], c.logprobs[policy], rtol=0, atol=1e-4)  # float32, reordered sums
    assert (c.logprobs[~policy] == 0).all()


# ------------------------------------------------------------------------------------- through training
class Recorder(Callback):
    def __init__(self):
        self.rollouts, self.losses = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())
        self.loss_masks = getattr(self, "loss_masks", []) + [batch["loss_mask"].clone()]

    def on_train_epoch_end(self, trainer, module):
        self.rollouts.append(trainer.datamodule.last_rollout)


def fit(dirpath, epochs, ckpt_path=None, **data_kwargs):
    seed_everything(0)
    module = GRPOModule(model_name_or_path=TINY_CALC, objective=ObjectiveConfig(beta=0.05), lr=1e-3, warmup_steps=2)
    data = RolloutDataModule(
        dataset="multiplication",
        task_kwargs={"train_size": 200, "test_size": 8},
        environment=ToolEnvironment(tools=["calculator"], format="tag", max_turns=3, max_turn_tokens=40),
        sampling=SamplingConfig(group_size=4, max_new_tokens=96),
        prompts_per_round=2,
        update=UpdateConfig(mini_batch_size=4),  # two optimizer steps per round: π_old is recorded (from the engine)
        val_split=None,
        **data_kwargs,
    )
    recorder = Recorder()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, RoundCheckpoint(dirpath=str(dirpath), every_n_rounds=1)],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=dirpath,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, recorder


def test_three_rounds_then_three_more_equal_six_rounds_with_tool_calls(tmp_path):
    reference, ref = fit(tmp_path / "ref", 6)
    assert sum(max(r.turn_stats["turns"]) for r in ref.rollouts) > 6  # several rounds had multi-turn trajectories
    _, first = fit(tmp_path / "run", 3)
    module, second = fit(tmp_path / "run", 6, ckpt_path="last")
    rollouts = first.rollouts + second.rollouts
    assert len(first.rollouts) == len(second.rollouts) == 3
    assert [r.transcripts for r in rollouts] == [r.transcripts for r in ref.rollouts]
    assert all(torch.equal(a.completion_ids, b.completion_ids) for a, b in zip(rollouts, ref.rollouts))
    assert all(torch.equal(a, b) for a, b in zip(first.losses + second.losses, ref.losses, strict=True))
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


def test_the_round_trains_on_the_policys_tokens_only_and_logs_the_turns(tmp_path):
    _, recorder = fit(tmp_path, 2)
    for rollout in recorder.rollouts:
        assert torch.equal(rollout.loss_mask, rollout.action_mask)
        assert rollout.old_logprobs is not None and (rollout.old_logprobs[rollout.action_mask == 0] == 0).all()
        for name in ("turns_mean", "turns_max", "tool_calls_mean", "tool_errors_mean", "tool_seconds_mean"):
            assert f"rollout/{name}" in rollout.metrics
        assert "time/environment" in rollout.metrics
        columns, rows = completion_rows(rollout, [0])
        assert columns[:4] == ["prompt", "completion", "turns", "transcript"]
        assert rows[0][3] == rollout.transcripts[0] and rows[0][1] == rollout.completions[0]
    environment_tokens = [((r.completion_mask == 1) & (r.loss_mask == 0)).sum() for r in recorder.rollouts]
    assert sum(environment_tokens) > 0  # observations were in the rollouts, and out of the loss
    masks = torch.cat([m.flatten() for m in recorder.loss_masks])
    assert masks.sum() < sum(int(r.completion_mask.sum()) for r in recorder.rollouts)
