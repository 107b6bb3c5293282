"""Partial rollouts in whole runs on the vLLM engines (``data.schedule.partial_rollouts`` with ``vllm`` in the
background process, and with ``vllm_server``): sequences span pushes, and every token's behaviour log-prob μ is
the one the version it records gives it.

The tiny random model rarely ends before ``max_new_tokens``: with 12 tokens per push its 48-token completions span
4 pushes, and their contexts (prompt + tokens so far) pass a 32-token KV block of vLLM's prefix cache by the third,
so a cache left from before a push would be served (``tests/engines/test_vllm_partial.py`` shows it would). The
in-process engine's run is deterministic: 3 rounds, then 3 more from the checkpoint (sequences in flight across
it), equal 6, bit for bit. A server's run gives the same completions and rewards; it batches concurrent requests as
they arrive, which may round the last bit differently, so its losses and weights are compared to float32's own
tolerance, as the other server resume tests do (measured here: identical). ``interrupt: clock`` is not
reproducible: only what must hold is checked.

Marked ``vllm``: run in the vLLM environment (docs/vllm.md).
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from lightning import Callback, Trainer, seed_everything  # noqa: E402
from test_resume import GROUP, PROMPTS, Recorder  # noqa: E402
from test_vllm import ATOL, VLLM_TINY  # noqa: E402
from vllm_servers import BLOCK_SIZE, Server  # noqa: E402

import grpo_lightning.rollout.schedule as schedule_module  # noqa: E402
from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig  # noqa: E402
from grpo_lightning.callbacks.checkpointing import RoundCheckpoint  # noqa: E402
from grpo_lightning.callbacks.kl import KLController  # noqa: E402
from grpo_lightning.checkpoint_io import AtomicCheckpointIO  # noqa: E402
from grpo_lightning.cli import TRAINER_DEFAULTS  # noqa: E402
from grpo_lightning.config import EvalConfig, ScheduleConfig, UpdateConfig  # noqa: E402
from grpo_lightning.models.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama  # noqa: E402
from grpo_lightning.rewards import RewardSpec  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_NEW, BUDGET = 48, 12
SCHEDULE = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=BUDGET)  # max_staleness 4


class Rounds(Callback):
    """Per round: its partial-rollout metrics, and the policy's weights at its start (the version it pushes)."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_start(self, trainer, module):
        self.weights[trainer.current_epoch] = copy.deepcopy(module.policy.state_dict())

    def on_train_epoch_end(self, trainer, module):
        metrics = trainer.datamodule.last_rollout.metrics
        self.metrics.append({k: v for k, v in metrics.items() if k.startswith("rollout/") and "time" not in k})


@pytest.fixture
def admitted(monkeypatch):
    """Each round's admitted rollout and its tokens' versions, as ``admit`` returns them to the schedule."""
    rounds: list[tuple[int, object, torch.Tensor]] = []
    admit = schedule_module.admit

    def recording(queue, round_index, settings):
        sampled, versions = admit(queue, round_index, settings)
        rounds.append((round_index, copy.deepcopy(sampled.batch), versions.clone()))
        return sampled, versions

    monkeypatch.setattr(schedule_module, "admit", recording)
    return rounds


def vllm_engine():
    from grpo_lightning.integrations.vllm.engine import VLLMEngine

    return VLLMEngine(max_model_len=128, kv_cache_memory_bytes=32 << 20, extra_args={"block_size": BLOCK_SIZE})


def server_engine(server: Server):
    from grpo_lightning.integrations.vllm.server import VLLMServerEngine

    return VLLMServerEngine(base_urls=[server.url], connect_timeout_s=60)


def fit(dirpath, epochs, engine, *, ckpt_path=None, schedule=SCHEDULE):
    """``test_partial_runs.fit``'s recipe (a reward reading every global RNG, adaptive β) on ``engine``."""
    seed_everything(0)
    module = GRPOModule(tiny_model=VLLM_TINY, objective=ObjectiveConfig(beta=0.05), lr=1e-3, warmup_steps=3)
    data = RolloutDataModule(
        rewards=[RewardSpec("resume_noisy_length")],
        sampling=SamplingConfig(group_size=GROUP, max_new_tokens=MAX_NEW),
        engine=engine,
        schedule=schedule,
        prompts_per_round=PROMPTS,
        update=UpdateConfig(mini_batch_size=4),
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    recorder, rounds = Recorder(), Rounds()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder, rounds, KLController(target_kl=0.001, horizon=100), RoundCheckpoint(dirpath=str(dirpath))],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=dirpath,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, recorder, rounds


def check_sequences_span_pushes(rounds: Rounds, admitted: list) -> None:
    """Staleness and interruptions in the metrics; every admitted token's version within the bound, its count in
    ``tokens_behind_*``; sequences whose tokens come from several versions."""
    assert all(m["rollout/staleness_max"] <= SCHEDULE.max_staleness for m in rounds.metrics)
    assert all(m["rollout/interrupted_sequences"] > 0 and m["rollout/staleness_mean"] > 0 for m in rounds.metrics[1:])
    spanning = 0
    for (round_index, batch, versions), metrics in zip(admitted, rounds.metrics, strict=True):
        mask = batch.completion_mask.bool()
        assert ((versions >= 0) == mask).all()  # a version on every completion token, none on padding
        ages = round_index - versions[mask]
        assert ages.min() >= 0 and ages.max() <= SCHEDULE.max_staleness
        for age in range(SCHEDULE.max_staleness + 1):
            assert metrics[f"rollout/tokens_behind_{age}"] == float((ages == age).sum())
        spanning += sum(len(set(row[m].tolist())) > 1 for row, m in zip(versions, mask))
    assert spanning > 0


def check_behaviour_logprobs_are_their_versions(rounds: Rounds, admitted: list, model: torch.nn.Module) -> None:
    """Each token's μ (the engine's log-prob, kept as ``engine_logprobs``) is the log-prob of the weights of the
    version it records (temperature 1, no filter: μ is the policy's), within vLLM's float32 rounding; a stale
    prefix cache, or a token decoded on other weights than its version's, would be off by far more."""
    model = copy.deepcopy(model).eval()
    for round_index, batch, versions in admitted:
        mask = batch.completion_mask.bool()
        assert batch.engine_logprobs is not None
        for version in versions[mask].unique().tolist():
            model.load_state_dict(rounds.weights[version])
            with torch.no_grad():
                expected, _ = completion_logprobs(
                    model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
                )
            drawn = versions == version
            gap = (batch.engine_logprobs - expected)[drawn].abs().max()
            assert gap < ATOL, (round_index, version, float(gap))


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_vllm_in_process_three_rounds_then_three_more_equal_six_with_sequences_in_flight(tmp_path, admitted):
    reference, ref_run, ref_rounds = fit(tmp_path / "reference", 6, vllm_engine())
    check_sequences_span_pushes(ref_rounds, admitted)
    check_behaviour_logprobs_are_their_versions(ref_rounds, admitted, reference.policy)
    _, first, first_rounds = fit(tmp_path / "run", 3, vllm_engine())
    saved = torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)
    (state,) = next(v for k, v in saved.items() if "DataModule" in k)["background"]
    assert [s for g in state["pool"]["groups"] for s in g["samples"] if 0 < len(s["tokens"]) < MAX_NEW]
    module, second, second_rounds = fit(tmp_path / "run", 6, vllm_engine(), ckpt_path="last")
    assert first.completions + second.completions == ref_run.completions
    assert same(first.rewards + second.rewards, ref_run.rewards)
    assert same(first.losses + second.losses, ref_run.losses)
    assert first_rounds.metrics + second_rounds.metrics == ref_rounds.metrics
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A server of the architecture ``fit`` trains (``VLLM_TINY``, the char tokenizer); the runs push their own
    weights before sampling."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    build_tiny_llama(VLLM_TINY, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    server = Server(str(path), tmp_path_factory.mktemp("server") / "server.log").start()
    yield server
    server.stop()


def test_vllm_server_three_rounds_then_three_more_equal_six_with_sequences_in_flight(tmp_path, admitted, tiny_server):
    reference, ref_run, ref_rounds = fit(tmp_path / "reference", 6, server_engine(tiny_server))
    check_sequences_span_pushes(ref_rounds, admitted)
    check_behaviour_logprobs_are_their_versions(ref_rounds, admitted, reference.policy)
    _, first, first_rounds = fit(tmp_path / "run", 3, server_engine(tiny_server))
    module, second, second_rounds = fit(tmp_path / "run", 6, server_engine(tiny_server), ckpt_path="last")
    assert first.completions + second.completions == ref_run.completions
    assert same(first.rewards + second.rewards, ref_run.rewards)
    assert first_rounds.metrics + second_rounds.metrics == ref_rounds.metrics
    torch.testing.assert_close(torch.stack(first.losses + second.losses), torch.stack(ref_run.losses))
    torch.testing.assert_close(module.state_dict(), reference.state_dict())


@pytest.mark.parametrize("on_server", [False, True], ids=["vllm", "vllm_server"])
def test_clock_mode_trains_within_the_bound_and_decodes_until_each_push(tmp_path, admitted, on_server, request):
    """``interrupt: clock``: the background process runs segments back to back under the weights it holds until the
    next push is queued; a push waits for the segment being decoded (vLLM's requests are never aborted), so every
    token still records the version that drew it. Not reproducible, so only what must hold."""
    engine = server_engine(request.getfixturevalue("tiny_server")) if on_server else vllm_engine()
    module, run, rounds = fit(tmp_path, 3, engine, schedule=replace(SCHEDULE, interrupt="clock"))
    assert len(run.losses) and all(torch.isfinite(loss) for loss in run.losses)
    assert all(m["rollout/staleness_max"] <= SCHEDULE.max_staleness for m in rounds.metrics)
    assert all(m["rollout/segments"] >= 1 for m in rounds.metrics[1:])
    check_behaviour_logprobs_are_their_versions(rounds, admitted, module.policy)
