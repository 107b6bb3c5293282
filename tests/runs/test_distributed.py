"""Data parallelism on 2 CPU processes (gloo): DDP and FSDP2 (``FSDP2Strategy``), checkpoints and consolidation.

One ``torchrun --nproc_per_node=2`` launch of this file (``worker``) runs every 2-process scenario and writes its
results to a folder; the tests check them against each other and against a single-process run of this process.
Equivalence runs sample with ``FixedRolloutEngine``: completions are a fixed function of the prompt's tokens, so
one process with 4 prompts per round and two with 2 each train on the same rollout (``SGDModule`` updates it).
"""

from __future__ import annotations

import json
import math
import os
import sys
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import checksum_reward, load_tool, run_on_two_processes, save_tiny_llama
from lightning import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import AdvantageConfig, EvalConfig, UpdateConfig
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.engines.weights import policy_weights
from grpo_lightning.lora import LoraConfig
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.strategies import FSDP2Strategy

ROOT = Path(__file__).resolve().parents[2]
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
WORLD, GROUP, PROMPTS = 2, 4, 4  # PROMPTS per round in all, split over the ranks
# Equivalence runs exercise the cross-rank reductions: each loss normalisation over the whole mini-batch (a
# token-level one for dapo, per completion for grpo, a constant for dr_grpo), with truncated completions emptied
# out of the loss (their rows count as 0), and advantages scaled by the std of the whole batch; micro-batches with
# gradient accumulation on top.
EQUIVALENCE = {"advantage": AdvantageConfig(scale="batch")}
EQUIVALENT_UPDATE = {"mask_truncated_completions": True}  # of data.update
EQUIVALENT_LOSSES = ("dapo", "grpo", "dr_grpo")
PACKING = {  # FSDP2 runs of the dapo equivalence, padded and packed (models/packing.py): data.update settings
    "fsdp_padded": {"pack_tokens": None, "balance_micro_batches": False},
    "fsdp_packed": {"pack_tokens": 24, "balance_micro_batches": True},
}
SGD_LR = 0.5
# A collective that one rank never joins fails the worker after this (gloo's "Timed out"), instead of hanging it.
PG_TIMEOUT = timedelta(minutes=2)


register("dist_checksum")(checksum_reward)


class FixedRolloutEngine(RolloutEngine):
    """Completions drawn from a generator seeded by the prompt's tokens, whatever the rank or the batch."""

    name = "fixed"

    def setup(self, policy: torch.nn.Module, tokenizer: Any, *modality: Any) -> None:
        super().setup(policy, tokenizer, *modality)
        self.vocab_size = len(tokenizer)

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
    ) -> Completions:
        # No sampler log-probs (Completions.logprobs stays None): π_old is then recomputed when μ > 1.
        group, length = (1 if params.greedy else params.group_size), params.max_new_tokens
        ids, masks = [], []
        for row, mask_row in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            prompt = [token for token, keep in zip(row, mask_row) if keep]  # the padding-free prompt
            seeded = torch.Generator().manual_seed(zlib.crc32(json.dumps(prompt).encode()))
            tokens = torch.randint(3, self.vocab_size, (group, length), generator=seeded)
            lengths = torch.randint(1, length + 1, (group,), generator=seeded)
            mask = (torch.arange(length)[None] < lengths[:, None]).long()
            ids.append(tokens.masked_fill(mask == 0, self.pad_token_id))
            masks.append(mask)
        masks = torch.cat(masks).to(prompt_ids.device)
        return Completions(
            prompt_ids=prompt_ids.repeat_interleave(group, 0),
            prompt_mask=prompt_mask.repeat_interleave(group, 0),
            completion_ids=torch.cat(ids).to(prompt_ids.device),
            completion_mask=masks,
            truncated=masks.sum(-1) == length,
        )


class SGDModule(GRPOModule):
    """GRPO with plain SGD (the equivalence runs)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Plain SGD: the update is proportional to the gradient, so a gradient off by a constant factor (a count
        # or a std taken on one rank instead of all) shows, where Adam's normalised step would hide it.
        return torch.optim.SGD([p for p in self.policy.parameters() if p.requires_grad], lr=SGD_LR)


class Record(Callback):
    """Losses of every optimizer step, and the policy's weights when training starts (after any resume)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.start_weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Trainer, module: GRPOModule) -> None:
        self.start_weights = full_weights(module.policy)

    def on_train_batch_end(self, trainer: Trainer, module: GRPOModule, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight in full on every rank (FSDP2 shards all-gathered), detached copies on CPU."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = value.detach().cpu().clone()
    return out


def make_run(
    model_dir: str,
    root: Path,
    *,
    strategy: Any = "auto",
    devices: int = 1,
    epochs: int = 3,
    fixed: bool = False,
    checkpoints: bool = False,
    loss_type: str = "dapo",
    update_options: dict[str, Any] | None = None,
    **module_options: Any,
) -> tuple[GRPOModule, RolloutDataModule, Trainer, Record]:
    """A tiny GRPO run: ``PROMPTS`` prompts per round over all ranks, G=4, one optimizer step of 2 micro-batches."""
    per_rank = PROMPTS // devices
    rollout = per_rank * GROUP
    module = (SGDModule if fixed else GRPOModule)(
        model_name_or_path=model_dir,
        objective=ObjectiveConfig(beta=0.04, **({"loss_type": loss_type} if fixed else {})),
        lr=1e-3,
        logprob_chunk_size=5,  # several chunks per micro-batch, some spanning rows
        **module_options,
    )
    data = RolloutDataModule(
        rewards=[RewardSpec("dist_checksum")],
        sampling=SamplingConfig(group_size=GROUP, max_new_tokens=4),
        **({**EQUIVALENCE, "engine": FixedRolloutEngine()} if fixed else {}),
        prompts_per_round=per_rank,
        update=UpdateConfig(
            mini_batch_size=rollout,
            micro_batch_size=rollout // 2,
            **(EQUIVALENT_UPDATE if fixed else {}),
            **(update_options or {}),
        ),
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    record = Record()
    callbacks: list[Callback] = [record]
    if checkpoints:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=root / "checkpoints", save_last=True, save_top_k=0))
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=None if fixed else 1.0,  # clipping would hide a gradient's scale too
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=checkpoints,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )
    return module, data, trainer, record


# --------------------------------------------------------------------------------------------- the worker
def worker(out: Path, model_dir: str) -> None:
    """Every 2-process scenario, in one launch (starting processes is the expensive part on CPU)."""
    results: dict[str, Any] = {}
    rank = int(os.environ["RANK"])

    def finish(name: str, module: GRPOModule, trainer: Trainer, record: Record) -> dict[str, torch.Tensor]:
        weights = full_weights(module.policy)
        gathered: list[Any] = [None] * WORLD
        torch.distributed.all_gather_object(gathered, weights)
        results[name] = {
            "losses": record.losses,
            "global_step": trainer.global_step,
            "rank_max_diff": max((gathered[0][k] - gathered[1][k]).abs().max().item() for k in weights),
        }
        if rank == 0:
            torch.save(weights, out / f"{name}.pt")
        return weights

    # A fresh strategy per Trainer.
    strategies = {"ddp": lambda: DDPStrategy(timeout=PG_TIMEOUT), "fsdp": lambda: FSDP2Strategy(timeout=PG_TIMEOUT)}
    for name, strategy in strategies.items():
        module, data, trainer, record = make_run(
            model_dir, out / name, strategy=strategy(), devices=WORLD, checkpoints=name == "fsdp"
        )
        trainer.fit(module, datamodule=data)
        weights = finish(name, module, trainer, record)
        for loss_type in EQUIVALENT_LOSSES if name == "ddp" else ("dapo",):
            module, data, trainer, record = make_run(
                model_dir, out / f"{name}_eq", strategy=strategy(), devices=WORLD, fixed=True, loss_type=loss_type
            )
            trainer.fit(module, datamodule=data)
            finish(f"{name}_eq_{loss_type}", module, trainer, record)

    # FSDP2, padded rows in equal-count micro-batches against packed bins in token-balanced ones (the model's own
    # forward: FSDP2's sharded weights have no lean forward); the packed forwards are counted.
    import grpo_lightning.models.logprobs as logprobs

    packed_forwards, full_packing = [0], logprobs.full_packing

    def counted(*args: Any, **kwargs: Any) -> Any:
        packed_forwards[0] += 1
        return full_packing(*args, **kwargs)

    logprobs.full_packing = counted
    for name, options in PACKING.items():
        module, data, trainer, record = make_run(
            model_dir, out / name, strategy=strategies["fsdp"](), devices=WORLD, fixed=True, update_options=options
        )
        packed_forwards[0] = 0
        trainer.fit(module, datamodule=data)
        finish(name, module, trainer, record)
        results[name]["packed_forwards"] = packed_forwards[0]
    logprobs.full_packing = full_packing

    # FSDP2: resume the 3-round run from its sharded checkpoint for 2 more rounds.
    module, data, trainer, record = make_run(
        model_dir, out / "fsdp", strategy=strategies["fsdp"](), devices=WORLD, epochs=5, checkpoints=True
    )
    trainer.fit(module, datamodule=data, ckpt_path=out / "fsdp" / "checkpoints" / "last.ckpt")
    finish("fsdp_resumed", module, trainer, record)
    results["fsdp_resumed"]["resume_max_diff"] = max(
        (record.start_weights[k] - weights[k]).abs().max().item() for k in weights
    )
    results["fsdp_resumed"]["position"] = data.position
    probe = torch.tensor([[5, 17, 30, 42, 8, 11]])
    with torch.no_grad():
        logits = module.policy(input_ids=probe).logits  # a sharded forward: every rank takes part
    if rank == 0:
        torch.save({"input_ids": probe, "logits": logits}, out / "fsdp_logits.pt")
    # What an engine with its own copy (vLLM) is pushed: each parameter gathered on its own, the full values.
    pushed = dict(policy_weights(module.policy))
    full = full_weights(module.policy)
    results["fsdp_push"] = {
        "names_equal": sorted(pushed) == sorted(full),
        "max_diff": max((pushed[k] - full[k]).abs().max().item() for k in full),
    }

    # FSDP2 with LoRA (reference = adapter disabled) and gradient checkpointing.
    module, data, trainer, record = make_run(
        model_dir,
        out / "fsdp_lora",
        strategy=strategies["fsdp"](),
        devices=WORLD,
        epochs=2,
        lora=LoraConfig(r=4, alpha=8),
        gradient_checkpointing=True,
    )
    trainer.fit(module, datamodule=data)
    lora = finish("fsdp_lora", module, trainer, record)
    results["fsdp_lora"]["changed"] = sorted(k for k in lora if not torch.equal(lora[k], record.start_weights[k]))
    # The LoRA push: W + (α / r)·B·A under the plain model's names, from the sharded adapters.
    pushed, prefix, diffs = dict(policy_weights(module.policy)), "base_model.model.", []
    for name, tensor in pushed.items():
        layer = prefix + name.removesuffix(".weight")
        if f"{layer}.base_layer.weight" in lora:
            delta = lora[f"{layer}.lora_B.default.weight"] @ lora[f"{layer}.lora_A.default.weight"]
            diffs.append((tensor - lora[f"{layer}.base_layer.weight"] - 2.0 * delta).abs().max().item())
        else:
            diffs.append((tensor - lora[prefix + name]).abs().max().item())
    results["fsdp_lora"]["push_max_diff"], results["fsdp_lora"]["merged_layers"] = (
        max(diffs),
        sum(f"{prefix}{n.removesuffix('.weight')}.base_layer.weight" in lora for n in pushed),
    )
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("dist-model"), TINY)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> tuple[Path, dict[str, Any]]:
    """Launch the worker on 2 processes once; its output folder and results."""
    out = tmp_path_factory.mktemp("dist-runs")
    run_on_two_processes(__file__, out, model_dir, outputs=["results.json"])
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """The equivalence runs on one process, per loss type: all prompts of a round on one rank."""
    out = {}
    for loss_type in EQUIVALENT_LOSSES:
        module, data, trainer, _ = make_run(
            model_dir, tmp_path_factory.mktemp("single"), fixed=True, loss_type=loss_type
        )
        trainer.fit(module, datamodule=data)
        assert data.last_rollout.truncated.any() and not data.last_rollout.truncated.all()  # some rows emptied
        out[loss_type] = full_weights(module.policy)
    return out


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_three_steps_finite_and_ranks_identical(two_processes: tuple[Path, dict[str, Any]], name: str) -> None:
    _, results = two_processes
    run = results[name]
    assert run["global_step"] == 3 and len(run["losses"]) == 3 * 2  # 3 rounds × 2 micro-batches
    assert all(math.isfinite(loss) for loss in run["losses"])
    assert run["rank_max_diff"] == 0.0


def test_the_engine_push_under_fsdp2_gathers_the_full_weights(two_processes: tuple[Path, dict[str, Any]]) -> None:
    """``engines.weights.policy_weights``: what a vLLM engine is given, under FSDP2, plain and with LoRA merged in."""
    _, results = two_processes
    assert results["fsdp_push"] == {"names_equal": True, "max_diff": 0.0}
    assert results["fsdp_lora"]["merged_layers"] > 0 and results["fsdp_lora"]["push_max_diff"] < 1e-6


@pytest.mark.parametrize("strategy,loss_type", [("ddp", "dapo"), ("ddp", "grpo"), ("ddp", "dr_grpo"), ("fsdp", "dapo")])
def test_two_processes_update_like_one(
    two_processes: tuple[Path, dict[str, Any]],
    single_process: dict[str, dict[str, torch.Tensor]],
    strategy: str,
    loss_type: str,
    model_dir: str,
) -> None:
    """Two ranks with half the prompts each make the same updates as one process with all of them."""
    out, results = two_processes
    name = f"{strategy}_eq_{loss_type}"
    assert results[name]["rank_max_diff"] == 0.0
    distributed, single = torch.load(out / f"{name}.pt"), single_process[loss_type]
    start = GRPOModule(model_name_or_path=model_dir, objective=ObjectiveConfig(beta=0.0))
    start.configure_model()
    initial = start.policy.state_dict()
    update = torch.cat([(single[k] - initial[k]).flatten() for k in single])
    difference = torch.cat([(distributed[k] - single[k]).flatten() for k in single])
    assert update.abs().max() > 1e-3  # the comparison below is about real updates
    # The same arithmetic but for the order of float32 sums (gradients all-reduced across ranks): the updates
    # agree to a few float32 ulps of their size; a wrong normaliser (a count taken on one rank) is off by ~1e-1.
    relative = (difference.norm() / update.norm()).item()
    print(f"{name}: relative difference {relative:.2e}")
    assert relative < 1e-6


def test_packed_bins_in_token_balanced_micro_batches_update_like_padded_rows_under_fsdp2(
    two_processes: tuple[Path, dict[str, Any]], model_dir: str
) -> None:
    """FSDP2 on 2 processes: packed log-prob passes (π_old, π_ref, the update) and token-balanced micro-batches make
    the update of padded rows in equal-count micro-batches."""
    out, results = two_processes
    padded, packed = torch.load(out / "fsdp_padded.pt"), torch.load(out / "fsdp_packed.pt")
    assert results["fsdp_padded"]["packed_forwards"] == 0 and results["fsdp_packed"]["packed_forwards"] > 0
    assert results["fsdp_packed"]["rank_max_diff"] == 0.0
    start = GRPOModule(model_name_or_path=model_dir, objective=ObjectiveConfig(beta=0.0))
    start.configure_model()
    initial = start.policy.state_dict()
    update = torch.cat([(padded[k] - initial[k]).flatten() for k in padded])
    difference = torch.cat([(packed[k] - padded[k]).flatten() for k in padded])
    assert packed.keys() == padded.keys() and update.abs().max() > 1e-3
    # float32 arithmetic on the same tokens in another grouping (matmul shapes, a block-diagonal mask) over 3
    # rounds of SGD: within the packed path's 1e-5 bound; a token that saw another sequence would be off by ~1e-1.
    relative = (difference.norm() / update.norm()).item()
    print(f"fsdp packed vs padded: relative difference {relative:.2e}")
    assert relative < 1e-5


def test_fsdp_checkpoint_resume_and_consolidation(two_processes: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, results = two_processes
    resumed = results["fsdp_resumed"]
    assert resumed["resume_max_diff"] == 0.0  # training restarted from exactly the saved weights
    assert resumed["global_step"] == 5 and len(resumed["losses"]) == 2 * 2
    assert all(math.isfinite(loss) for loss in resumed["losses"])
    assert resumed["position"] == 5 * PROMPTS  # the prompt stream continued where it stopped
    folder = load_tool("consolidate_fsdp").consolidate(out / "fsdp" / "checkpoints" / "last.ckpt", tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    probe = torch.load(out / "fsdp_logits.pt")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], atol=1e-5, rtol=1e-5)


def test_fsdp_lora_trains_adapters_only(two_processes: tuple[Path, dict[str, Any]]) -> None:
    _, results = two_processes
    run = results["fsdp_lora"]
    assert run["global_step"] == 2 and all(math.isfinite(loss) for loss in run["losses"])
    assert run["rank_max_diff"] == 0.0
    assert run["changed"] and all("lora_" in k for k in run["changed"])


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    worker(Path(sys.argv[1]), sys.argv[2])
