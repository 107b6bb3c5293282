"""A catalogue of bad inputs: each is refused before the first training step, with one line naming the culprit.

Most run in this process through ``grpo_lightning.cli.main`` (the CLI's entry point); two go through the real
``python -m grpo_lightning`` to prove the same holds there.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY

from grpo_lightning import GRPOModule
from grpo_lightning.cli import main, parse_error_line
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama

ROOT = Path(__file__).resolve().parents[1]

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
    "model": {"tiny_model": asdict(TINY), "sampling": {"group_size": 4, "max_new_tokens": 4}},
    # A small task: building the prompt set takes no time.
    "data": {"prompts_per_round": 4, "val_limit": 8, "task_kwargs": {"max_operand": 20, "test_size": 50}},
}

REWARD_MODULES = {
    "bad_short.py": "def short(prompts, completions, **kw):\n    return [1.0]\n",
    "bad_text.py": "def text(prompts, completions, **kw):\n    return ['yes'] * len(completions)\n",
    "bad_raise.py": "def boom(prompts, completions, **kw):\n    raise KeyError('no score for this one')\n",
    "bad_slow.py": "import time\n\ndef slow(prompts, completions, **kw):\n    time.sleep(30)\n",
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


def reward(name: str, **model):
    """Edit: score with the reward ``name`` (an import path, for the modules in REWARD_MODULES)."""
    return setting("model", {**BASE["model"], "rewards": [{"name": name}], **model})


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


ROUND_CHECKPOINT = [{"class_path": "grpo_lightning.callbacks.RoundCheckpoint", "init_args": {"every_n_rounds": 0}}]

# name: (edit of the base config, text the one-line error must contain)
CATALOGUE = {
    "unknown_key": (setting("model.lerning_rate", 1.0), "model.lerning_rate"),
    "unknown_nested_key": (setting("model.sampling.grup_size", 4), "did you mean 'model.sampling.group_size'"),
    "unknown_key_on_command_line": (args("--data.promts_per_round", "4"), "data.promts_per_round"),
    "wrong_type": (setting("model.lr", "fast"), "model.lr: expected a float"),
    "missing_config_file": (args("--config", "no_such.yaml"), "no_such.yaml"),
    "group_size_1": (setting("model.sampling.group_size", 1), "model.sampling.group_size"),
    "temperature_0": (setting("model.sampling.temperature", 0.0), "model.sampling.temperature"),
    "prompts_per_round_0": (setting("data.prompts_per_round", 0), "data.prompts_per_round"),
    "max_nonfinite_skips_0": (setting("model.max_nonfinite_skips", 0), "model.max_nonfinite_skips"),
    "every_n_rounds_0": (setting("trainer.callbacks", ROUND_CHECKPOINT), "every_n_rounds"),
    "reload_every_2_epochs": (setting("trainer.reload_dataloaders_every_n_epochs", 2), "reload_dataloaders"),
    "mini_batch_not_dividing": (setting("data.mini_batch_size", 6), "data.mini_batch_size (6)"),
    "micro_batches_vs_accumulation": (setting("data.micro_batch_size", 8), "accumulate_grad_batches"),
    "context_too_short": (setting("model.tiny_model.max_position_embeddings", 8), "max_new_tokens=4"),
    "no_such_data_file": (setting("data.dataset", "missing.jsonl"), "no such file 'missing.jsonl'"),
    "empty_data_file": (files([]), "is empty"),
    "malformed_data_file": (files(text='{"prompt": "1+1="\n'), "cannot read"),
    "no_prompt_column": (files([{"question": "1+1=", "answer": "2"}]), "no prompt column 'prompt'"),
    "no_answer_column": (files([{"prompt": "1+1="}]), "needs the column 'answer'"),
    "empty_prompt_row": (files([{"prompt": "1+1=", "answer": "2"}, {"prompt": " ", "answer": "0"}]), "row 1"),
    "empty_validation_data": (setting("data.val_limit", 0), "validation data"),
    "unknown_reward": (reward("no_such_reward"), "no_such_reward"),
    "unimportable_reward": (reward("no_such_package.score"), "no_such_package.score"),
    "reward_wrong_count": (reward("bad_short.short"), "bad_short.short"),
    "reward_not_a_number": (reward("bad_text.text"), "bad_text.text"),
    "reward_raises": (reward("bad_raise.boom"), "reward 'bad_raise.boom' raised KeyError"),
    "reward_hangs": (reward("bad_slow.slow", reward_timeout_s=0.2), "reward 'bad_slow.slow' ran longer"),
    "checkpoint_of_another_model": (checkpoint_of(64), "model.tiny_model"),
    "no_such_checkpoint": (args("--ckpt_path", "missing.ckpt"), "ckpt_path: no such checkpoint file"),
    "not_a_checkpoint": (garbage_checkpoint, "ckpt_path: cannot read"),
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


def test_the_catalogue_is_large():
    assert len(CATALOGUE) >= 15


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


@pytest.mark.parametrize("name", ["unknown_key", "reward_raises"])
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
