"""Asynchronous rollouts at a fixed lag (``data.schedule.rollout_lag``, ``rollout/schedule.py``, ``rollout/worker.py``).

The weights version that sampled each round follows from the round alone (k − L, or 0 for the first L rounds),
also after a resume; a run stopped at a round boundary (or killed mid-generation) and resumed trains on exactly
the tensors of an uninterrupted run; the background process's failures reach the trainer; combinations that
cannot work are refused before training.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from conftest import TINY, quiet_trainer
from lightning import Callback
from test_resume import fit

from grpo_lightning import GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError, ScheduleConfig, UpdateConfig
from grpo_lightning.engines import LeanEngine
from grpo_lightning.engines.weights import policy_weights
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.curriculum import CurriculumConfig

DIGITS = 4  # completion tokens that carry the sampling weights' fingerprint


def fingerprint(named_tensors) -> list[int]:
    """``DIGITS`` token ids (3 … 98: never pad, EOS or unknown) that identify a set of weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    value = int.from_bytes(digest.digest()[:8], "big")
    return [3 + (value // 96**i) % 96 for i in range(DIGITS)]


class FingerprintEngine(LeanEngine):
    """Samples as ``lean`` does, then writes the fingerprint of the weights it sampled from into each completion's
    first tokens: the trained rollout says which version of the policy made it (in the background process too)."""

    def generate(self, prompt_ids, prompt_mask, params, **kwargs):
        out = super().generate(prompt_ids, prompt_mask, params.with_(min_new_tokens=DIGITS), **kwargs)
        out.completion_ids[:, :DIGITS] = torch.tensor(fingerprint(self.policy.state_dict().items()))
        return out


@register("async_digit_sum")
def digit_sum(prompts, completions, **_):
    """A reward with spread for a random model: the characters' code points, mod 7."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


class Versions(Callback):
    """Per round: the fingerprint of the policy at the round's start (its version = the round), and the
    fingerprint the trained rollout carries."""

    def __init__(self, known: dict[int, list[int]] | None = None) -> None:
        self.known = known if known is not None else {}  # version → fingerprint
        self.trained: dict[int, list[list[int]]] = {}  # round → the rollout's fingerprints

    def on_train_epoch_start(self, trainer, module):
        self.known[trainer.current_epoch] = fingerprint(policy_weights(module.policy))

    def on_train_epoch_end(self, trainer, module):
        rollout = trainer.datamodule.last_rollout
        self.trained[trainer.current_epoch] = rollout.completion_ids[:, :DIGITS].tolist()


def lagged(**settings) -> RolloutDataModule:
    """A small ``RolloutDataModule`` at lag 1; ``settings`` override any of its own."""
    small = {
        "sampling": SamplingConfig(group_size=2, max_new_tokens=4),
        "prompts_per_round": 2,
        "schedule": ScheduleConfig(rollout_lag=1),
        "val_split": None,
        "task_kwargs": {"test_size": 20},
    }
    return RolloutDataModule(**{**small, **settings})


class Rollouts(Callback):
    """Every round's rollout, as trained on."""

    def __init__(self) -> None:
        self.rollouts: list = []

    def on_train_epoch_end(self, trainer, module):
        self.rollouts.append(trainer.datamodule.last_rollout)


def assert_same_tensors(reference, resumed):
    """Rewards, completions, losses, β and the final weights of two runs of ``test_resume.fit``'s recipe."""
    (ref_module, _, ref), (module, parts) = reference, resumed
    for name in ("rewards", "losses"):
        got = [x for r in parts for x in getattr(r, name)]
        assert len(got) == len(getattr(ref, name)) and all(torch.equal(a, b) for a, b in zip(got, getattr(ref, name)))
    for name in ("completions", "betas", "positions"):
        assert [x for r in parts for x in getattr(r, name)] == getattr(ref, name), name
    for name, value in ref_module.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


# Lag 2 holds two rounds sampled ahead in the checkpoint, lag 1's case and more; lag 1 resumed exactly through the
# command line, at the default threads: test_determinism.py.
# lag 2 takes half a minute: the slow tier (pytest -m slow, run by .ci/run)
@pytest.mark.parametrize("lag", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_round_k_trains_on_version_k_minus_the_lag_and_three_plus_three_rounds_equal_six(tmp_path, lag):
    """``test_resume``'s recipe (a reward reading every global RNG, adaptive β, a moving reference, warm-up) with an
    engine that signs each completion with its weights: in the uninterrupted run and in one stopped after 3 rounds
    and resumed, round k trained on the rollout of version max(0, k − L); and the resumed run trained on the very
    same tensors (the checkpoint holds the rounds sampled ahead)."""
    runs = {name: Versions() for name in ("reference", "first", "second")}
    reference = fit(tmp_path / "reference", 6, engine=FingerprintEngine(), rollout_lag=lag, extra=[runs["reference"]])
    _, _, first = fit(tmp_path / "run", 3, engine=FingerprintEngine(), rollout_lag=lag, extra=[runs["first"]])
    resumed = fit(
        tmp_path / "run", 6, ckpt_path="last", engine=FingerprintEngine(), rollout_lag=lag, extra=[runs["second"]]
    )
    for trained, known in (
        (runs["reference"].trained, runs["reference"].known),
        ({**runs["first"].trained, **runs["second"].trained}, {**runs["first"].known, **runs["second"].known}),
    ):
        assert sorted(trained) == sorted(known) == list(range(6))
        assert len({tuple(v) for v in known.values()}) == 6  # every round changed the weights
        for k, fingerprints in trained.items():
            assert all(f == known[max(0, k - lag)] for f in fingerprints), (k, lag)
    assert len(first.rewards) == len(resumed[2].rewards) == 3
    assert_same_tensors(reference, (resumed[0], [first, resumed[2]]))


# ------------------------------------------------------------------------------------------ refused, failing
@pytest.mark.parametrize(
    "settings,message",
    [
        (
            lambda: {"schedule": ScheduleConfig(rollout_lag=1), "update": UpdateConfig(old_logprobs="sampler")},
            r"^data.update.old_logprobs: sampler .* data.schedule.rollout_lag > 0",
        ),
        (
            lambda: {"schedule": ScheduleConfig(rollout_lag=1), "curriculum": CurriculumConfig()},
            r"^data.curriculum picks .*\(data.schedule.rollout_lag > 0\)",
        ),
        (
            lambda: {"schedule": ScheduleConfig(rollout_lag=1, off_policy_correction="clip")},
            r"^data.schedule.off_policy_correction must be decoupled",
        ),
    ],
    ids=["sampler", "curriculum", "correction"],
)
def test_what_a_lag_cannot_do_is_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        RolloutDataModule(**settings())


@register("async_fails_in_round_2")
def fails_in_round_2(prompts, completions, **_):
    """Raises in the third round it scores: in the background process at a lag."""
    FAILS["calls"] = FAILS.get("calls", 0) + 1
    if FAILS["calls"] == 3:
        raise ValueError("injected failure in the worker")
    return [float(len(c)) for c in completions]


FAILS: dict[str, int] = {}


def test_a_reward_that_fails_in_the_background_stops_the_run_with_its_own_error(tmp_path):
    from grpo_lightning.rewards import RewardError

    module, data = GRPOModule(tiny_model=TINY), lagged(rewards=[RewardSpec("async_fails_in_round_2")])
    trainer = quiet_trainer(tmp_path, max_epochs=4)
    with pytest.raises(RewardError, match="async_fails_in_round_2.*injected failure in the worker") as raised:
        trainer.fit(module, datamodule=data)
    assert "in the rollout worker" in str(raised.value.__cause__)  # its traceback comes along
    assert trainer.current_epoch == 2  # rounds 0 and 1 trained; round 2 (sampled during round 1) failed
    assert data.collector.background.schedule.worker is None  # teardown stopped the process


@register("async_hangs")
def hangs(prompts, completions, **_):
    time.sleep(3600)


@pytest.mark.slow  # about half a minute (pytest -m slow, run by .ci/run)
def test_a_worker_that_dies_or_hangs_is_reported_not_waited_for(tmp_path):
    module, data = GRPOModule(tiny_model=TINY), lagged(schedule=ScheduleConfig(rollout_lag=1, rollout_timeout_s=3))

    class Killed(Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.datamodule.collector.background.schedule.worker.process.kill()

    trainer = quiet_trainer(tmp_path / "killed", max_epochs=3, callbacks=[Killed()])
    with pytest.raises(RuntimeError, match=r"the rollout worker process died \(exit code -9\)"):
        trainer.fit(module, datamodule=data)

    module, data = (
        GRPOModule(tiny_model=TINY),
        lagged(rewards=[RewardSpec("async_hangs")], schedule=ScheduleConfig(rollout_lag=1, rollout_timeout_s=3)),
    )
    with pytest.raises(TimeoutError, match=r"no result in 3 s \(data.schedule.rollout_timeout_s\)"):
        quiet_trainer(tmp_path / "hung", max_epochs=1).fit(module, datamodule=data)


# ------------------------------------------------------------------------------------------ everywhere
def test_multi_turn_tool_calls_with_dynamic_sampling_on_the_transformers_engine_at_a_lag(tmp_path):
    """The calculator demo's model and environment, DAPO's dynamic sampling (its refill draws happen in the
    background process too) and the ``transformers`` engine: trajectories of several turns, environment tokens
    out of the loss, the refill's metrics, round k trained on the rollout of version k − 1."""
    from pathlib import Path

    from grpo_lightning.integrations.environments import ToolEnvironment

    model = str(Path(__file__).resolve().parents[2] / "grpo_lightning" / "assets" / "tiny-calc")
    module = GRPOModule(model_name_or_path=model, lr=2e-4)
    data = RolloutDataModule(
        dataset="multiplication",
        engine="transformers",
        environment=ToolEnvironment(tools=["calculator"], format="tag", max_turns=3, max_turn_tokens=40),
        sampling=SamplingConfig(group_size=4, max_new_tokens=96, dynamic_sampling=True),
        prompts_per_round=4,
        schedule=ScheduleConfig(rollout_lag=1),
        val_split=None,
    )

    rounds = Rollouts()
    quiet_trainer(tmp_path, max_epochs=3, callbacks=[rounds]).fit(module, datamodule=data)
    assert [r.metrics["rollout/lag"] for r in rounds.rollouts] == [0.0, 1.0, 1.0]
    assert all("rollout/sampling_rounds" in r.metrics for r in rounds.rollouts)
    assert max(max(r.turn_stats["turns"]) for r in rounds.rollouts) >= 2  # real tool calls, in the background
    for rollout in rounds.rollouts:
        environment_tokens = rollout.completion_mask.bool() & ~rollout.action_mask.bool()
        assert not rollout.loss_mask[environment_tokens].any()
        assert rollout.engine_logprobs is not None  # μ kept: the decoupled weight of a lag


def test_the_background_process_ends_completions_at_every_eos_id_of_the_model(tmp_path):
    """The worker builds the policy from its config; the EOS ids of its ``generation_config`` (here only there,
    as Qwen2.5-Instruct's ``<|endoftext|>``) must end completions in the background too."""
    from engine_contract import check_rows_end_by_the_rule, make_instruct_like_folder, model_end_ids

    from grpo_lightning.models.build import load_tokenizer

    folder, second = make_instruct_like_folder(tmp_path / "model")
    module = GRPOModule(model_name_or_path=folder, lr=1e-3)
    data = lagged(rewards=[RewardSpec("async_digit_sum")], sampling=SamplingConfig(group_size=8, max_new_tokens=16))
    last = Rollouts()
    quiet_trainer(tmp_path / "run", max_epochs=2, callbacks=[last]).fit(module, datamodule=data)
    tokenizer = load_tokenizer(folder)
    ends = model_end_ids(module.policy, tokenizer)
    assert second in ends
    rollout = last.rollouts[1]  # sampled in the background process
    check_rows_end_by_the_rule(rollout, ends, (), 0, 16, tokenizer.pad_token_id)
    finals = rollout.completion_ids.gather(1, (rollout.completion_mask.sum(-1, keepdim=True) - 1)).flatten()
    assert (~rollout.truncated & (finals == second)).any()


class NoisyEngine(LeanEngine):
    """A sampler whose copy of the weights is off (0.3 of each weight's spread, as ``test_tis``'s perturbed engine):
    the staleness the decoupled weight must see."""

    def load_weights(self, policy, version):
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
        super().load_weights(policy, version)


def behaviour_weights_at_a_lag(tmp_path, engine):
    """Round 1 of a lag-1 run with μ = 2 (π_prox recomputed): its rollout's π_prox, μ and the weights and metrics
    the loss computes from them (C = 2)."""
    from grpo_lightning.importance import truncated_importance_weights

    module = GRPOModule(tiny_model=TINY, lr=1e-7)  # the policy barely moves: staleness alone mismatches nothing
    data = lagged(
        engine=engine,
        rewards=[RewardSpec("async_digit_sum")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=8),
        prompts_per_round=4,
        update=UpdateConfig(num_iterations=2),
    )
    keep = Rollouts()
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[keep])
    trainer.fit(module, datamodule=data)
    rollout = keep.rollouts[-1]
    weights, metrics = truncated_importance_weights(
        rollout.old_logprobs, rollout.engine_logprobs, rollout.loss_mask, cap=2.0
    )
    return rollout, weights, {k: v.item() for k, v in metrics.items()}, trainer.callback_metrics


@pytest.mark.slow  # about half a minute (pytest -m slow, run by .ci/run)
def test_a_perturbed_sampler_raises_the_mismatch_and_pulls_weights_below_one_where_it_overrates(tmp_path):
    _, _, faithful, faithful_logged = behaviour_weights_at_a_lag(tmp_path / "faithful", LeanEngine())
    rollout, weights, noisy, noisy_logged = behaviour_weights_at_a_lag(tmp_path / "noisy", NoisyEngine())
    assert noisy["mismatch_kl"] > max(1e-4, 100 * faithful["mismatch_kl"])
    assert noisy["mismatch_abs_logprob"] > max(0.01, 100 * faithful["mismatch_abs_logprob"])
    assert noisy_logged["train/mismatch_kl"] > 100 * faithful_logged["train/mismatch_kl"]  # what the run logged
    mask = rollout.loss_mask.bool()
    overrated = mask & (rollout.engine_logprobs > rollout.old_logprobs)
    assert overrated.any() and (weights[overrated] < 1).all()
    assert (weights[mask & ~overrated] >= 1).all() and (weights[mask] <= 2.0).all()
