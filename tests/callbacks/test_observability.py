"""Seeing a run: W&B offline run read back (metrics, config, tables, code), timings, console view, plots, k-sample
evaluation end to end."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import wandb
from conftest import TINY
from helpers import load_tool
from lightning import Trainer
from rich.console import Console
from run_logs import load_run, read_csv_metrics  # tools/run_logs.py (tools/ is on sys.path: conftest)

from grpo_lightning import EvalConfig, GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks import ConsoleSamples, LoggerSaveConfigCallback, wandb_mode
from grpo_lightning.cli import GRPOCLI, TRAINER_DEFAULTS
from grpo_lightning.metrics import majority_vote, pass_at_k
from grpo_lightning.rewards import RewardSpec, register

ROUNDS, PROMPTS, GROUP, K = 3, 4, 4, 4
NAMESPACES = ("train/", "rollout/", "reward/", "val/", "time/", "completions/")


def run_config(root: Path) -> dict:
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": ROUNDS,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "check_val_every_n_epoch": 1,
            # One optimizer step per round: train/* (step-level) is written at the 2nd step only, while the
            # round-level metrics (rollout/, reward/, time/, val/) must be written every round whatever this is.
            "log_every_n_steps": 2,
            "logger": [
                {
                    "class_path": "grpo_lightning.callbacks.GRPOWandbLogger",
                    "init_args": {"project": "test", "name": "obs", "save_dir": str(root / "runs")},
                },
                {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root / "csv")}},
            ],
            "callbacks": [
                {"class_path": "grpo_lightning.callbacks.RoundTimer"},
                {"class_path": "grpo_lightning.callbacks.CompletionsTable", "init_args": {"every_n_rounds": 1}},
                {
                    "class_path": "grpo_lightning.callbacks.ConsoleSamples",
                    "init_args": {"every_n_rounds": 2, "num_samples": 3},
                },
            ],
        },
        "model": {
            "tiny_model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "lr": 1e-3,
        },
        "data": {
            "sampling": {"group_size": GROUP, "max_new_tokens": 4},
            "eval": {"num_samples": K, "pass_k": [1, 2, K], "limit": 8},
            "prompts_per_round": PROMPTS,
            "task_kwargs": {"test_size": 50},
        },
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three rounds through the CLI with W&B (mode decided by the logger: no credentials → offline) and CSV."""
    import yaml

    root = tmp_path_factory.mktemp("observability")
    (root / "config.yaml").write_text(yaml.safe_dump(run_config(root)))
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
            patch.delenv(name, raising=False)
        patch.setenv("NETRC", str(root / "no-netrc"))  # no credentials anywhere
        for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):  # keep the home folder clean
            patch.setenv(name, str(root / name.lower()))
        patch.chdir(root)
        cli = GRPOCLI(
            GRPOModule,
            RolloutDataModule,
            args=["--config", str(root / "config.yaml")],
            run=False,
            save_config_callback=LoggerSaveConfigCallback,
            seed_everything_default=0,
        )
        console = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ConsoleSamples))
        console.console = Console(file=io.StringIO(), width=200)
        try:
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        finally:
            wandb.finish()
            # W&B's process-wide settings were read from this run's environment (no credentials, its own folders):
            # dropped, so that a later test of this process starts from its own (an offline logger tried to log in)
            wandb.teardown()
    log = load_run(root / "runs", wait_s=60)  # W&B's service may still be writing the file after finish()
    assert log.finished
    return {"root": root, "trainer": cli.trainer, "console": console.console.file.getvalue(), "log": log}


def test_wandb_offline_run_holds_metrics_config_tables_and_code(run):
    log = run["log"]
    keys = log.keys()
    expected = {
        "train/loss",
        "train/kl",
        "rollout/reward_mean",
        "rollout/completion_length_mean",
        "reward/exact_answer",
        "time/generate",
        "time/score",
        "time/logprobs",
        "time/update",
        "time/round",
        "time/generated_tokens_per_s",
        "time/trained_tokens_per_s",
        "val/accuracy",
        "val/reward_mean",
        "val/pass@1",
        "val/pass@2",
        f"val/pass@{K}",
        f"val/maj@{K}",
        "val/sample_reward_mean",
    }
    assert expected <= keys, expected - keys
    # Every metric sits in a namespace (besides W&B's own _keys and Lightning's step/epoch counters).
    loose = {k for k in keys if not k.startswith(("_", *NAMESPACES)) and k not in ("epoch", "trainer/global_step")}
    assert not loose, loose
    # One value per round for the round-level metrics, although log_every_n_steps = 2.
    assert len(log.series("rollout/reward_mean")[1]) == ROUNDS
    assert len(log.series("time/update")[1]) == ROUNDS and min(log.series("time/update")[1]) > 0
    assert len(log.series("val/accuracy")[1]) == ROUNDS
    # The full CLI config, not only the module's hyperparameters.
    assert log.config["trainer"]["max_epochs"] == ROUNDS
    assert log.config["data"]["prompts_per_round"] == PROMPTS
    assert log.config["data"]["eval"]["num_samples"] == K
    # A separate completions table per round, with the reward functions and advantages.
    assert sorted(log.tables) == [f"completions/round_{r:04d}" for r in range(ROUNDS)]
    table = log.tables["completions/round_0002"]
    assert table["columns"] == ["round", "step", "prompt", "completion", "reward", "exact_answer", "advantage"]
    assert len(table["data"]) == PROMPTS * GROUP and {row[0] for row in table["data"]} == {2}
    assert ("source-code", "code") in log.artifacts
    run_dir = next((run["root"] / "runs" / "wandb").glob("offline-run-*"))
    assert (run_dir / "files" / "config.yaml").is_file()


def test_progress_bar_shows_reward_and_throughput(run):
    shown = run["trainer"].progress_bar_metrics
    assert {"reward", "gen_tok/s", "train_tok/s"} <= set(shown)
    assert shown["train_tok/s"] > 0


def test_console_samples_every_n_rounds(run):
    text = run["console"]
    assert "round 1 " in text and "round 3 " in text and "round 2 " not in text  # counted from 1
    assert "completion" in text and "exact_answer" in text and "advantage" in text


@pytest.mark.parametrize("source", ["runs", "csv"])
def test_plot_run_draws_the_four_curves(run, source, tmp_path):
    pytest.importorskip("matplotlib")  # the "plot" extra (also in "dev")
    plot_run = load_tool("plot_run")
    out, points = plot_run.plot_run(run["root"] / source, tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000
    assert set(points) == {"reward", "KL to the reference", "completion length (tokens)", "accuracy"}
    assert all(count > 0 for count in points.values()), points


def test_csv_logs_match_the_wandb_logs(run):
    csv_file = next((run["root"] / "csv").glob("**/metrics.csv"))
    csv_log, wandb_log = read_csv_metrics(csv_file), run["log"]
    assert csv_log.series("rollout/reward_mean")[1] == pytest.approx(wandb_log.series("rollout/reward_mean")[1])


def test_wandb_mode_offline_without_credentials(tmp_path):
    netrc = tmp_path / "netrc"
    bare = {"NETRC": str(netrc)}
    assert wandb_mode(None, bare) == "offline"
    assert wandb_mode(None, {**bare, "WANDB_API_KEY": "k" * 40}) == "online"
    assert wandb_mode(None, {**bare, "WANDB_MODE": "disabled"}) is None  # the user's WANDB_MODE decides
    assert wandb_mode(True, {**bare, "WANDB_API_KEY": "k" * 40}) == "offline"
    assert wandb_mode(False, bare) == "online"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_mode(None, bare) == "online"
    assert wandb_mode(None, {**bare, "WANDB_BASE_URL": "https://wandb.example.com"}) == "offline"


_SEEN: list[tuple[list[str], list[float]]] = []


@register("test_even_length")
def even_length(prompts, completions, **_):
    """Correct iff the completion has an even number of characters; records what it scored."""
    values = [float(len(c) % 2 == 0) for c in completions]
    _SEEN.append((list(completions), values))
    return values


def test_k_sample_evaluation_matches_a_recomputation(tmp_path):
    module = GRPOModule(tiny_model=TINY)
    data = RolloutDataModule(
        rewards=[RewardSpec("test_even_length")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=6),
        eval=EvalConfig(num_samples=6, pass_k=[1, 3, 6], limit=8, batch_size=8),
        task_kwargs={"test_size": 50},
    )
    trainer = Trainer(**TRAINER_DEFAULTS, accelerator="cpu", logger=False, enable_progress_bar=False)
    _SEEN.clear()
    torch.manual_seed(0)
    first = trainer.validate(module, datamodule=data, verbose=False)[0]
    (greedy, greedy_values), (samples, values) = _SEEN  # one batch: greedy scoring, then the 8 × 6 samples
    assert len(greedy) == 8 and len(samples) == 8 * 6
    assert first["val/accuracy"] == pytest.approx(sum(greedy_values) / 8)
    groups = [range(i, i + 6) for i in range(0, 48, 6)]
    for k in (1, 3, 6):
        expected = sum(pass_at_k(6, int(sum(values[j] for j in g)), k) for g in groups) / 8
        assert first[f"val/pass@{k}"] == pytest.approx(expected, abs=1e-6)
    majority = [values[g[majority_vote([samples[j].strip() for j in g])]] for g in groups]
    assert first["val/maj@6"] == pytest.approx(sum(majority) / 8)
    assert 0 < first["val/pass@1"] < 1  # the test means something: a mix of right and wrong samples
    # Reproducible, and the rollout's sampling generator is not touched by evaluation.
    untouched = torch.Generator().manual_seed(data.seed).get_state()
    generator = data.collector.generator
    assert generator is None or torch.equal(generator.get_state(), untouched)
    assert trainer.validate(module, datamodule=data, verbose=False)[0] == first
