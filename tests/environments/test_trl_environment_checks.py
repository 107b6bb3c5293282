"""``TRLEnvironment``'s checks and a run: a bad factory, a row naming an unknown class, a template that writes no
tool calls, each refused in one line before training; and the docs' YAML (two classes chosen per row) through
the CLI's parser and one round of ``fit`` on a tiny model. The classes are ``test_trl_environments``'.
"""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from test_chat_formats import NO_TOOLS, qwen_tokenizer
from test_trl_environments import MATH, QUESTION, WEATHER, set_up

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments import TRLEnvironment
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.data_sources import checked_rows
from grpo_lightning.rollout.prompts import PromptEncoder

CLASSES = "test_trl_environments"
ANSWER_LENGTH = f"{CLASSES}.answer_length"


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "factory, expected",
    [
        ("nowhere_at_all.envs:WeatherEnv", "data.environment.init_args.factory: cannot import 'nowhere_at_all.envs"),
        (f"{CLASSES}:Missing", f"cannot import '{CLASSES}:Missing'"),
        ("WeatherEnv", "'WeatherEnv' is not an import path; write pkg.module:Class"),
        (f"{CLASSES}:NoReset", "(NoReset) has no reset method; a TRL environment class defines reset(**row)"),
        (f"{CLASSES}:Undocumented", "Undocumented.lookup is public, so a tool, but has no schema"),
        ({"weather": WEATHER, "math": f"{CLASSES}:NoReset"}, "factory.math: "),
        ({}, "factory is an empty mapping"),
    ],
)
def test_a_bad_factory_is_refused_in_one_line(factory, expected):
    with pytest.raises(ConfigError) as refused:
        TRLEnvironment(factory=factory)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_rows_are_checked_before_training():
    env = set_up({"weather": WEATHER, "math": MATH})
    encoder = PromptEncoder(env.tokenizer, use_chat_template=True)
    scorer = Scorer([RewardSpec(ANSWER_LENGTH)])
    good = [{"prompt": QUESTION, "environment": "weather"}, {"prompt": QUESTION, "environment": "math"}]
    for rows, expected in [
        (good + [{"prompt": QUESTION, "environment": "chess"}], "train data row 2: its environment 'chess' is not one"),
        ([{"prompt": QUESTION}], "train data has no column 'environment', which data.environment reads"),
    ]:
        with pytest.raises(ConfigError) as refused:
            checked_rows(
                Dataset.from_list(rows), "train data", prompt_column="prompt", encoder=encoder, scorer=scorer,
                environment=env,
            )  # fmt: skip
        assert expected in str(refused.value) and "\n" not in str(refused.value)
    # The length check counts the tools the prompt lists: a context that holds the question alone is too short.
    bare = len(encoder.token_ids([QUESTION])[0])
    with pytest.raises(ConfigError, match="train data"):
        checked_rows(
            Dataset.from_list(good), "train data", prompt_column="prompt", encoder=encoder, scorer=scorer,
            environment=env, context_length=bare + 10, max_new_tokens=4,
        )  # fmt: skip


def test_a_template_that_writes_no_tool_calls_or_tools_in_the_kwargs_are_refused_in_one_line():
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = NO_TOOLS
    with pytest.raises(ConfigError, match="the tokenizer's chat template does not write tool calls; TRLEnvironment"):
        set_up(WEATHER, tokenizer)
    env = TRLEnvironment(factory=WEATHER)
    env.chat_template_kwargs = {"tools": []}
    with pytest.raises(ConfigError, match="data.chat_template_kwargs.tools"):
        env.setup(qwen_tokenizer())
    plain = PromptEncoder(qwen_tokenizer(), use_chat_template=False)
    with pytest.raises(ConfigError, match="lists its tools in the prompt through the chat template"):
        plain.render("What is the weather?", set_up(WEATHER).prompt_tools({}))


# --------------------------------------------------------------------------------------------- a run, by YAML
def test_a_yaml_config_trains_a_round_with_two_classes_chosen_per_row(tmp_path, monkeypatch):
    """The docs' configuration: ``data.environment`` names the classes by import path; one round of ``fit`` on
    a tiny model with the Qwen-style tokenizer runs the trajectories and logs ``get_reward`` as ``env_WeatherEnv``."""
    from helpers import save_tiny_llama

    from grpo_lightning.cli import GRPOCLI

    monkeypatch.chdir(tmp_path)
    config = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    config.max_position_embeddings = 1280  # the prompts list the tools: ~1170 characters, a token each
    model = save_tiny_llama(tmp_path / "model", config, qwen_tokenizer())
    rows = [{"prompt": QUESTION, "city": "Paris", "environment": "weather"}] * 2
    rows += [{"prompt": [{"role": "user", "content": "2+40?"}], "city": None, "environment": "math"}] * 2
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "run.yaml").write_text(
        f"""
trainer: {{accelerator: cpu, max_epochs: 1, logger: false, callbacks: [], enable_checkpointing: false,
          enable_progress_bar: false, enable_model_summary: false, limit_val_batches: 0}}
model: {{model_name_or_path: {model}}}
data:
  dataset: rows.jsonl
  val_split: null
  prompts_per_round: 4
  sampling: {{group_size: 2, max_new_tokens: 12}}
  rewards: [{{name: {ANSWER_LENGTH}}}]
  environment:
    class_path: grpo_lightning.integrations.environments.TRLEnvironment
    init_args:
      factory: {{weather: {WEATHER}, math: {MATH}}}
      max_turns: 2
"""
    )
    cli = GRPOCLI(args=["--config", "run.yaml"], run=False)
    env = cli.datamodule.environment
    assert isinstance(env, TRLEnvironment) and set(env.classes) == {"weather", "math"}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rollout = cli.datamodule.last_rollout
    assert cli.trainer.global_step >= 1 and len(rollout.prompts) == 8
    weather = [i for i, p in enumerate(rollout.prompts) if p == QUESTION]
    # A random model calls no tool: Paris not asked (0); MathEnv has no get_reward: None there, as in TRL.
    assert rollout.reward_columns["env_WeatherEnv"] == [0.0 if i in weather else None for i in range(8)]
    tokenizer = cli.model.tokenizer
    for i in range(8):
        text = tokenizer.decode(rollout.prompt_ids[i][rollout.prompt_mask[i].bool()])
        assert ('"name": "forecast"' in text) == (i in weather) and ('"name": "add"' in text) != (i in weather)
        assert text.endswith("<|im_start|>assistant\n") and ("(You are in Paris.)" in text) == (i in weather)
