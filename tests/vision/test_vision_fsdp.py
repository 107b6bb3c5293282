"""FSDP2 on 2 CPU processes (gloo) training a tiny Qwen2-VL (issue 42): ``FSDP2Strategy`` (Lightning's
``ModelParallelStrategy``, ``fully_shard`` per decoder layer and vision block, then the root), two rounds on the
counting prompts with the ``transformers`` engine; the ranks agree, the language model trains, the frozen vision
tower stays exactly as loaded.

One ``torchrun --nproc_per_node=2`` launch of this file (``worker``) writes its results to a folder; the test reads
them.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_on_two_processes
from lightning import Callback, Trainer

from grpo_lightning.config import UpdateConfig

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight in full (FSDP2 shards all-gathered: a collective, on every rank), detached copies."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = value.detach().cpu().clone()
    return out


class StartWeights(Callback):
    """The policy's full weights when training starts (after sharding)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Trainer, module: Any) -> None:
        self.weights = full_weights(module.policy)


def worker(out: Path, model_dir: str, data_file: str) -> None:
    """Two rounds of GRPO on the tiny Qwen2-VL under FSDP2, on this rank; rank 0 writes ``results.json``."""
    from test_vision_fit import count_reward  # noqa: F401 - registers the reward

    from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
    from grpo_lightning.cli import TRAINER_DEFAULTS
    from grpo_lightning.integrations.vision.models import vision_towers
    from grpo_lightning.rewards import RewardSpec
    from grpo_lightning.strategies import FSDP2Strategy

    module = GRPOModule(model_name_or_path=model_dir, objective=ObjectiveConfig(beta=0.04), lr=1e-2)
    data = RolloutDataModule(
        dataset=data_file,
        engine="transformers",
        rewards=[RewardSpec("test_vision_count")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=4, temperature=1.0),
        prompts_per_round=2,  # per rank
        update=UpdateConfig(mini_batch_size=2, micro_batch_size=2),
    )
    start = StartWeights()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        accelerator="cpu",
        devices=WORLD,
        strategy=FSDP2Strategy(timeout=timedelta(minutes=2)),
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[start],
        default_root_dir=out,
    )
    trainer.fit(module, datamodule=data)
    final = full_weights(module.policy)
    ranks: list[Any] = [None] * WORLD
    torch.distributed.all_gather_object(ranks, final)
    tower = {id(p) for t in vision_towers(module.policy) for p in t.parameters()}
    tower_names = {name for name, p in module.policy.named_parameters() if id(p) in tower}
    rollout = data.last_rollout
    change = {name: (final[name] - start.weights[name]).abs().max().item() for name in final}
    results = {
        "global_step": trainer.global_step,
        "sharded": sum(hasattr(p, "full_tensor") for p in module.policy.parameters()),
        "parameters": sum(1 for _ in module.policy.parameters()),
        "tower_parameters": len(tower_names),
        "tower_trainable": sum(p.requires_grad for t in vision_towers(module.policy) for p in t.parameters()),
        "tower_max_change": max(change[name] for name in tower_names),
        "language_max_change": max(change[name] for name in change if name not in tower_names),
        "rank_max_diff": max((ranks[0][k] - ranks[1][k]).abs().max().item() for k in final),
        "image_rows": sum("image_grid_thw" in row for row in rollout.vision),
        "rows": len(rollout),
        "old_logprobs": rollout.old_logprobs is not None,
    }
    if int(os.environ["RANK"]) == 0:
        (out / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from test_vision_fit import count_file

    from grpo_lightning.integrations.vision.tiny import build_tiny_vlm

    folder = tmp_path_factory.mktemp("fsdp-vlm")
    model_dir, data_file = build_tiny_vlm("qwen2_vl", folder / "qwen2_vl"), count_file(folder, rows=8)
    out = folder / "out"
    out.mkdir()
    run_on_two_processes(__file__, out, str(model_dir), data_file, outputs=["results.json"])
    return json.loads((out / "results.json").read_text())


def test_the_vision_blocks_stay_in_the_root_unit(tmp_path, tiny_llama):
    """``shard_model``'s units: every decoder layer of the language model, no vision block (``generate()`` runs the
    vision encoder before the root's forward, which FSDP2 needs first); a text model's layers all."""
    from transformers import AutoModelForImageTextToText

    from grpo_lightning.integrations.vision.modality import IMAGES
    from grpo_lightning.integrations.vision.tiny import build_tiny_vlm
    from grpo_lightning.strategies import decoder_layers

    model = AutoModelForImageTextToText.from_pretrained(str(build_tiny_vlm("qwen2_vl", tmp_path / "qwen2_vl")))
    assert "Qwen2VLVisionBlock" in model._no_split_modules
    assert [type(m).__name__ for m in decoder_layers(model, IMAGES)] == ["Qwen2VLDecoderLayer"] * 2
    assert len(decoder_layers(tiny_llama)) == len(tiny_llama.model.layers) == 2


def test_fsdp2_on_two_processes_trains_the_language_model_with_the_vision_tower_frozen(fsdp_results):
    results = fsdp_results
    assert results["global_step"] == 4  # 2 rounds × 2 optimizer steps
    assert results["sharded"] == results["parameters"] > 0  # every parameter a DTensor shard
    assert results["rows"] == 4 and results["image_rows"] >= 1 and results["old_logprobs"]
    assert results["rank_max_diff"] == 0.0
    assert results["tower_parameters"] > 0 and results["tower_trainable"] == 0
    assert results["tower_max_change"] == 0.0
    assert results["language_max_change"] > 0.0


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
