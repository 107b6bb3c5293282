"""Side-by-side speed of on-policy distillation: grpo_lightning's ``model.teacher`` and TRL's ``DistillationTrainer``.

    pip install -e ".[bench]"             # TRL, pinned (an optional extra)
    python tools/bench_distill.py         # 3 runs each, the frameworks alternated
    python tools/bench_distill.py --runs 5 --steps 3 10
    git worktree add ../base 2c054be && python tools/bench_distill.py --baseline ../base   # this code vs another

The same student (a seeded Llama of ``STUDENT`` size) learns from the same teacher (a larger seeded Llama, same
character tokenizer) on the same prompts, on CPU in float32. Every optimizer step, each side samples 32 completions
of exactly ``NEW_TOKENS`` tokens from the student (EOS forbidden before the limit), has the teacher score them and
takes one update with no reference model and no rewards:

- TRL: ``DistillationTrainer`` with ``lmbda``-free on-policy generation (its default), ``beta = 1`` (reverse KL),
  32 prompts × 1 completion per step, its chunked full-vocabulary divergence, no gradient checkpointing;
- ours: ``model.teacher`` with ``data.rewards: []`` (the teacher alone), 16 prompts × G = 2 (a group needs two:
  the same 32 sequences and tokens; ours prefills each prompt once for its group, a small part of a step here),
  the teacher's log-prob of each sampled token as its advantage through the ``grpo`` loss.

The two objectives differ by design (``docs/distillation.md``: the full-vocabulary reverse KL against its
one-sample estimate on the sampled token); what is compared is the cost of a step of each at identical work:
generation, one teacher pass, one student forward and backward. Each run is a fresh subprocess reporting its time per
optimizer step (after the warm-up) and its peak resident memory; the table shows the median over runs. The
measuring harness (timing, memory, child processes, ``--baseline``, the machine and CPU packing lines beside the
table) is ``bench_trl.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trl import (  # noqa: E402
    SEED,
    Settings,
    bench_trainer,
    child_command,
    environment,
    make_prompt,
    median_result,
    ours_step_timer,
    packing_report,
    run_measured,
    summarize,
    trl_step_timer,
    with_packing_report,
)

LR = 1e-6
SEQUENCES = 32  # completions per optimizer step, both sides
STUDENT = {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 704}
TEACHER = {"hidden": 512, "layers": 8, "heads": 8, "intermediate": 1408}
NEW_TOKENS, PROMPT_LEN = 64, 32


def save_model(size: dict[str, int], folder: Path, seed: int) -> int:
    """A seeded Llama of ``size`` with the character tokenizer under ``folder``; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_lightning.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def build_assets(folder: Path) -> dict[str, int]:
    """Student, teacher and 512 fixed-length prompts under ``folder``."""
    sizes = {
        "student": save_model(STUDENT, folder / "student", SEED),
        "teacher": save_model(TEACHER, folder / "teacher", SEED + 1),
    }
    rng = random.Random(SEED)
    with open(folder / "prompts.jsonl", "w") as f:
        for _ in range(512):
            f.write(json.dumps({"prompt": make_prompt(rng, PROMPT_LEN)}) + "\n")
    return sizes


def run_ours(settings: Settings, folder: Path) -> dict[str, float]:
    """Our side: the public API as a user sets up distillation, a callback timestamping every optimizer step."""
    import lightning as L

    from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig, UpdateConfig
    from grpo_lightning.integrations.distillation.teacher import TeacherConfig

    stamps: list[tuple[float, float]] = []

    L.seed_everything(SEED, verbose=False)
    module = GRPOModule(
        model_name_or_path=str(folder / "student"),
        objective=ObjectiveConfig(beta=0.0, loss_type="grpo"),
        lr=LR,
        teacher=TeacherConfig(str(folder / "teacher")),
    )
    data = RolloutDataModule(
        dataset=str(folder / "prompts.jsonl"),
        val_split=None,
        rewards=[],
        sampling=SamplingConfig(group_size=2, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=1.0),
        prompts_per_round=SEQUENCES // 2,
        update=UpdateConfig(mini_batch_size=SEQUENCES),
        seed=SEED,
    )
    trainer = bench_trainer(settings.warmup_steps + settings.measured_steps, [ours_step_timer(stamps)])
    trainer.fit(module, datamodule=data)
    return summarize(stamps, settings)


def run_trl(settings: Settings, folder: Path) -> dict[str, float]:
    """TRL's DistillationTrainer: 32 prompts per step, one on-policy completion each, reverse KL (beta = 1)."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    stamps: list[tuple[float, float]] = []

    with tempfile.TemporaryDirectory() as out:
        config = DistillationConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            seed=SEED,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_steps=settings.warmup_steps + settings.measured_steps,
            per_device_train_batch_size=SEQUENCES,
            gradient_accumulation_steps=1,
            max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS},
            temperature=1.0,
            beta=1.0,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            model_init_kwargs={"dtype": torch.float32},
            teacher_model_init_kwargs={"dtype": "float32"},
        )
        trainer = DistillationTrainer(
            model=str(folder / "student"),
            teacher_model=str(folder / "teacher"),
            args=config,
            train_dataset=load_dataset("json", data_files=str(folder / "prompts.jsonl"), split="train"),
            processing_class=AutoTokenizer.from_pretrained(folder / "student"),
            callbacks=[trl_step_timer(stamps)],
        )
        trainer.train()
    return summarize(stamps, settings)


def run_child(
    framework: str, settings: Settings, folder: Path, threads: int | None, baseline: Path | None = None
) -> dict[str, Any]:
    """One measurement in a fresh interpreter (its own start-up and peak memory); ``framework``: ``trl``, ``ours``
    or ``baseline`` (ours as the checkout ``baseline`` has it)."""
    steps = [str(settings.warmup_steps), str(settings.measured_steps)]
    side, base = ("ours", baseline) if framework == "baseline" else (framework, None)
    cmd, env = child_command(Path(__file__), side, base, threads)
    return run_measured(cmd + ["--steps", *steps, "--assets", str(folder)], env, f"{framework} run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs per framework (median reported)")
    parser.add_argument("--steps", nargs=2, type=int, default=(3, 8), metavar=("WARMUP", "MEASURED"))
    parser.add_argument("--threads", type=int, help="CPU threads per run (default: torch's, one per core)")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout of grpo_lightning, measured in the same rotation as ours"
    )
    parser.add_argument("--child", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--assets", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # bench_trl's Settings carries the timing window; the model and rollout shape are this script's constants.
    settings = Settings(0, 0, 0, 0, SEQUENCES, 1, NEW_TOKENS, PROMPT_LEN, 1, 0.0, *args.steps)
    if args.child:
        if args.child == "ours":
            result = with_packing_report(run_ours(settings, args.assets))
        else:
            result = run_trl(settings, args.assets)
        print("RESULT " + json.dumps(result), flush=True)
        return
    baseline = args.baseline.resolve() if args.baseline else None
    if baseline and not (baseline / "tools" / "bench_distill.py").is_file():
        parser.error(f"--baseline {baseline} has no tools/bench_distill.py: make a checkout with git worktree add")
    frameworks = ["trl", "ours"] + (["baseline"] if baseline else [])
    results: dict[str, list[dict[str, Any]]] = {framework: [] for framework in frameworks}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sizes = build_assets(folder)
        for run in range(args.runs):
            shift = run % len(frameworks)  # rotate who goes first
            for framework in frameworks[shift:] + frameworks[:shift]:
                loads.append(os.getloadavg()[0])
                result = run_child(framework, settings, folder, args.threads, baseline)
                results[framework].append(result)
                print(
                    f"run {run + 1} {framework:>8}: {result['s_per_step']:.3f} s/step "
                    f"(CPU {result['cpu_s_per_step']:.3f}), peak RSS {result['peak_rss_mb']:.0f} MiB, "
                    f"load {loads[-1]:.2f} before",
                    flush=True,
                )
    med = {fw: median_result(runs) for fw, runs in results.items()}
    trl, ours = med["trl"], med["ours"]
    print("\n| TRL s/step | ours s/step | ratio ours/TRL | TRL peak RSS MiB | ours peak RSS MiB | memory ratio |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {trl['s_per_step']:.3f} | {ours['s_per_step']:.3f} | {ours['s_per_step'] / trl['s_per_step']:.2f} | "
        f"{trl['peak_rss_mb']:.0f} | {ours['peak_rss_mb']:.0f} | {ours['peak_rss_mb'] / trl['peak_rss_mb']:.2f} |"
    )
    print(
        f"\nstudent {sizes['student'] / 1e6:.2f}M params, teacher {sizes['teacher'] / 1e6:.2f}M; {SEQUENCES} "
        f"completions of {NEW_TOKENS} tokens per step, prompts of {PROMPT_LEN}; steps {args.steps[0]}+{args.steps[1]}; "
        f"median of {args.runs} runs; load {min(loads):.2f} to {max(loads):.2f} on {os.cpu_count()} CPUs"
    )
    print(environment(args.threads))
    print(f"CPU packing of ours (its last run):\n{packing_report(results['ours'][-1])}")
    print(
        f"ratio={ours['s_per_step'] / trl['s_per_step']:.2f} mem_ratio={ours['peak_rss_mb'] / trl['peak_rss_mb']:.2f}"
    )
    if baseline:
        base = med["baseline"]
        print(
            f"ours/baseline={ours['s_per_step'] / base['s_per_step']:.2f} "
            f"mem_ours/baseline={ours['peak_rss_mb'] / base['peak_rss_mb']:.2f} (baseline: {baseline})"
        )


if __name__ == "__main__":
    main()
