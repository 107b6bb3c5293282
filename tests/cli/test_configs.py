"""Every shipped config runs, and every precision × gradient clipping × LoRA combination trains or is refused.

``test_shipped_config_runs`` runs each YAML file under ``configs/`` (found by glob: a new file fails here until it
has an entry in ``RUNS``; an engine config under ``configs/engines/`` runs composed with the quickstart without
one, and is skipped when the engine it names needs a package that is not installed) for one round on CPU, in a
scratch working directory, as its header says to run it (recipes composed with the quickstart, LoRA with the
GSM8K recipe it names). Only what a CPU test has to change is overridden: the accelerator, one short round, a
tiny local model where the config names a Hub model, local data where it would download some, and the files a
pipeline stage reads from earlier stages. ``configs/strategies`` is tested by ``test_strategies_presets.py``.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import wandb
import yaml
from conftest import TINY, quiet_trainer
from helpers import checksum_reward, save_tiny_reward_model
from lightning.pytorch.plugins.precision import MixedPrecision
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.cli import GRPOCLI, SFTCLI, place_run_folders
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.model import clear_model_cache
from grpo_lightning.tasks.arithmetic import addition_pairs, format_prompt

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TINY_ARITH = ROOT / "grpo_lightning" / "assets" / "tiny-arith"
TINY_CALC = ROOT / "grpo_lightning" / "assets" / "tiny-calc"
TINY_BASIC_ARITHMETIC = ROOT / "grpo_lightning" / "assets" / "tiny-basic-arithmetic"
TINY_COUNT_SHAPES = ROOT / "grpo_lightning" / "assets" / "tiny-count-shapes"
GSM8K_SAMPLE = ROOT / "tests" / "data" / "gsm8k_sample.jsonl"
SHIPPED = sorted(
    p.relative_to(CONFIGS).as_posix()
    for p in CONFIGS.rglob("*.y*ml")
    if p.relative_to(CONFIGS).parts[0] != "strategies"
)

# One short round on CPU (the accelerator and device count are the only hardware settings overridden).
ONE_ROUND = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_epochs", "1"]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
# A round of 2 prompts × G = 8 completions, one optimizer step.
SMALL_ROUND = ["--data.prompts_per_round", "2", "--data.update.mini_batch_size", "16"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------- stand-ins
def tiny_qwen2(path: Path) -> str:
    """A random Qwen2 (the GSM8K recipe's architecture) with the character tokenizer and a chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template, tokenizer.model_max_length = CHAT_TEMPLATE, 1024
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def sft_rows(path: Path, rows: int = 32) -> None:
    """Prompt/response rows as tools/run_pipeline.sh writes them (here with the right sums)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pairs = addition_pairs()["train"][:rows]
    path.write_text(
        "".join(json.dumps({"prompt": format_prompt(a, b), "response": str(a + b)}) + "\n" for a, b in pairs)
    )


def earlier_stage_model(path: Path) -> None:
    """The Hugging Face folder an earlier pipeline stage hands on (SaveHFModel): here the quickstart's model."""
    shutil.copytree(TINY_ARITH, path)


# ------------------------------------------------------------------------------------------ runs
def quickstart_with(*configs: str):
    """The quickstart (its own model, by absolute path: the run's working directory is a scratch one)."""

    def run(work: Path) -> tuple[type, list[str]]:
        composed = [arg for name in configs for arg in ("--config", str(CONFIGS / name))]
        args = ["--config", str(CONFIGS / "quickstart.yaml"), *composed, "--model.model_name_or_path", str(TINY_ARITH)]
        if configs:  # the quickstart's own entry covers its W&B logger
            args += ["--trainer.logger", "false"]
        return GRPOCLI, [*args, *SMALL_ROUND]

    return run


def gsm8k_with(*configs: str):
    """The GSM8K recipe (bf16-mixed, gradient clipping, accumulation, checkpointing, chat template) on a tiny
    Qwen2 and the 10-row local sample instead of the Hub's model and dataset."""

    def run(work: Path) -> tuple[type, list[str]]:
        composed = [arg for name in configs for arg in ("--config", str(CONFIGS / name))]
        data = {"data_files": str(GSM8K_SAMPLE), "test_size": 2}
        args = ["--config", str(CONFIGS / "gsm8k_qwen2.5-0.5b.yaml"), *composed]
        args += ["--model.model_name_or_path", tiny_qwen2(work / "tiny-qwen2"), "--data.sampling.max_new_tokens", "4"]
        args += ["--data.task_kwargs", json.dumps(data), *SMALL_ROUND, "--data.update.micro_batch_size", "4"]
        if configs:
            args += ["--trainer.logger", "false"]
        return GRPOCLI, args

    return run


def pipeline_stage(stage: str, cli: type, provide, *extra: str):
    """A stage of the R1 pipeline as tools/run_pipeline.sh runs it, with the files it reads from earlier stages
    ``provide``d at the config's own (relative) paths in the scratch working directory."""

    def run(work: Path) -> tuple[type, list[str]]:
        provide(work / "runs" / "pipeline")
        return cli, ["--config", str(CONFIGS / "pipeline" / f"{stage}.yaml"), *extra]

    return run


def stage1(runs: Path) -> None:
    sft_rows(runs / "1_cold_start_sft" / "teacher.jsonl")


def stage2(runs: Path) -> None:
    earlier_stage_model(runs / "1_cold_start_sft" / "hf")


def stage3(runs: Path) -> None:
    earlier_stage_model(runs / "1_cold_start_sft" / "hf")
    sft_rows(runs / "3_rejection_sft" / "data.jsonl")


def stage4(runs: Path) -> None:
    earlier_stage_model(runs / "3_rejection_sft" / "hf")
    save_tiny_reward_model(runs / "reward_model")


def stage5(runs: Path) -> None:
    """The student (stage 5a's folder) and its teacher (stage 4's), both stood in by the quickstart's model."""
    earlier_stage_model(runs / "5_student_cold_start" / "hf")
    earlier_stage_model(runs / "4_mixed_rl" / "hf")


def distillation(work: Path) -> tuple[type, list[str]]:
    """The distillation demo: its student by absolute path, the teacher folder it names (the quickstart's longer
    run, exported: ``runs/teacher/hf``) stood in by the quickstart's model."""
    earlier_stage_model(work / "runs" / "teacher" / "hf")
    args = ["--config", str(CONFIGS / "distillation.yaml"), "--model.model_name_or_path", str(TINY_ARITH)]
    return GRPOCLI, [
        *args,
        "--data.prompts_per_round",
        "8",
        "--data.update.mini_batch_size",
        "16",
    ]  # its 2 samples a prompt


def tools_calculator(work: Path) -> tuple[type, list[str]]:
    """The multi-turn calculator demo: its own model by absolute path, one small round of tool-calling rollouts."""
    args = ["--config", str(CONFIGS / "tools_calculator.yaml"), "--model.model_name_or_path", str(TINY_CALC)]
    return GRPOCLI, [*args, *SMALL_ROUND]


def reasoning_gym_demo(work: Path) -> tuple[type, list[str]]:
    """The reasoning-gym demo: its own model by absolute path, one small round (reasoning-gym is an extra)."""
    pytest.importorskip("reasoning_gym", reason="configs/reasoning_gym.yaml needs the reasoning-gym extra")
    args = ["--config", str(CONFIGS / "reasoning_gym.yaml"), "--model.model_name_or_path", str(TINY_BASIC_ARITHMETIC)]
    return GRPOCLI, [*args, *SMALL_ROUND]


def vision_demo(work: Path) -> tuple[type, list[str]]:
    """The vision demo: its own model by absolute path, a few drawn images, one small round."""
    rows = json.dumps({"train_size": 8, "test_size": 2})
    args = ["--config", str(CONFIGS / "vision.yaml"), "--model.model_name_or_path", str(TINY_COUNT_SHAPES)]
    return GRPOCLI, [*args, "--data.task_kwargs", rows, *SMALL_ROUND]


def geometry3k_recipe(work: Path) -> tuple[type, list[str]]:
    """The Qwen2.5-VL Geometry3K recipe on a tiny Qwen2-VL and local rows with its columns (a diagram file per
    row, ``<image>`` in the problem) instead of the Hub's model and dataset; a round of 2 problems × G = 5."""
    from PIL import Image, ImageDraw

    from grpo_lightning.integrations.vision.tiny import build_tiny_vlm

    files = {}
    for split, rows in (("train", 4), ("test", 2)):
        lines = []
        for i in range(rows):
            path = work / f"{split}_{i}.png"
            image = Image.new("RGB", (120, 90), "white")
            ImageDraw.Draw(image).polygon([(10, 80), (110, 80), (60, 10 + 5 * i)], outline="black")
            image.save(path)
            problem = f"<image>Find x. The base is {10 + i}."
            lines.append(json.dumps({"images": [str(path)], "problem": problem, "answer": str(10 + i)}) + "\n")
        files[split] = str(work / f"{split}.jsonl")
        Path(files[split]).write_text("".join(lines))
    settings = json.dumps({"data_files": files, "test_split": "test"})
    args = ["--config", str(CONFIGS / "recipes" / "qwen2.5-vl-3b_geometry3k.yaml"), "--trainer.logger", "false"]
    args += ["--model.model_name_or_path", str(build_tiny_vlm("qwen2_vl", work / "tiny-qwen2-vl"))]
    args += ["--data.task_kwargs", settings, "--data.sampling.max_new_tokens", "4", "--data.prompts_per_round", "2"]
    args += [
        "--data.update.mini_batch_size",
        "10",
        "--data.update.micro_batch_size",
        "5",
        "--trainer.accumulate_grad_batches",
        "2",
    ]
    return GRPOCLI, args


SFT_SMALL = ["--data.eval.limit", "8"]
_SERVERS: dict = {}


def quickstart_on_a_vllm_server(work: Path) -> tuple[type, list[str]]:
    """``engines/vllm_server.yaml`` with the quickstart, against a real ``vllm serve`` of the quickstart's model
    (started once, stopped when the tests end; the vLLM environment only)."""
    import atexit

    from vllm_servers import Server

    if "quickstart" not in _SERVERS:
        server = Server(str(TINY_ARITH), Path(tempfile.mkdtemp()) / "server.log").start()
        atexit.register(server.stop)
        _SERVERS["quickstart"] = server
    cli_class, args = quickstart_with("engines/vllm_server.yaml")(work)
    return cli_class, [*args, "--data.engine.init_args.base_urls", f"[{_SERVERS['quickstart'].url}]"]


RUNS = {
    "quickstart.yaml": quickstart_with(),
    "engines/vllm_server.yaml": quickstart_on_a_vllm_server,
    "recipes/grpo.yaml": quickstart_with("recipes/grpo.yaml"),
    "recipes/dapo.yaml": quickstart_with("recipes/dapo.yaml"),
    "recipes/dr_grpo.yaml": quickstart_with("recipes/dr_grpo.yaml"),
    "recipes/gspo.yaml": quickstart_with("recipes/gspo.yaml"),
    "recipes/cispo.yaml": quickstart_with("recipes/cispo.yaml"),
    "recipes/sapo.yaml": quickstart_with("recipes/sapo.yaml"),
    "recipes/gmpo.yaml": quickstart_with("recipes/gmpo.yaml"),
    "gsm8k_qwen2.5-0.5b.yaml": gsm8k_with(),
    "lora.yaml": gsm8k_with("lora.yaml"),
    "tools_calculator.yaml": tools_calculator,
    "reasoning_gym.yaml": reasoning_gym_demo,
    "vision.yaml": vision_demo,
    "recipes/qwen2.5-vl-3b_geometry3k.yaml": geometry3k_recipe,
    # Stage 1 starts from the shipped model, passed by run_pipeline.sh as BASE.
    "pipeline/1_cold_start_sft.yaml": pipeline_stage(
        "1_cold_start_sft", SFTCLI, stage1, "--model.model_name_or_path", str(TINY_ARITH), *SFT_SMALL
    ),
    "pipeline/2_reasoning_rl.yaml": pipeline_stage("2_reasoning_rl", GRPOCLI, stage2, *SMALL_ROUND),
    "pipeline/3_rejection_sft.yaml": pipeline_stage(
        "3_rejection_sft", SFTCLI, stage3, *SFT_SMALL, "--trainer.check_val_every_n_epoch", "1"
    ),
    "pipeline/4_mixed_rl.yaml": pipeline_stage("4_mixed_rl", GRPOCLI, stage4, *SMALL_ROUND),
    "pipeline/5_student_cold_start.yaml": pipeline_stage(
        "5_student_cold_start", SFTCLI, stage1, *SFT_SMALL, "--trainer.check_val_every_n_epoch", "1"
    ),
    "pipeline/5_distill.yaml": pipeline_stage("5_distill", GRPOCLI, stage5, *SMALL_ROUND),
    "distillation.yaml": distillation,
}


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The run's working directory: whatever a config writes to relative paths lands in tmp_path."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    wandb.finish()  # an in-process W&B run would otherwise be reused by the next test's logger
    clear_model_cache()


def test_every_entry_names_a_shipped_config():
    assert not set(RUNS) - set(SHIPPED), f"RUNS names configs that no longer exist: {sorted(set(RUNS) - set(SHIPPED))}"


def run_of(name: str):
    """How ``configs/<name>`` runs: its ``RUNS`` entry; an engine config (``engines/``) composed with the quickstart."""
    if name in RUNS:
        return RUNS[name]
    if name.startswith("engines/"):
        return quickstart_with(name)
    return None


def engine_package(name: str) -> str | None:
    """The optional package that the engine ``configs/<name>`` selects needs (vLLM's), if any."""
    config = yaml.safe_load((CONFIGS / name).read_text()) or {}
    engine = (config.get("data") or {}).get("engine")
    return "vllm" if engine is not None and "vllm" in json.dumps(engine).lower() else None


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.vllm) if engine_package(n) == "vllm" else n for n in SHIPPED]
)
def test_shipped_config_runs(name, scratch):
    run = run_of(name)
    if run is None:
        pytest.fail(f"configs/{name} is run by no test: add how to run it (one round, CPU) to RUNS in {__file__}")
    package = engine_package(name)
    if package is not None:
        pytest.importorskip(package, reason=f"configs/{name} selects the {package} engine; {package} is not installed")
    cli_class, args = run(scratch)
    cli = cli_class(args=["fit", *args, *ONE_ROUND, *QUIET])
    trainer = cli.trainer
    assert trainer.current_epoch == 1 and trainer.global_step >= 1  # one round (epoch), at least one update
    assert all(torch.isfinite(p).all() for p in cli.model.policy.parameters())


# ------------------------------------------------------------------------------- run folders
def fit_quickstart(*extra: str) -> GRPOCLI:
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--model.model_name_or_path", str(TINY_ARITH)]
    return GRPOCLI(args=[*args, *SMALL_ROUND, *ONE_ROUND, *QUIET, *extra])


def test_default_root_dir_keeps_two_runs_of_one_config_apart(scratch):
    """``--trainer.default_root_dir`` moves the checkpoints, the W&B run and the saved config together."""
    for run in ("a", "b"):
        fit_quickstart("--trainer.default_root_dir", f"runs/{run}")
        wandb.finish()
    assert sorted(p.name for p in scratch.iterdir()) == ["runs"]  # nothing written outside the runs' folders
    assert sorted(p.name for p in (scratch / "runs").iterdir()) == ["a", "b"]
    for run in ("a", "b"):
        folder = scratch / "runs" / run
        assert (folder / "checkpoints" / "last.ckpt").is_file()
        assert len(list((folder / "wandb").glob("offline-run-*"))) == 1
        assert (folder / "config.yaml").is_file()


def test_the_quickstart_writes_under_its_run_folder_by_default(scratch):
    cli = fit_quickstart("--trainer.logger", "false")
    assert Path(cli.trainer.checkpoint_callback.dirpath) == scratch / "runs" / "quickstart" / "checkpoints"
    assert (scratch / "runs" / "quickstart" / "checkpoints" / "last.ckpt").is_file()


def test_folders_set_explicitly_stay_where_they_are(tmp_path):
    from jsonargparse import Namespace

    def entry(class_path: str, **init_args) -> Namespace:
        return Namespace(class_path=class_path, init_args=Namespace(**init_args))

    trainer = Namespace(
        default_root_dir=str(tmp_path / "run"),
        callbacks=[
            entry("grpo_lightning.callbacks.RoundCheckpoint", dirpath=None),
            entry("lightning.pytorch.callbacks.ModelCheckpoint", dirpath="elsewhere"),
            entry("grpo_lightning.callbacks.SaveHFModel", dirpath="hf"),
        ],
        logger=[
            entry("grpo_lightning.callbacks.GRPOWandbLogger", save_dir="."),
            entry("lightning.pytorch.loggers.CSVLogger", save_dir="csv"),
        ],
    )
    place_run_folders(trainer)
    assert [c.init_args.dirpath for c in trainer.callbacks] == [
        str(tmp_path / "run" / "checkpoints"),
        "elsewhere",
        "hf",
    ]
    assert [lg.init_args.save_dir for lg in trainer.logger] == [str(tmp_path / "run"), "csv"]
    unset = Namespace(
        default_root_dir=None, callbacks=[entry("grpo_lightning.callbacks.RoundCheckpoint", dirpath=None)]
    )
    place_run_folders(unset)
    assert unset.callbacks[0].init_args.dirpath is None  # no root: Lightning's own default applies


# ------------------------------------------------------------------ precision × clipping × LoRA
register("test_configs_checksum")(checksum_reward)  # every update changes the weights


PRECISIONS = ["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
CLIPPING = [None, "norm", "value"]


@pytest.mark.parametrize("precision, clipping, lora", itertools.product(PRECISIONS, CLIPPING, [False, True]))
def test_precision_clipping_and_lora_train(precision, clipping, lora, tmp_path):
    """Each combination takes a finite optimizer step that moves the weights (none has to be refused).

    The optimizer is AdamW, fused wherever Lightning can clip its gradients (the fp32 default keeps its speed); its
    AMP plugin refuses to clip for a fused optimizer, under bf16 as under fp16, on any device. 16-mixed runs with
    its gradient scaler on CPU too (Lightning would otherwise switch a CPU run to bf16-mixed).
    """
    lora_config = None
    if lora:
        pytest.importorskip("peft")
        from grpo_lightning.lora import LoraConfig

        lora_config = LoraConfig(r=4, alpha=8)
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.04), lr=1e-3, lora=lora_config)
    data = RolloutDataModule(
        rewards=[RewardSpec("test_configs_checksum")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=3),
        prompts_per_round=2,
        task_kwargs={"test_size": 50},
    )
    settings = {"precision": precision}
    if precision == "16-mixed":
        settings = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    if clipping:
        settings.update(gradient_clip_val=1.0, gradient_clip_algorithm=clipping)
    trainer = quiet_trainer(tmp_path, max_epochs=1, **settings)
    module.configure_model()
    before = [p.detach().clone() for p in module.policy.parameters() if p.requires_grad]
    trainer.fit(module, datamodule=data)
    after = [p.detach() for p in module.policy.parameters() if p.requires_grad]
    assert trainer.global_step == 1 and module.nonfinite.total == 0
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    fused = bool(trainer.optimizers[0].defaults.get("fused"))
    assert fused == (not (clipping and precision.endswith("-mixed")))
