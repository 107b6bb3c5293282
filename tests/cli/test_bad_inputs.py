"""A catalogue of bad inputs: each is refused before the first training step, with one line naming the culprit.

Most run in this process through ``grpo_lightning.cli.main`` (the CLI's entry point); two go through the real
``python -m grpo_lightning`` to prove the same holds there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from grpo_lightning import GRPOModule
from grpo_lightning.cli import main, parse_error_line, trainer_error
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu",
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    },
    "model": {"tiny_model": asdict(TINY)},
    # A small task: building the prompt set takes no time.
    "data": {
        "sampling": {"group_size": 4, "max_new_tokens": 4},
        "prompts_per_round": 4,
        "eval": {"limit": 8},
        "task_kwargs": {"max_operand": 20, "test_size": 50},
    },
}

REWARD_MODULES = {
    "bad_short.py": "def short(prompts, completions, **kw):\n    return [1.0]\n",
    "bad_text.py": "def text(prompts, completions, **kw):\n    return ['yes'] * len(completions)\n",
    "bad_raise.py": "def boom(prompts, completions, **kw):\n    raise KeyError('no score for this one')\n",
    "bad_slow.py": "import time\n\ndef slow(prompts, completions, **kw):\n    time.sleep(30)\n",
    "bad_loss.py": "def two_positionals(inputs, settings):\n    return inputs.logprobs, {}\n",
}


def files(rows: list | None = None, text: str | None = None):
    """Edit: train on a local jsonl file of ``rows`` (or of raw ``text``)."""

    def edit(config: dict, tmp: Path) -> None:
        path = tmp / "data.jsonl"
        path.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows))
        config["data"].update({"dataset": str(path), "val_split": None, "task_kwargs": None})
        config["trainer"]["limit_val_batches"] = 0

    return edit


def setting(path: str, value):
    """Edit: set the dotted config key ``path`` to ``value``."""

    def edit(config: dict, tmp: Path) -> None:
        *parents, leaf = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return edit


def reward(name: str, **data):
    """Edit: score with the reward ``name`` (an import path, for the modules in REWARD_MODULES)."""
    return setting("data", {**BASE["data"], "rewards": [{"name": name}], **data})


def checkpoint_of(hidden_size: int):
    """Edit: resume from a checkpoint made with another tiny model (written without training one)."""

    def edit(config: dict, tmp: Path) -> list[str]:
        other = TinyModelConfig(hidden_size=hidden_size, num_layers=2, num_heads=2, intermediate_size=64)
        torch.save({"hyper_parameters": {"tiny_model": other}, "state_dict": {}}, tmp / "other.ckpt")
        return ["--ckpt_path", str(tmp / "other.ckpt")]

    return edit


def garbage_checkpoint(config: dict, tmp: Path) -> list[str]:
    (tmp / "garbage.ckpt").write_text("not a checkpoint")
    return ["--ckpt_path", str(tmp / "garbage.ckpt")]


def args(*extra: str):
    return lambda config, tmp: list(extra)


def model_folder_without_config(config: dict, tmp: Path) -> None:
    (tmp / "half-copied-model").mkdir()
    (tmp / "half-copied-model" / "tokenizer.json").write_text("{}")
    config["model"]["model_name_or_path"] = str(tmp / "half-copied-model")


def model_folder_without(*absent: str, shards: bool = False):
    """Edit: train a copy of the quickstart's model folder with the files ``absent`` removed (``shards``: its
    weights split in two shards, the second one then removed)."""

    def edit(config: dict, tmp: Path) -> None:
        folder = tmp / "copied-model"
        shutil.copytree(ROOT / "grpo_lightning" / "assets" / "tiny-arith", folder)
        if shards:
            (folder / "model.safetensors").unlink()
            weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
            (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
            (folder / "model-00001-of-00002.safetensors").write_bytes(b"")
        for name in absent:
            (folder / name).unlink()
        config["model"] = {"model_name_or_path": str(folder)}

    return edit


def both(*edits):
    """Edit: several edits, in order."""
    return lambda config, tmp: [arg for edit in edits for arg in (edit(config, tmp) or [])]


def callback(class_name: str, **init_args):
    """Edit: run with the callback ``grpo_lightning.callbacks.<class_name>(**init_args)``."""
    path = f"grpo_lightning.callbacks.{class_name}"
    return setting("trainer.callbacks", [{"class_path": path, "init_args": init_args}])


ROUND_CHECKPOINT = [{"class_path": "grpo_lightning.callbacks.RoundCheckpoint", "init_args": {"every_n_rounds": 0}}]

# name: (edit of the base config, text the one-line error must contain)
CATALOGUE = {
    "unknown_key": (setting("model.lerning_rate", 1.0), "model.lerning_rate"),
    "unknown_nested_key": (setting("data.sampling.grup_size", 4), "did you mean 'data.sampling.group_size'"),
    "unknown_key_on_command_line": (args("--data.promts_per_round", "4"), "data.promts_per_round"),
    "wrong_type": (setting("model.lr", "fast"), "model.lr: expected a float"),
    "missing_config_file": (args("--config", "no_such.yaml"), "no_such.yaml"),
    "group_size_1": (setting("data.sampling.group_size", 1), "data.sampling.group_size"),
    "temperature_0": (setting("data.sampling.temperature", 0.0), "data.sampling.temperature"),
    "prompts_per_round_0": (setting("data.prompts_per_round", 0), "data.prompts_per_round"),
    "num_iterations_0": (setting("data.update.num_iterations", 0), "data.update.num_iterations must be >= 1"),
    "unknown_engine": (setting("data.engine", "bogus"), "data.engine: unknown engine 'bogus'"),
    "unknown_tool": (
        setting(
            "data.environment",
            {
                "class_path": "grpo_lightning.integrations.environments.ToolEnvironment",
                "init_args": {"tools": ["abacus"]},
            },
        ),
        "data.environment.init_args.tools: unknown tool 'abacus'",
    ),
    "max_turns_0": (
        setting(
            "data.environment",
            {"class_path": "grpo_lightning.integrations.environments.ToolEnvironment", "init_args": {"max_turns": 0}},
        ),
        "data.environment.init_args.max_turns must be >= 1",
    ),
    "environment_not_an_environment": (
        setting("data.environment", {"class_path": "grpo_lightning.engines.LeanEngine"}),
        "data.environment",
    ),
    "max_nonfinite_skips_0": (setting("model.max_nonfinite_skips", 0), "model.max_nonfinite_skips"),
    "every_n_rounds_0": (setting("trainer.callbacks", ROUND_CHECKPOINT), "every_n_rounds"),
    "reload_every_2_epochs": (setting("trainer.reload_dataloaders_every_n_epochs", 2), "reload_dataloaders"),
    "mini_batch_not_dividing": (setting("data.update.mini_batch_size", 6), "data.update.mini_batch_size (6)"),
    "micro_batches_vs_accumulation": (
        both(setting("data.update.micro_batch_size", 8), setting("trainer.accumulate_grad_batches", 3)),
        "trainer.accumulate_grad_batches = 3 contradicts data.update.mini_batch_size / "
        "data.update.micro_batch_size = 2",
    ),
    "context_too_short": (setting("model.tiny_model.max_position_embeddings", 8), "max_new_tokens=4"),
    "no_such_data_file": (setting("data.dataset", "missing.jsonl"), "no such file 'missing.jsonl'"),
    "empty_data_file": (files([]), "is empty"),
    "malformed_data_file": (files(text='{"prompt": "1+1="\n'), "cannot read"),
    "no_prompt_column": (files([{"question": "1+1=", "answer": "2"}]), "no prompt column 'prompt'"),
    "no_answer_column": (files([{"prompt": "1+1="}]), "needs the column 'answer'"),
    "empty_prompt_row": (files([{"prompt": "1+1=", "answer": "2"}, {"prompt": " ", "answer": "0"}]), "row 1"),
    "empty_validation_data": (setting("data.eval.limit", 0), "validation data"),
    "unknown_loss_type": (setting("model.objective.loss_type", "bogus"), "model.objective: unknown loss_type 'bogus'"),
    "loss_with_a_wrong_signature": (
        setting("model.objective.loss_type", "bad_loss:two_positionals"),
        "parameter 'settings' after inputs must be a keyword setting",
    ),
    "loss_kwargs_typo": (
        setting("model.objective", {"loss_type": "sapo", "loss_kwargs": {"tau": 1.0}}),
        "loss_kwargs.tau is not a setting of loss_type 'sapo' (its settings: tau_pos, tau_neg",
    ),
    "aggregation_against_the_paper": (
        setting("model.objective", {"loss_type": "gmpo", "aggregation": "token_mean"}),
        "aggregation 'token_mean' contradicts loss_type 'gmpo'",
    ),
    "unknown_reward": (reward("no_such_reward"), "no_such_reward"),
    "unimportable_reward": (reward("no_such_package.score"), "no_such_package.score"),
    "reward_wrong_count": (reward("bad_short.short"), "bad_short.short"),
    "reward_not_a_number": (reward("bad_text.text"), "bad_text.text"),
    "reward_raises": (reward("bad_raise.boom"), "reward 'bad_raise.boom' raised KeyError"),
    "reward_hangs": (reward("bad_slow.slow", reward_timeout_s=0.2), "reward 'bad_slow.slow' ran longer"),
    "reward_kwargs_typo": (
        setting("data.rewards", [{"name": "math_accuracy", "kwargs": {"mod": "lenient"}}]),
        "data.rewards[0] (math_accuracy): unknown kwargs key 'mod'; valid: modes, last_number, timeout_s, backend",
    ),
    "checkpoint_of_another_model": (checkpoint_of(64), "model.tiny_model"),
    "no_such_checkpoint": (args("--ckpt_path", "missing.ckpt"), "ckpt_path: no such checkpoint file"),
    "not_a_checkpoint": (garbage_checkpoint, "ckpt_path: cannot read"),
    # Numbers out of range that torch or Lightning would refuse only later, with a traceback, or never (a negative
    # gradient_clip_val flips the gradients): validation.SETTING_RANGES, checked before anything is built.
    "negative_lr": (setting("model.lr", -1.0), "model.lr must be >= 0 (got -1.0)"),
    "negative_weight_decay": (setting("model.weight_decay", -0.1), "model.weight_decay must be >= 0"),
    "negative_warmup": (setting("model.warmup_steps", -1), "model.warmup_steps must be >= 0"),
    "logprob_batch_size_0": (setting("model.logprob_batch_size", 0), "model.logprob_batch_size must be >= 1"),
    "reward_timeout_0": (setting("data.reward_timeout_s", 0), "data.reward_timeout_s must be > 0"),
    "negative_mini_batch": (setting("data.update.mini_batch_size", -4), "data.update.mini_batch_size must be >= 1"),
    "micro_batch_0": (setting("data.update.micro_batch_size", 0), "data.update.micro_batch_size must be >= 1"),
    "val_batch_size_0": (setting("data.eval.batch_size", 0), "data.eval.batch_size must be >= 1"),
    "accumulate_0": (setting("trainer.accumulate_grad_batches", 0), "trainer.accumulate_grad_batches must be >= 1"),
    "negative_gradient_clip": (setting("trainer.gradient_clip_val", -1.0), "trainer.gradient_clip_val must be >= 0"),
    "validate_every_0_epochs": (setting("trainer.check_val_every_n_epoch", 0), "trainer.check_val_every_n_epoch"),
    "val_check_interval_0": (setting("trainer.val_check_interval", 0), "trainer.val_check_interval must be > 0"),
    "tiny_model_odd_heads": (setting("model.tiny_model.num_heads", 3), "model.tiny_model.num_heads (3)"),
    "tiny_model_no_layers": (setting("model.tiny_model.num_layers", 0), "model.tiny_model.num_layers must be >= 1"),
    # Trainer settings that Lightning refuses when the Trainer is built: its message, naming the setting.
    "max_epochs_-2": (setting("trainer.max_epochs", -2), "trainer.max_epochs: `max_epochs` must be"),
    "devices_0": (setting("trainer.devices", 0), "trainer.devices: `Trainer(devices=0)`"),
    "unknown_accelerator": (setting("trainer.accelerator", "bogus"), "trainer.accelerator: "),
    "unknown_strategy": (setting("trainer.strategy", "bogus"), "trainer.strategy: "),
    "num_nodes_0": (setting("trainer.num_nodes", 0), "trainer.num_nodes: "),
    "negative_limit_val_batches": (setting("trainer.limit_val_batches", -1), "trainer.limit_val_batches: "),
    "unknown_clip_algorithm": (setting("trainer.gradient_clip_algorithm", "bogus"), "trainer.gradient_clip_algorithm"),
    "unknown_precision": (setting("trainer.precision", "17"), "trainer.precision: got '17'; expected one of 64,"),
    "unwritable_root_dir": (
        setting("trainer.default_root_dir", "/proc/no_such_dir"),
        "trainer.default_root_dir: cannot create",
    ),
    # Callbacks' own settings.
    "console_samples_0": (callback("ConsoleSamples", num_samples=0), "ConsoleSamples.num_samples must be >= 1"),
    "completions_every_0": (callback("CompletionsTable", every_n_rounds=0), "CompletionsTable.every_n_rounds"),
    # Paths.
    "missing_model_folder": (setting("model.model_name_or_path", "./no_such_model"), "no such local folder"),
    "model_folder_without_config": (model_folder_without_config, "has no config.json"),
    "model_folder_without_weights": (model_folder_without("model.safetensors"), "has no weights (model.safetensors"),
    "model_folder_missing_a_shard": (model_folder_without(shards=True), "lacks 1 of the 2 weight shards"),
    "model_folder_without_tokenizer": (model_folder_without("tokenizer.json"), "has no tokenizer files"),
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder with the broken reward modules, importable; the working directory of the run."""
    for name, source in REWARD_MODULES.items():
        (tmp_path / name).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def command(name: str, tmp: Path) -> list[str]:
    edit, _ = CATALOGUE[name]
    config = json.loads(json.dumps(BASE))
    extra = edit(config, tmp) or []
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    return ["fit", "--config", str(tmp / "config.yaml"), *extra]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


class _FirstStep(Exception):
    """Raised by the first training step of the control run."""


def test_the_unedited_base_config_passes_every_check_and_trains(workdir, monkeypatch):
    """The catalogue's control: without an edit the same config passes every up-front check and reaches the first
    training step, so each entry is refused for its own edit, not for something in the base."""

    def first_step(*_args, **_kwargs):
        raise _FirstStep

    monkeypatch.setattr(GRPOModule, "training_step", first_step)
    (workdir / "config.yaml").write_text(yaml.safe_dump(BASE))
    with pytest.raises(_FirstStep):
        main(["fit", "--config", str(workdir / "config.yaml")])


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_bad_input_is_refused_before_training_in_one_line(workdir, capsys, monkeypatch, name):
    def no_training(*_args, **_kwargs):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(GRPOModule, "training_step", no_training)
    with pytest.raises(SystemExit) as exit_info:
        main(command(name, workdir))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1 and CATALOGUE[name][1] in lines[0], err[-2000:]


# A real process for the phases where Lightning has set up its logging and warnings (the Trainer's construction,
# the checks before fit); parsing errors print before any of it, and the whole catalogue runs in-process above.
@pytest.mark.parametrize("name", ["devices_0", "reward_raises"])
def test_the_real_cli_refuses_bad_input_in_one_line(workdir, name):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(workdir)]), "WANDB_MODE": "offline"}
    run = subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *command(name, workdir)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = error_lines(run.stderr)
    assert len(lines) == 1 and CATALOGUE[name][1] in lines[0], run.stderr[-2000:]


def test_parse_errors_become_one_line():
    nested = (
        'Parser key "trainer.callbacks":\n  Does not validate against any of the Union subtypes\n  Errors:\n'
        "    - Problem with given class_path 'my.Callback':\n        No module named 'my'\n"
        "    - Expected a <class 'NoneType'>\n  Given value type: <class 'dict'>"
    )
    assert parse_error_line(nested) == "trainer.callbacks: my.Callback: No module named 'my'"
    assert parse_error_line("unrecognized arguments: --model.lrr 1") == (
        "unknown setting 'model.lrr' (did you mean 'model.lr'?)"
    )


def _hf_folder(tmp_path: Path, *, eos_in_tokenizer: bool, eos_in_config: bool, pad: bool) -> str:
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(TINY, tokenizer)
    if not eos_in_tokenizer:
        tokenizer.eos_token = None
    if not pad:
        tokenizer.pad_token = None
    if not eos_in_config:
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_tokenizer_without_pad_or_eos_is_fixed_from_the_model_config_with_a_warning(tmp_path, caplog):
    path = _hf_folder(tmp_path, eos_in_tokenizer=False, eos_in_config=True, pad=False)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning"):
        module = GRPOModule(model_name_or_path=path)
    assert module.tokenizer.eos_token == module.tokenizer.pad_token == "<eos>"
    assert "no eos token" in caplog.text and "no pad token" in caplog.text


def test_a_tokenizer_without_eos_anywhere_is_refused(workdir, capsys):
    path = _hf_folder(workdir / "model", eos_in_tokenizer=False, eos_in_config=False, pad=True)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(workdir / "c.yaml"), "--model.model_name_or_path", path])
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "has no eos token" in lines[0]


@pytest.fixture(autouse=True)
def _config_for_the_eos_case(request, tmp_path):
    if request.node.name == "test_a_tokenizer_without_eos_anywhere_is_refused":
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k != "model"}))


def test_trainer_errors_name_the_setting_by_its_name_or_its_quoted_value():
    named = trainer_error(ValueError("`num_nodes` must be a positive integer, but got 0."), {})
    assert str(named) == "trainer.num_nodes: `num_nodes` must be a positive integer, but got 0."
    # Lightning's message on a machine without a GPU names the value only.
    quoted = trainer_error(MisconfigurationException("No supported gpu backend\nfound!"), {"accelerator": "gpu"})
    assert str(quoted) == "trainer.accelerator: No supported gpu backend found!"
    assert str(trainer_error(TypeError("something else"), {})) == "trainer: something else"


def test_a_model_the_hub_cannot_give_is_one_line(workdir, capsys, monkeypatch):
    import transformers

    def offline(name, *_args, **_kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}.\nCheck your connection.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)  # both fail offline, the first says so
    (workdir / "c.yaml").write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k != "model"}))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(workdir / "c.yaml"), "--model.model_name_or_path", "some-org/some-model"])
    lines = error_lines(capsys.readouterr().err)
    assert lines == [
        "error: model.model_name_or_path: cannot load 'some-org/some-model' (there is no local folder of that name "
        "either): We couldn't connect to 'https://huggingface.co' to load some-org/some-model."
    ]


def test_a_value_outside_a_union_of_choices_lists_them():
    message = (
        'Parser key "trainer.precision":\n  Does not validate against any of the Union subtypes\n'
        "  Subtypes: [typing.Literal[64, 32], typing.Literal['bf16-mixed', '32-true'], <class 'NoneType'>]\n"
        "  Errors:\n  Given value type: <class 'str'>\n  Given value: 17"
    )
    choices = "64, 32, 'bf16-mixed', '32-true', null"
    assert parse_error_line(message) == f"trainer.precision: got '17'; expected one of {choices}"
    mixed = message.replace("<class 'NoneType'>", "<class 'int'>")  # not only fixed choices: no list
    assert "expected one of" not in parse_error_line(mixed)
