"""Training runs with the ``vllm`` engine: exact resume (3 + 3 rounds = 6) and 2-process DDP, an engine per rank.

Marked ``vllm``; skipped where vLLM is not installed. The DDP scenario is one ``torchrun --nproc_per_node=2``
launch of this file (``worker``): each rank starts its own in-process vLLM inside the trainer's process group,
samples its own prompts, and after every optimizer step the engines of both ranks receive the same weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from grpo_lightning.config import EvalConfig, UpdateConfig

ROOT = Path(__file__).resolve().parents[2]
if __name__ != "__main__" and importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

pytestmark = pytest.mark.vllm
WORLD = 2


def vllm_engine():
    from grpo_lightning.integrations.vllm.engine import VLLMEngine

    return VLLMEngine(max_model_len=128, kv_cache_memory_bytes=32 << 20)


def test_three_rounds_then_three_more_equal_six_rounds_with_vllm(tmp_path):
    """Rewards draw from every global RNG (``resume_noisy_length``): an RNG vLLM moved would show; sampling seeds
    come from the round's generator, so the resumed run samples what the uninterrupted one did."""
    from test_resume import assert_same_run, fit
    from test_vllm import VLLM_TINY

    ref_module, _, ref = fit(tmp_path / "reference", 6, tiny=VLLM_TINY, engine=vllm_engine())
    _, _, first = fit(tmp_path / "run", 3, tiny=VLLM_TINY, engine=vllm_engine())
    module, _, second = fit(tmp_path / "run", 6, ckpt_path="last", tiny=VLLM_TINY, engine=vllm_engine())
    assert len(first.positions) == len(second.positions) == 3
    assert_same_run((ref_module, ref), module, [first, second])


def test_three_plus_three_rounds_equal_six_with_vllm_at_lag_1(tmp_path):
    """At ``data.schedule.rollout_lag: 1`` vLLM runs in the background process (its own copy, pushed at each round
    boundary): the rollouts it samples ahead are checkpointed and the resumed run trains on the same tensors."""
    from test_async_rollouts import assert_same_tensors
    from test_resume import fit
    from test_vllm import VLLM_TINY

    reference = fit(tmp_path / "reference", 6, tiny=VLLM_TINY, engine=vllm_engine(), rollout_lag=1)
    _, _, first = fit(tmp_path / "run", 3, tiny=VLLM_TINY, engine=vllm_engine(), rollout_lag=1)
    module, _, second = fit(tmp_path / "run", 6, ckpt_path="last", tiny=VLLM_TINY, engine=vllm_engine(), rollout_lag=1)
    assert_same_tensors(reference, (module, [first, second]))


# --------------------------------------------------------------------------------------------- 2 processes
def engine_of_this_run():
    """The in-process engine, or the vllm_server engine when the test started a server (``GRPO_TEST_SERVER_URL``)."""
    url = os.environ.get("GRPO_TEST_SERVER_URL")
    if not url:
        return vllm_engine()
    from grpo_lightning.integrations.vllm.server import VLLMServerEngine

    return VLLMServerEngine(base_urls=[url], connect_timeout_s=60)


def worker(out: Path, model_dir: str) -> None:
    """Two rounds of 2 optimizer steps each under DDP on 2 ranks, an engine each; rank 0 writes ``results.json``."""
    from lightning import Callback, Trainer, seed_everything
    from lightning.pytorch.strategies import DDPStrategy

    from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
    from grpo_lightning.cli import TRAINER_DEFAULTS
    from grpo_lightning.engines import SamplingParams
    from grpo_lightning.models.logprobs import completion_logprobs
    from grpo_lightning.rewards import RewardSpec

    class Probe(Callback):
        """Per round: the prompts this rank drew and its engine's weights version; at the end (before the
        engine is closed), this rank's engine against its policy, gathered on rank 0."""

        def __init__(self) -> None:
            self.prompts: list[list[str]] = []
            self.versions: list[int | None] = []

        def on_train_epoch_end(self, trainer, module):
            self.prompts.append(sorted(set(trainer.datamodule.last_rollout.prompts)))
            self.versions.append(trainer.datamodule.engine.weights_version)

        def on_train_end(self, trainer, module):
            data = trainer.datamodule
            engine = data.collector.current_engine()
            engine.load_weights(module.policy, trainer.global_step)  # the push the next round would start with
            prompt_ids, prompt_mask = data.encoder().encode(["12+34=", "5+6="])
            params = SamplingParams(group_size=2, max_new_tokens=4)
            sampled = engine.generate(
                prompt_ids, prompt_mask, params, generator=torch.Generator(), return_logprobs=True
            )
            with torch.no_grad():
                trainer_lp, _ = completion_logprobs(
                    module.policy,
                    sampled.prompt_ids,
                    sampled.prompt_mask,
                    sampled.completion_ids,
                    sampled.completion_mask,
                )
            mask = sampled.completion_mask.bool()
            mine = {
                "engine": type(engine).__name__,
                "prompts": self.prompts,
                "versions": self.versions,
                "global_step": trainer.global_step,
                "logprob_gap": float((sampled.logprobs - trainer_lp)[mask].abs().max()),
                "weights": [float(p.double().sum()) for p in module.policy.parameters()],
            }
            gathered: list = [None] * WORLD
            torch.distributed.all_gather_object(gathered, mine)
            if trainer.global_rank == 0:
                (out / "results.json").write_text(json.dumps(gathered))

    seed_everything(0)
    module = GRPOModule(model_name_or_path=model_dir, objective=ObjectiveConfig(beta=0.04), lr=1e-3)
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=4),
        engine=engine_of_this_run(),
        prompts_per_round=2,
        update=UpdateConfig(mini_batch_size=4),
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(timeout=timedelta(minutes=2)),
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
        default_root_dir=out,
    )
    trainer.fit(module, datamodule=data)


@pytest.mark.parametrize("on_server", [False, True], ids=["vllm", "vllm_server"])
def test_ddp_with_an_engine_per_rank(tmp_path, on_server):
    """Each rank its own in-process vLLM; or both ranks one vLLM server, which rank 0 pushes to while rank 1
    waits at the push's barrier (rank 1's log-probs then match its policy too)."""
    from test_vllm import VLLM_TINY
    from vllm_servers import Server

    from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

    model_dir = tmp_path / "model"
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    build_tiny_llama(VLLM_TINY, tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "runs"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    server = Server(str(model_dir), tmp_path / "server.log").start() if on_server else None
    if server is not None:
        env["GRPO_TEST_SERVER_URL"] = server.url
    try:
        ranks = run_ddp(env, out, model_dir)
    finally:
        if server is not None:
            server.stop()
    engine = "VLLMServerEngine" if on_server else "VLLMEngine"
    assert [r["engine"] for r in ranks] == [engine] * WORLD
    check_ranks(ranks)


def run_ddp(env: dict, out: Path, model_dir: Path) -> list:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    process = subprocess.Popen(
        [*command, __file__, str(out), str(model_dir)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # on a timeout the whole group goes, torchrun's workers included
    )
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"2-process vLLM run did not finish in 600 s (a hang):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    if process.returncode != 0 or not (out / "results.json").exists():
        pytest.fail(f"2-process vLLM run failed ({process.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return json.loads((out / "results.json").read_text())


def check_ranks(ranks: list) -> None:
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4  # 2 rounds of 2 optimizer steps
    for rank in ranks:  # every round sampled from the weights of that round's start
        assert rank["versions"] == [0, 2]
        assert rank["logprob_gap"] < 1e-4
    for first, second in zip(ranks[0]["prompts"], ranks[1]["prompts"]):
        assert not set(first) & set(second)  # each rank its own prompts
    assert ranks[0]["weights"] == ranks[1]["weights"]  # one update on both ranks


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    worker(Path(sys.argv[1]), sys.argv[2])
