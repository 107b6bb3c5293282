"""What several test files share: rewards for their runs, tiny model folders, a small model of each architecture,
and loading a ``tools/`` script.

Each of these stood, near-identical, in several test files. The rewards are plain functions, registered by the test
files under the names their runs use (``register("crash_length")(length_reward)``): a name is registered where it
was before, once, so a worker that imports many test files, or a subprocess that imports one by path to get its
rewards, finds the names it found before (``register`` takes the same function under several names). Nothing here
imports ``conftest``: ``test_distributed.py`` imports this module also when torchrun runs it as a script.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ rewards
def length_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """The completion's length: rewards with spread even for a random model, so that a round changes the weights."""
    return [float(len(c)) for c in completions]


def checksum_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """A function of the completion's characters (their code points, mod 5): spread even for a random model."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


def step_length_reward(prompts: list[str], completions: list[str], **_: object) -> list[list[float]]:
    """A process reward: one reward per step (steps separated by "1"), the step's length."""
    return [[float(len(step)) for step in c.split("1")] for c in completions]


step_length_reward.process = True
step_length_reward.step_separator = "1"


# ------------------------------------------------------------------------------------- tiny model folders
def save_tiny_llama(path: str | Path, config: TinyModelConfig, tokenizer: Any = None) -> str:
    """A tiny random Llama (seed 0) and ``tokenizer`` (default: the character one), saved as a Hugging Face
    folder at ``path``; the folder, as a string."""
    tokenizer = build_char_tokenizer() if tokenizer is None else tokenizer
    torch.manual_seed(0)
    build_tiny_llama(config, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def save_tiny_reward_model(path: str | Path) -> str:
    """A random one-logit classifier (seed 1) over the character tokenizer, saved as a Hugging Face folder at
    ``path`` (it stands in for tools/train_reward_model.py's); the folder, as a string."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------- a small model of each architecture
ARCHITECTURE_SIZE = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=64,
)
# qwen2: q/k/v biases; qwen3: q/k norms and head_dim ≠ hidden / heads; gpt2: no lean forward.
ARCHITECTURES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**ARCHITECTURE_SIZE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**ARCHITECTURE_SIZE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**ARCHITECTURE_SIZE, head_dim=12)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**ARCHITECTURE_SIZE, sliding_window=None)),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**ARCHITECTURE_SIZE, pad_token_id=0)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
}
LEAN_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # the lean forward's (models/lean_forward.py)
# float32 comparisons of the lean forward with the model's: the same sums in another order and grouping (shared
# prompt pass, packed weights, fused attention), of logits and log-probs of size ≤ ~5 through 2 layers of length
# 32-48 dot products. Their rounding differs by tens of float32 steps at most (2**-23 ≈ 1.2e-7 relative):
# measured below 1e-6, ≤ 2% of this bound, with AVX-512 and AVX2 kernels, at 1 and 2 threads.
F32 = dict(atol=1e-5, rtol=1e-5)


def build_architecture(name: str) -> torch.nn.Module:
    """``ARCHITECTURES[name]`` (seed 0) in eval mode, with random biases and norm weights, so that a forgotten term
    shows."""
    torch.manual_seed(0)
    model = ARCHITECTURES[name]().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("bias", "norm.weight", "layernorm.weight")):
                param.add_(torch.randn_like(param) * 0.3)
    return model


# ----------------------------------------------------------------------------------------------- tools/
def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module of that name (the tools are scripts, not a package), loaded afresh and put in
    ``sys.modules`` before it runs (a tool's dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def attach(module: Any, data: Any, trainer: Any, fn: Any = None) -> None:
    """``data`` attached to ``trainer`` and ``module`` as ``fit`` would attach them (the rollout collector
    connected, as ``setup`` connects it), without running anything; ``fn``: the Trainer's function (default fit)."""
    from lightning.pytorch.trainer.states import TrainerFn

    data.trainer = trainer
    trainer.strategy.connect(module)
    trainer.state.fn = fn or TrainerFn.FITTING
    if hasattr(data, "collector"):
        data.collector.connect(module, trainer, data)


def run_on_two_processes(script: str, out: Path, *args: str, outputs: list[str], timeout_s: int = 600) -> None:
    """Run ``script`` (a test file that is its own torchrun worker) on 2 processes with ``torch.distributed.run``,
    ``out`` and ``args`` as its arguments, one intra-op thread each; fails the test, with both streams' tails, on a
    hang (the whole process group killed) or an exit without every file of ``outputs`` (names under ``out``)."""
    import os
    import signal
    import subprocess
    import sys

    import pytest

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [script, str(out), *args]
    # A session of its own: on a timeout the whole process group goes, torchrun's workers included.
    process = subprocess.Popen(
        command,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"2-process worker did not finish in {timeout_s} s (a hang):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    if process.returncode != 0 or not all((out / name).exists() for name in outputs):
        pytest.fail(f"2-process worker failed ({process.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
