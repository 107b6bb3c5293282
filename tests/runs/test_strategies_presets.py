"""The strategy presets (``configs/strategies/*.yaml``) composed with the quickstart, its W&B logger and callbacks
included, on 2 CPU processes; and 2 nodes of 1 process each, simulated on this machine as Lightning's docs launch
them on a cluster (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``WORLD_SIZE`` and ``trainer.num_nodes``).

Every run is a ``python -m grpo_lightning fit`` subprocess under a short process-group timeout, so that a collective
one process never joins fails the run with gloo's "Timed out" error, and under a timeout of its own (its whole
process group is killed), so that nothing can hang the suite. ``SaveFinalWeights`` (added on the command line)
writes each rank's step count and full weights for the checks.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import SingleDeviceStrategy

pytestmark = pytest.mark.slow  # about a minute a test: the slow tier (`pytest -m slow`, .ci/run)

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
PRESETS = sorted(path.stem for path in (ROOT / "configs" / "strategies").glob("*.yaml"))
MODEL = ROOT / "grpo_lightning" / "assets" / "tiny-arith"
STEPS = 3
PG_TIMEOUT = "0:01:00"  # process-group timeout in the tests (the presets: 30 min)
RUN_TIMEOUT_S = 420  # a whole run, startup included; the suite's last line of defence against a hang
# Launch settings of an outer launcher (torchrun, SLURM, a test run under either) that would change how the run
# below starts its processes.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK")
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_")


class SaveFinalWeights(Callback):
    """Test helper: at the end of ``fit``, every rank saves ``{"global_step", "weights"}`` to ``<out>/rank<r>.pt``;
    sharded (FSDP2) weights are all-gathered, on every rank."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        weights = {}
        for name, value in pl_module.policy.state_dict().items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            weights[name] = value.detach().cpu().clone()
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": trainer.global_step, "weights": weights}, self.out / f"rank{trainer.global_rank}.pt")


def fit_command(preset: str, out: Path, *overrides: str) -> list[str]:
    """The quickstart with ``preset``, ``STEPS`` optimizer steps of a smaller round, and ``SaveFinalWeights``."""
    callback = {
        "class_path": f"tests.{Path(__file__).parent.name}.{Path(__file__).stem}.SaveFinalWeights",
        "init_args": {"out": str(out)},
    }
    return [
        *(sys.executable, "-m", "grpo_lightning", "fit", "--config", str(QUICKSTART)),
        *("--config", str(ROOT / "configs" / "strategies" / f"{preset}.yaml")),
        *("--model.model_name_or_path", str(MODEL), "--trainer.max_steps", str(STEPS)),
        *("--data.prompts_per_round", "8", "--data.update.mini_batch_size", "32"),  # 2 steps per round of 8 × G=8
        *("--trainer.strategy.init_args.timeout", PG_TIMEOUT, "--trainer.enable_progress_bar", "false"),
        f"--trainer.callbacks+={json.dumps(callback)}",
        *overrides,
    ]


def run_environment(root: Path, **extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCH_VARIABLES and not key.startswith(LAUNCH_PREFIXES)
    }
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),  # for tests.<this file>
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        **{name: str(root / name.lower()) for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")},
    )
    env.update(extra)
    return env


def start(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    # A session of its own: on a timeout the whole group goes, the ranks Lightning started included.
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(processes: list[subprocess.Popen], timeout_s: float = RUN_TIMEOUT_S) -> list[str]:
    """Every process's output; fails the test (after killing every process group) when one is still running after
    ``timeout_s`` or exits with an error."""
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        tails = "\n".join((process.communicate()[0] or "")[-3000:] for process in processes)
        pytest.fail(f"the run did not finish in {timeout_s} s (a hang):\n{tails}")
    for process, output in zip(processes, outputs):
        if process.returncode != 0:
            pytest.fail(f"the run failed ({process.returncode}):\n{output[-6000:]}")
    return outputs


def load_ranks(out: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world)]


def assert_same_weights(ranks: list[dict[str, Any]]) -> None:
    first = ranks[0]["weights"]
    for other in ranks[1:]:
        assert other["weights"].keys() == first.keys()
        for name, value in first.items():
            assert torch.equal(other["weights"][name], value), name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------- the tests
# DDP is test_two_nodes_one_process_each's run (the same preset and command line on 2 processes, at lag 1) and
# DDP at lag 0 the 2-process runs of test_distributed.py: the suite keeps its time for the cases nothing else starts.
PRESET_CASES = [(preset, lag) for preset in PRESETS for lag in (0, 1) if preset != "ddp"]


@pytest.mark.parametrize("preset,lag", PRESET_CASES, ids=[f"{preset}-lag{lag}" for preset, lag in PRESET_CASES])
def test_preset_with_quickstart_on_two_processes(preset: str, lag: int, tmp_path: Path) -> None:
    """The issue's command: ``--config configs/quickstart.yaml --config configs/strategies/<preset>.yaml`` with 2
    processes (Lightning starts the second) runs its steps, saves its checkpoint and config, and ends with the same
    weights on both ranks; also at ``data.schedule.rollout_lag: 1`` (a background process per rank samples ahead)."""
    devices = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--data.schedule.rollout_lag", str(lag)]
    if preset == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
        if torch.cuda.device_count() < 2:
            pytest.skip("the DeepSpeed preset needs 2 CUDA devices")
        devices = ["--trainer.accelerator", "gpu", "--trainer.devices", "2", "--data.schedule.rollout_lag", str(lag)]
    out = tmp_path / "weights"
    finish([start(fit_command(preset, out, *devices), tmp_path, run_environment(tmp_path))])
    ranks = load_ranks(out, 2)
    assert [rank["global_step"] for rank in ranks] == [STEPS, STEPS]
    assert all(torch.isfinite(value).all() for value in ranks[0]["weights"].values())
    assert_same_weights(ranks)
    checkpoints = list(tmp_path.glob("runs/**/last.ckpt"))
    assert len(checkpoints) == 1  # a file (DDP) or a sharded folder (FSDP2)
    if preset == "fsdp":  # the command line's sharded checkpoint (its hyperparameters hold `_instantiator`)
        sys.path.insert(0, str(ROOT / "tools"))
        from consolidate_fsdp import consolidate

        assert (consolidate(checkpoints[0], tmp_path / "hf") / "config.json").is_file()
    # The W&B run (offline) holds the resolved config: written on rank 0, where the hang used to start.
    saved = list(tmp_path.glob("runs/**/wandb/offline-run-*/files/config.yaml"))
    assert len(saved) == 1 and "strategy" in yaml.safe_load(saved[0].read_text())["trainer"]


def test_two_nodes_one_process_each(tmp_path: Path) -> None:
    """Past one machine as Lightning's launcher does it on a cluster it does not manage: the same command on every
    node with ``MASTER_ADDR``/``MASTER_PORT`` of node 0, ``NODE_RANK``, ``WORLD_SIZE`` and ``trainer.num_nodes``.
    Two "nodes" here (each in a folder of its own) of one process each, over gloo; DDP keeps their weights equal,
    at ``data.schedule.rollout_lag: 1`` (a background process per node samples ahead)."""
    out = tmp_path / "weights"
    command = fit_command("ddp", out, "--trainer.accelerator", "cpu", "--trainer.num_nodes", "2")
    command += ["--trainer.devices", "1", "--data.schedule.rollout_lag", "1"]
    port = str(free_port())
    nodes = [
        start(
            command,
            tmp_path / f"node{rank}",
            run_environment(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank), WORLD_SIZE="2"),
        )
        for rank in range(2)
    ]
    outputs = finish(nodes)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    ranks = load_ranks(out, 2)
    assert [rank["global_step"] for rank in ranks] == [STEPS, STEPS]
    assert_same_weights(ranks)
    from safetensors.torch import load_file

    initial = load_file(MODEL / "model.safetensors")
    assert any(not torch.equal(ranks[0]["weights"][name], value) for name, value in initial.items())  # it trained
    # Rank 0 writes the checkpoint and the W&B run, in node 0's folder.
    assert len(list((tmp_path / "node0").glob("runs/**/last.ckpt"))) == 1


def test_presets_bound_the_wait_for_a_collective() -> None:
    """Each preset sets a process-group timeout: a collective some process never joins ends the run with an error
    instead of a hang (but a generous one: a rollout round or a checkpoint save keeps processes apart)."""
    for preset in PRESETS:
        config = yaml.safe_load((ROOT / "configs" / "strategies" / f"{preset}.yaml").read_text())
        timeout = str(config["trainer"]["strategy"]["init_args"]["timeout"])
        hours, minutes, seconds = (int(part) for part in timeout.split(":"))
        assert timedelta(minutes=10) <= timedelta(hours=hours, minutes=minutes, seconds=seconds) <= timedelta(hours=2)


class CountingStrategy(SingleDeviceStrategy):
    """One process playing rank ``rank`` of 2, counting the collectives it is asked for."""

    def __init__(self, rank: int) -> None:
        super().__init__(device=torch.device("cpu"))
        self.global_rank, self.world_size, self.collectives = rank, 2, 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.collectives += 1
        return obj

    def barrier(self, name: str | None = None) -> None:
        self.collectives += 1


class StubWandbLogger(WandbLogger):
    """A ``WandbLogger`` whose run is a folder (nothing starts W&B)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(save_dir=str(run_dir.parent), offline=True)
        self.run = type("Run", (), {"dir": str(run_dir), "save": lambda *args, **kwargs: None})()
        self.hyperparameters: list[dict[str, Any]] = []

    @property
    def experiment(self) -> Any:
        return self.run

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.hyperparameters.append(params)


def test_config_callback_makes_the_same_collectives_on_every_rank(tmp_path: Path) -> None:
    """The cause of the hang: saving the config on rank 0 asked ``trainer.log_dir``, a broadcast the other ranks
    never joined. ``LoggerSaveConfigCallback.setup`` must ask for as many collectives on rank 0 as on rank 1."""
    from lightning.pytorch.cli import LightningArgumentParser

    from grpo_lightning.callbacks import LoggerSaveConfigCallback

    parser = LightningArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    counts = []
    for rank in (0, 1):
        run_dir = tmp_path / f"rank{rank}" / "run"
        run_dir.mkdir(parents=True)
        logger = StubWandbLogger(run_dir)
        strategy = CountingStrategy(rank)
        trainer = Trainer(accelerator="cpu", strategy=strategy, logger=logger, enable_progress_bar=False)
        callback = LoggerSaveConfigCallback(parser, parser.parse_args([]), overwrite=True)
        callback.setup(trainer, LightningModule(), "fit")
        counts.append(strategy.collectives)
        assert bool(logger.hyperparameters) == (rank == 0)
        assert (run_dir / "config.yaml").exists() == (rank == 0)
    assert counts[0] == counts[1] > 0


def test_deepspeed_zero2_one_step(tmp_path: Path) -> None:
    """DeepSpeed through Lightning's strategy: needs the deepspeed package and a CUDA device."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
    if not torch.cuda.is_available():
        pytest.skip("DeepSpeed needs a CUDA device")
    from conftest import TINY
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from test_distributed import make_run

    from grpo_lightning.cli import TRAINER_DEFAULTS
    from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

    tokenizer, model_dir = build_char_tokenizer(), tmp_path / "model"
    build_tiny_llama(TINY, tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    module, data, trainer, record = make_run(str(model_dir), tmp_path, epochs=1)
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        accelerator="gpu",
        devices=1,
        strategy=DeepSpeedStrategy(stage=2),
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[record],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1 and all(math.isfinite(loss) for loss in record.losses)
