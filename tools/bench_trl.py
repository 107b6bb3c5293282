"""Side-by-side speed of grpo_lightning and TRL's ``GRPOTrainer`` at identical settings, on CPU in float32.

    pip install -e ".[bench]"          # TRL, pinned (an optional extra, not a runtime dependency)
    python tools/bench_trl.py          # settings A and B, 3 runs each, the frameworks alternated
    python tools/bench_trl.py --settings U --runs 1   # uneven completions: packing (ours packed and padded)
    pip install -e ".[bench,vision]" && python tools/bench_trl.py --settings V   # images: the vision demo's model
    python tools/bench_trl.py --settings A --runs 5
    python tools/bench_trl.py --device cuda           # on a GPU (same settings, float32); memory = peak GPU memory
    git worktree add ../base d9ba92b && python tools/bench_trl.py --baseline ../base   # this code vs another

Both sides train the same Llama-architecture model (built from a config with a fixed seed and saved once), with
the same character tokenizer, prompts, reward function and seed; completions have a fixed length (EOS is
forbidden before ``max_new_tokens``), so both generate the same number of tokens. One optimizer step covers
one rollout of prompts × G completions (μ passes of it), with β > 0 (a reference model). Neither side uses
gradient checkpointing (TRL's default turns it on; ours does not), mixed precision or logging.

Each run is a fresh subprocess that reports its time per optimizer step (a callback timestamps every optimizer
step; the steps after the warm-up are averaged) and its peak resident memory (``ru_maxrss``). The table shows
the median over runs; the last lines (``settings=A ratio=... mem_ratio=...``) are for scripts.

Settings V has images: both sides train the vision demo's tiny Qwen2-VL (``grpo_lightning/assets/tiny-count-shapes``,
vision tower frozen on both) on its counting prompts (an 84-pixel image drawn in code, then a question), the
images given as files (ours reads the paths, TRL gets them decoded); ours samples with the ``transformers``
engine (the one that takes images), TRL with its own ``generate``; completions again have a fixed length.

``--baseline DIR`` adds a third side, our code as another checkout has it, in the same rotation: a shared CPU's
speed drifts by 10-20% within minutes, so versions measured at different times cannot be compared.

Beside the table: the versions, the machine (CPU model, the instruction set torch dispatches to, threads per run,
torch's version: ``grpo_lightning.models.cpu_packing_rule.machine``) and what our side's CPU packing measured there
(``cpu_packing_rule.describe``: which products multiply by packed weights on this machine). The packing's timings
are cached per machine (``~/.cache/grpo_lightning/cpu_packing``): remove that folder to measure them again, e.g.
after measuring on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SEED = 0
LR = 1e-6
# "cpu" or "cuda": set by --device in the parent, read by each child run.
DEVICE = os.environ.get("GRPO_BENCH_DEVICE", "cpu")


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration (model size, rollout shape and how many steps to time)."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    prompts: int  # per optimizer step
    group_size: int
    new_tokens: int
    prompt_len: int  # characters = tokens (character tokenizer)
    mu: int  # passes over each rollout (num_iterations)
    beta: float
    warmup_steps: int
    measured_steps: int
    uneven: tuple[int, int] | None = None
    """Completions replayed instead of sampled, their lengths spread evenly over this range (both sides alike):
    the update's cost with uneven lengths, which packing removes the padding of (``replay_completions``)."""
    images: bool = False
    """Prompts with an image each and the vision demo's tiny Qwen2-VL instead of a Llama (``build_image_assets``);
    the model sizes above are that model's, for the table."""


SETTINGS = {
    "A": Settings(128, 4, 4, 256, 8, 8, 16, 6, 1, 0.04, warmup_steps=10, measured_steps=30),
    # μ = 2: a round is two optimizer steps, so warm-up and measured windows are whole rounds.
    "B": Settings(512, 8, 8, 1408, 4, 8, 64, 32, 2, 0.04, warmup_steps=4, measured_steps=12),
    # B's model, 16 completions of 16 to 512 tokens (uneven: padded rows are 52% padding), no sampling.
    "U": Settings(512, 8, 8, 1408, 2, 8, 512, 32, 2, 0.04, warmup_steps=2, measured_steps=4, uneven=(16, 512)),
    # The vision demo's model (text 64 wide, 2 layers) and prompts: 8 images × G = 8, 16 new tokens each.
    "V": Settings(64, 2, 2, 128, 8, 8, 16, 0, 1, 0.04, warmup_steps=3, measured_steps=12, images=True),
}
VISION_MODEL = Path(__file__).resolve().parents[1] / "grpo_lightning" / "assets" / "tiny-count-shapes"


def replay_completions(settings: Settings, call: int, eos_id: int, pad_id: int, token_ids: list[int]):
    """``(completion_ids [N, T], lengths)`` of the ``call``-th generation of an ``uneven`` setting: N = prompts × G
    completions of lengths spread evenly over the range (each ending with EOS), shuffled by the call number, their
    tokens drawn from ``token_ids``; the same on both sides."""
    import torch

    rows = settings.prompts * settings.group_size
    low, high = settings.uneven
    lengths = [round(low + (high - low) * i / max(rows - 1, 1)) for i in range(rows)]
    random.Random(SEED + call).shuffle(lengths)
    g = torch.Generator().manual_seed(SEED + call)
    choices = torch.tensor(token_ids)
    ids = choices[torch.randint(len(token_ids), (rows, high), generator=g)]
    positions = torch.arange(high)[None]
    length = torch.tensor(lengths)[:, None]
    ids = torch.where(positions == length - 1, eos_id, torch.where(positions < length, ids, pad_id))
    return ids, lengths


def digit_ids(tokenizer: Any) -> list[int]:
    """The digits' token ids: what a replayed completion is made of."""
    return [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]


def digit_fraction(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """The reward of both sides: the share of digits in the completion (cheap, deterministic, informative). A
    conversational completion (TRL's, for conversational prompts) is its last message's text."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in texts]


def make_prompt(rng: random.Random, length: int) -> str:
    """A fixed-length arithmetic prompt, so that neither side pads prompts."""
    a, b = rng.randrange(10_000), rng.randrange(10_000)
    text = f"{a % 100:02d}+{b % 100:02d}=" if length <= 6 else f"What is {a:04d} plus {b:04d}? Answer: "
    return text[:length].rjust(length)


def build_assets(settings: Settings, folder: Path) -> None:
    """Save the model (seeded random weights), the tokenizer and 512 prompts under ``folder``."""
    if settings.images:
        build_image_assets(folder)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_lightning.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden,
        intermediate_size=settings.intermediate,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.heads,
        # room for the scaling benchmark's 256-token completions, and for U's 512
        max_position_embeddings=max(512, settings.prompt_len + settings.new_tokens),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rng = random.Random(SEED)
    with open(folder / "prompts.jsonl", "w") as f:
        for _ in range(512):
            f.write(json.dumps({"prompt": make_prompt(rng, settings.prompt_len)}) + "\n")
    (folder / "params.txt").write_text(str(sum(p.numel() for p in model.parameters())))


def build_image_assets(folder: Path, rows: int = 64) -> None:
    """Settings with images: the vision demo's model (copied) and ``rows`` of its training prompts, each image a
    PNG file under ``folder/images`` that the jsonl's ``image`` column names."""
    import shutil

    from grpo_lightning.integrations.vision.tasks import count_prompt
    from grpo_lightning.tasks import load_task

    if not (VISION_MODEL / "config.json").is_file():
        raise SystemExit(f"settings with images need {VISION_MODEL}: make it with tools/make_vision_model.py")
    shutil.copytree(VISION_MODEL, folder / "model")
    train = load_task("count_shapes", train_size=rows, test_size=1)["train"]
    (folder / "images").mkdir()
    with open(folder / "prompts.jsonl", "w") as f:
        for i, row in enumerate(train):
            path = folder / "images" / f"{i}.png"
            row["images"][0].save(path)
            f.write(json.dumps({"prompt": count_prompt(), "image": str(path)}) + "\n")
    from safetensors import safe_open

    with safe_open(folder / "model" / "model.safetensors", "pt") as weights:
        params = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    (folder / "params.txt").write_text(str(params))


def stamp() -> tuple[float, float]:
    """Wall-clock and process CPU time now (CPU time is less sensitive to other processes sharing the cores)."""
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()  # the step's kernels have finished, not merely been queued
    return time.perf_counter(), time.process_time()


def summarize(stamps: list[tuple[float, float]], settings: Settings) -> dict[str, float]:
    """Seconds per optimizer step (wall and CPU) over the measured window, and this process's peak memory."""
    window = stamps[settings.warmup_steps - 1 : settings.warmup_steps + settings.measured_steps]
    if len(window) != settings.measured_steps + 1:
        raise RuntimeError(f"expected {settings.warmup_steps + settings.measured_steps} steps, got {len(stamps)}")
    (wall0, cpu0), (wall1, cpu1) = window[0], window[-1]
    return {
        "s_per_step": (wall1 - wall0) / settings.measured_steps,
        "cpu_s_per_step": (cpu1 - cpu0) / settings.measured_steps,
        "peak_rss_mb": peak_rss_mb(),
        **({"peak_gpu_mb": peak_gpu_mb()} if DEVICE == "cuda" else {}),
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mb() -> float:
    """Peak GPU memory allocated by this process's tensors, in MiB."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def replay_engine(settings: Settings) -> Any:
    """Our ``RolloutEngine`` that returns ``replay_completions`` instead of sampling (settings with ``uneven``)."""
    import torch

    from grpo_lightning.engines.base import Completions, RolloutEngine

    class ReplayEngine(RolloutEngine):
        name = "replay"

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def setup(self, policy: Any, tokenizer: Any, *modality: Any) -> None:
            super().setup(policy, tokenizer, *modality)
            self.tokens = digit_ids(tokenizer)

        def logprobs_match_policy(self, policy: Any) -> bool:
            return False  # no log-probs: π_old is recomputed, as TRL computes it

        def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False) -> Completions:
            ids, lengths = replay_completions(settings, self.calls, self.eos_token_id, self.pad_token_id, self.tokens)
            self.calls += 1
            mask = (torch.arange(ids.size(1))[None] < torch.tensor(lengths)[:, None]).long()
            group = params.group_size
            prompts = prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)
            return Completions(*prompts, ids, mask, torch.zeros(ids.size(0), dtype=torch.bool))

    return ReplayEngine()


def ours_step_timer(stamps: list[tuple[float, float]]) -> Any:
    """A Lightning callback appending ``stamp()`` after every optimizer step (one batch is one step: no gradient
    accumulation)."""
    import lightning as L

    class StepTimer(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            stamps.append(stamp())

    return StepTimer()


def trl_step_timer(stamps: list[tuple[float, float]]) -> Any:
    """A transformers ``TrainerCallback`` appending ``stamp()`` after every optimizer step."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append(stamp())

    return StepTimer()


def bench_trainer(max_steps: int, callbacks: list[Any]) -> Any:
    """The Lightning Trainer of our side of a benchmark: no logger, checkpoints, progress bar or validation."""
    import lightning as L

    return L.Trainer(
        accelerator="gpu" if DEVICE == "cuda" else "cpu",
        devices=1,
        max_steps=max_steps,
        reload_dataloaders_every_n_epochs=1,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,  # no held-out data: GRPOModule defines validation_step, so Lightning would ask for it
        gradient_clip_val=1.0,  # TRL's max_grad_norm default
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def make_ours(
    settings: Settings, folder: Path, callbacks: list[Any], pack_tokens: Any = "auto", **data_options: Any
) -> tuple[Any, Any, Any]:
    """Our public API, as a user would set up a benchmark: no logger, checkpoints, progress bar or validation.
    Returns ``(GRPOModule, RolloutDataModule, Trainer)``; ``pack_tokens``: ``data.update.pack_tokens``;
    ``data_options``: more of ``RolloutDataModule``'s."""
    import lightning as L

    from grpo_lightning import GRPOModule, ObjectiveConfig, RewardSpec, RolloutDataModule, SamplingConfig, UpdateConfig
    from grpo_lightning.rewards import register

    register("digit_fraction")(digit_fraction)  # registering the same function again is a no-op
    L.seed_everything(SEED, verbose=False)
    rollout = settings.prompts * settings.group_size
    module = GRPOModule(
        model_name_or_path=str(folder / "model"),
        objective=ObjectiveConfig(beta=settings.beta, loss_type="grpo"),
        lr=LR,
    )
    data = RolloutDataModule(
        dataset=str(folder / "prompts.jsonl"),
        val_split=None,
        rewards=[RewardSpec("digit_fraction")],
        sampling=SamplingConfig(
            group_size=settings.group_size,
            max_new_tokens=settings.new_tokens,
            min_new_tokens=0 if settings.uneven else settings.new_tokens,
            temperature=1.0,
        ),
        **({"engine": replay_engine(settings)} if settings.uneven else {}),
        # images: the engine that gives the model each row's images; rows with images run padded (no packing)
        **({"engine": "transformers"} if settings.images else {}),
        prompts_per_round=settings.prompts,
        update=UpdateConfig(
            mini_batch_size=rollout, num_iterations=settings.mu, pack_tokens=None if settings.images else pack_tokens
        ),
        seed=SEED,
        **data_options,
    )
    trainer = bench_trainer(settings.warmup_steps + settings.measured_steps, callbacks)
    return module, data, trainer


def run_ours(settings: Settings, folder: Path, **data_options: Any) -> dict[str, float]:
    """Our side: GRPOModule + RolloutDataModule + Trainer, a callback timestamping every optimizer step."""
    stamps: list[tuple[float, float]] = []
    module, data, trainer = make_ours(settings, folder, [ours_step_timer(stamps)], **data_options)
    trainer.fit(module, datamodule=data)
    return summarize(stamps, settings)


def trl_processing_class(settings: Settings, model: Path) -> Any:
    """What TRL tokenizes with: the tokenizer, or with images the model's processor (``load_processor``: the one
    our side uses, built for images alone where transformers' video processor would need torchvision)."""
    if settings.images:
        from grpo_lightning.integrations.vision.processors import load_processor

        processor = load_processor(str(model))
        processor.tokenizer.padding_side = "left"
        return processor
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def run_trl(settings: Settings, folder: Path) -> dict[str, float]:
    """TRL's GRPOTrainer with the same settings: one optimizer step = one rollout of prompts × G completions."""
    import torch
    from datasets import Image, load_dataset
    from trl import GRPOConfig, GRPOTrainer

    stamps: list[tuple[float, float]] = []

    rollout = settings.prompts * settings.group_size
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=DEVICE == "cpu",
            bf16=False,
            gradient_checkpointing=False,
            seed=SEED,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_steps=settings.warmup_steps + settings.measured_steps,
            # One generation of `rollout` completions per optimizer step; each rollout is reused for μ steps.
            per_device_train_batch_size=rollout,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_generations=settings.group_size,
            num_iterations=settings.mu,
            max_completion_length=settings.new_tokens,
            generation_kwargs={"min_new_tokens": 0 if settings.uneven else settings.new_tokens},
            temperature=1.0,
            beta=settings.beta,
            loss_type="grpo",
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            model_init_kwargs={"dtype": torch.float32},
        )
        dataset = load_dataset("json", data_files=str(folder / "prompts.jsonl"), split="train")
        if settings.images:
            dataset = dataset.cast_column("image", Image())  # TRL hands the processor decoded images
        trainer = GRPOTrainer(
            model=str(folder / "model"),
            reward_funcs=digit_fraction,
            args=config,
            train_dataset=dataset,
            processing_class=trl_processing_class(settings, folder / "model"),
            callbacks=[trl_step_timer(stamps)],
        )
        if settings.images:
            # As ours trains (model.freeze_vision_tower's default): the optimizer, made in train(), skips them.
            from grpo_lightning.integrations.vision.models import vision_towers

            for tower in vision_towers(trainer.model):
                tower.requires_grad_(False)
        if settings.uneven:  # the same replayed completions as ours, in place of transformers' generate()
            tokenizer, calls = trainer.processing_class, [0]

            def replay(input_ids: Any, **_: Any) -> Any:
                ids, _lengths = replay_completions(
                    settings, calls[0], tokenizer.eos_token_id, tokenizer.pad_token_id, digit_ids(tokenizer)
                )
                calls[0] += 1
                return torch.cat([input_ids, ids.to(input_ids.device)], dim=1)

            trainer.model.generate = replay
        trainer.train()
    return summarize(stamps, settings)


def environment(threads: int | None = None) -> str:
    """The versions that matter, and whether matplotlib/scipy are installed: Lightning imports torchmetrics, which
    imports them when present (about 100 MiB in our process, none in TRL's), so peak memory depends on them; then
    the machine the runs had (``threads``: each run's, where set; else torch's default)."""
    from importlib.metadata import PackageNotFoundError, version

    from grpo_lightning.models.cpu_packing_rule import machine

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    names = ("torch", "transformers", "lightning", "trl", "matplotlib", "scipy")
    return "environment: " + ", ".join(f"{name} {installed(name)}" for name in names) + "\n" + machine(threads)


def packing_report(result: dict[str, Any]) -> str:
    """What a run of ours measured or read for its CPU packing (absent from a baseline older than the rule)."""
    lines = result.get("cpu_packing")
    if lines is None:
        return "  (not reported)"
    return "\n".join(f"  {line}" for line in lines) or "  nothing measured (no product could be packed)"


def with_packing_report(result: dict[str, float]) -> dict[str, Any]:
    """``result`` with this process's CPU packing report (``cpu_packing_rule.describe``)."""
    from grpo_lightning.models.cpu_packing_rule import describe

    return {**result, "cpu_packing": describe()}


def child_command(script: Path, side: str, baseline: Path | None, threads: int | None) -> tuple[list[str], dict]:
    """The interpreter command and environment of a child run of ``script`` as ``side``; with ``baseline``, the
    same-named script of that checkout, its own package first on the path (``--baseline``); ``threads``: every
    side alike (unset: torch's default, one thread per core)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "GRPO_BENCH_DEVICE": DEVICE}
    if baseline is not None:
        script, env["PYTHONPATH"] = baseline / "tools" / script.name, str(baseline)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return [sys.executable, str(script), "--child", side], env


def run_measured(cmd: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run a child and return the result it printed last (``RESULT {json}``)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def child(framework: str, settings: Settings, folder: Path) -> None:
    """One measured run in this process; prints its result as the last line of stdout (JSON)."""
    if framework == "padded":  # ours without packing
        result = with_packing_report(run_ours(settings, folder, pack_tokens=None))
    elif framework == "ours":
        result = with_packing_report(run_ours(settings, folder))
    else:
        result = run_trl(settings, folder)
    print("RESULT " + json.dumps(result), flush=True)


def median_result(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each numeric field's median over ``runs`` (reports such as ``cpu_packing`` are left out)."""
    keys = [key for key, value in runs[0].items() if isinstance(value, (int, float))]
    return {key: statistics.median(run[key] for run in runs) for key in keys}


def run_child(
    framework: str, name: str, settings: Settings, folder: Path, threads: int | None, baseline: Path | None = None
) -> dict[str, float]:
    """One measurement in a fresh interpreter (its own start-up, caches and peak memory); ``framework``: ``trl``,
    ``ours`` or ``baseline`` (ours as the checkout ``baseline`` has it)."""
    steps = [str(settings.warmup_steps), str(settings.measured_steps)]
    side, base = ("ours", baseline) if framework == "baseline" else (framework, None)
    cmd, env = child_command(Path(__file__), side, base, threads)
    cmd += ["--settings", name, "--steps", *steps, "--assets", str(folder)]
    return run_measured(cmd, env, f"{framework} run for settings {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["A", "B"], choices=list(SETTINGS))
    parser.add_argument("--runs", type=int, default=3, help="runs per framework and settings (median reported)")
    parser.add_argument(
        "--steps", nargs=2, type=int, metavar=("WARMUP", "MEASURED"), help="override the steps timed (all settings)"
    )
    parser.add_argument("--threads", type=int, help="CPU threads per run (default: torch's default, one per core)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both frameworks train")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout of grpo_lightning, measured in the same rotation as ours"
    )
    parser.add_argument("--child", choices=("ours", "trl", "padded"), help=argparse.SUPPRESS)
    parser.add_argument("--assets", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = os.environ["GRPO_BENCH_DEVICE"] = args.device if not args.child else DEVICE
    chosen = {name: SETTINGS[name] for name in args.settings}
    if args.steps:
        chosen = {n: replace(s, warmup_steps=args.steps[0], measured_steps=args.steps[1]) for n, s in chosen.items()}
    if args.child:
        child(args.child, chosen[args.settings[0]], args.assets)
        return
    baseline = args.baseline.resolve() if args.baseline else None
    if baseline and not (baseline / "tools" / "bench_trl.py").is_file():
        parser.error(f"--baseline {baseline} has no tools/bench_trl.py: make a checkout with git worktree add DIR REV")
    frameworks = ["trl", "ours"] + (["baseline"] if baseline else [])
    if any(s.uneven for s in chosen.values()):
        frameworks.append("padded")  # ours with data.update.pack_tokens: null, to show what packing does

    rows, loads, last_ours = [], [], {}
    for name, settings in chosen.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            build_assets(settings, folder)
            params = int((folder / "params.txt").read_text())
            results: dict[str, list[dict[str, float]]] = {framework: [] for framework in frameworks}
            for run in range(args.runs):
                # Rotate which side goes first, so that load drifts hit every side alike.
                shift = run % len(frameworks)
                for framework in frameworks[shift:] + frameworks[:shift]:
                    loads.append(os.getloadavg()[0])
                    result = run_child(framework, name, settings, folder, args.threads, baseline)
                    results[framework].append(result)
                    print(
                        f"settings {name} run {run + 1} {framework:>8}: {result['s_per_step']:.4f} s/step "
                        f"(CPU {result['cpu_s_per_step']:.4f}), peak RSS {result['peak_rss_mb']:.0f} MiB, "
                        + (f"peak GPU {result['peak_gpu_mb']:.0f} MiB, " if "peak_gpu_mb" in result else "")
                        + f"load {loads[-1]:.2f} before",
                        flush=True,
                    )
        last_ours[name] = results["ours"][-1]
        med = {fw: median_result(runs) for fw, runs in results.items()}
        rows.append((name, settings, params, med))

    print(
        "\n| settings | TRL s/step | ours s/step | ratio ours/TRL | TRL CPU s/step | ours CPU s/step "
        "| TRL peak RSS MiB | ours peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, s, params, med in rows:
        label = (
            f"{name}: {params / 1e6:.2f}M params, {s.prompts}×G={s.group_size}, {s.new_tokens} new tokens, "
            + ("prompt: an 84-pixel image + question" if s.images else f"prompt {s.prompt_len}")
            + f", β={s.beta}, μ={s.mu}, steps {s.warmup_steps}+{s.measured_steps}"
        )
        trl, ours = med["trl"], med["ours"]
        print(
            f"| {label} | {trl['s_per_step']:.3f} | {ours['s_per_step']:.3f} | "
            f"{ours['s_per_step'] / trl['s_per_step']:.2f} | {trl['cpu_s_per_step']:.3f} | "
            f"{ours['cpu_s_per_step']:.3f} | {trl['peak_rss_mb']:.0f} | {ours['peak_rss_mb']:.0f} |"
        )
    threads = args.threads or "torch default"
    if DEVICE == "cuda":
        for name, _, _, med in rows:
            trl, ours = med["trl"]["peak_gpu_mb"], med["ours"]["peak_gpu_mb"]
            print(f"settings {name}: peak GPU memory TRL {trl:.0f} MiB, ours {ours:.0f} MiB")
    print(f"\n(median of {args.runs} runs each; threads per run: {threads}; ", end="")
    print(f"1-minute load average before the runs: {min(loads):.2f} to {max(loads):.2f} on {os.cpu_count()} CPUs)")
    print(environment(args.threads))
    for name, _, _, _ in rows:
        print(f"settings {name}, CPU packing of ours (its last run):\n{packing_report(last_ours[name])}")
    print()
    for name, _, _, med in rows:
        ratio = med["ours"]["s_per_step"] / med["trl"]["s_per_step"]
        memory = "peak_gpu_mb" if DEVICE == "cuda" else "peak_rss_mb"  # on a GPU, the memory that limits a run
        mem_ratio = med["ours"][memory] / med["trl"][memory]
        print(f"settings={name} ratio={ratio:.2f} mem_ratio={mem_ratio:.2f}")
        if "padded" in med:
            ours, padded = med["ours"], med["padded"]
            print(f"settings={name} packed/padded={ours['s_per_step'] / padded['s_per_step']:.2f} ", end="")
            print(f"mem_packed/padded={ours[memory] / padded[memory]:.2f}")
        if baseline:
            ours, base = med["ours"], med["baseline"]
            print(f"settings={name} ours/baseline={ours['s_per_step'] / base['s_per_step']:.2f} ", end="")
            print(f"mem_ours/baseline={ours[memory] / base[memory]:.2f} (baseline: {baseline})")


if __name__ == "__main__":
    main()
