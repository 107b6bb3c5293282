#!/usr/bin/env bash
# GPU check: bf16 + FSDP2 (FSDP2Strategy on one GPU) + gradient checkpointing on a ~100M-parameter Llama built
# from a config (no download). Three GRPO rounds of 16 prompts × 8 completions of exactly 256 tokens; prints and
# writes to $OUT/gpu_check.json: generation tokens/s, update tokens/s, round time and peak GPU memory per phase.
#
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
#   PRECISION=bf16-true ROUNDS=5 bash tools/gpu_check.sh   # other settings through the environment
#   SMOKE=1 bash tools/gpu_check.sh                        # a tiny CPU run of the same script (no GPU numbers)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
export OUT PRECISION="${PRECISION:-bf16-mixed}" ROUNDS="${ROUNDS:-3}" SMOKE="${SMOKE:-0}"
export WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
if [ "$SMOKE" = 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"; fi

python - <<'PY' 2>&1 | tee "$OUT/gpu_check.log"
import json
import os
import time

import torch
from lightning import Callback, Trainer

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.strategies import FSDP2Strategy

out, precision, rounds = os.environ["OUT"], os.environ["PRECISION"], int(os.environ["ROUNDS"])
smoke = os.environ["SMOKE"] != "0"
size = TinyModelConfig(hidden_size=768, num_layers=14, num_heads=12, intermediate_size=2048, max_position_embeddings=512)
prompts, group, length, micro = 16, 8, 256, 32
if smoke:  # the script's logic on CPU in seconds
    size = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    prompts, group, length, micro = 2, 4, 8, 4
cuda = torch.cuda.is_available() and not smoke


def synchronize() -> None:
    if cuda:
        torch.cuda.synchronize()


def peak_gib(reset: bool = True) -> float | None:
    if not cuda:
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


class Measure(Callback):
    """Per round: rollout time and tokens (from the rollout's metrics), update time, peak memory per phase."""

    def __init__(self) -> None:
        self.rounds, self.round_start = [], None

    def on_train_start(self, trainer, module):
        self.params = sum(p.numel() for p in module.policy.parameters())  # this rank's shard (the whole on 1 GPU)

    def on_train_epoch_start(self, trainer, module):
        # The rollout ran just before this hook (train_dataloader): its peak is the rollout's.
        synchronize()
        self.rollout_peak = peak_gib()
        self.update_start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        synchronize()
        update_s = time.perf_counter() - self.update_start
        rollout = trainer.datamodule.last_rollout
        m = rollout.metrics
        tokens = int(rollout.completion_mask.sum()) + int(rollout.prompt_mask.sum())
        self.rounds.append({
            "generate_s": m["time/generate"],
            "generated_tokens_per_s": m["time/generated_tokens_per_s"],
            "rollout_logprobs_s": m.get("time/logprobs"),
            "update_s": update_s,
            "update_tokens_per_s": tokens / update_s,
            "rollout_peak_gib": self.rollout_peak,
            "update_peak_gib": peak_gib(),
        })
        print(json.dumps(self.rounds[-1]), flush=True)


module = GRPOModule(
    tiny_model=size,
    rewards=[RewardSpec("exact_answer")],
    sampling=SamplingConfig(group_size=group, max_new_tokens=length, min_new_tokens=length, generation_batch_size=128),
    objective=ObjectiveConfig(beta=0.04),
    lr=1e-5,
    gradient_checkpointing=True,
    logprob_batch_size=micro,
)
data = RolloutDataModule(prompts_per_round=prompts, micro_batch_size=micro, val_limit=8)
measure = Measure()
trainer = Trainer(
    **TRAINER_DEFAULTS,
    accelerator="gpu" if cuda else "cpu",
    devices=1,
    strategy=FSDP2Strategy(),
    precision=precision if cuda else "32-true",
    max_epochs=rounds,
    accumulate_grad_batches=prompts * group // micro,
    limit_val_batches=0,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    callbacks=[measure],
)
start = time.perf_counter()
trainer.fit(module, datamodule=data)
steady = measure.rounds[1:] or measure.rounds  # the first round includes warm-up
mean = {k: sum(r[k] for r in steady) / len(steady) for k in steady[0] if steady[0][k] is not None}
report = {
    "gpu": torch.cuda.get_device_name() if cuda else "none (SMOKE=1 on CPU)",
    "precision": precision if cuda else "32-true",
    "strategy": "FSDP2Strategy (1 GPU)",
    "gradient_checkpointing": True,
    "parameters": measure.params,
    "completions_per_round": prompts * group,
    "completion_tokens": length,
    "rounds": measure.rounds,
    "steady_mean": mean,
    "peak_gib": max(max(r["rollout_peak_gib"], r["update_peak_gib"]) for r in measure.rounds) if cuda else None,
    "wall_s": time.perf_counter() - start,
}
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(report, f, indent=2)
print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))
PY
