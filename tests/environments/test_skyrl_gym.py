"""``SkyRLGymEnvironment``: skyrl-gym's own ``gsm8k_multi_turn`` and ``gsm8k`` (each row choosing by its
``env_class``, SkyRL's dataset format) and a test environment registered here, through multi-turn rollouts.

A scripted policy with the Qwen-style tokenizer: the trajectory is the chat template's rendering of the conversation
token for token (each step's messages rendered after the turn and tokenized alone), the prompt is what ``init``
returned, the per-turn rewards are summed into ``env_skyrl_gym``, and stepping 8 trajectories with 3 workers gives
the trajectories of one at a time. Rows an environment cannot start from, unknown ids and an environment that raises
are refused in one line; a YAML config trains a round.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time

import pytest
import torch

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed: pip install -e .[skyrl-gym]")

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402
from test_chat_formats import qwen_tokenizer  # noqa: E402
from test_multiturn import chat_rollout, parts  # noqa: E402

from grpo_lightning.config import ConfigError  # noqa: E402
from grpo_lightning.integrations.environments import SkyRLGymEnvironment  # noqa: E402

END = "<|im_end|>"
STATS = {"in_flight": 0, "most_in_flight": 0}
_LOCK = threading.Lock()


class CountdownEnv(BaseTextEnv):
    """A test environment: ``init`` puts a system message first; each step answers ``<n> left`` as a user message
    (reward 0.5) until the row's ``count`` turns are done (reward 2); ``boom`` in a turn raises. Each step sleeps
    20 ms and counts the steps in flight."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.left = int(extras["count"])
        self.greeting = env_config.greeting if env_config is not None else "Count down."

    def init(self, prompt):
        return [{"role": "system", "content": self.greeting}, *prompt], {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        with _LOCK:
            STATS["in_flight"] += 1
            STATS["most_in_flight"] = max(STATS["most_in_flight"], STATS["in_flight"])
        time.sleep(0.02)
        with _LOCK:
            STATS["in_flight"] -= 1
        if "boom" in action:
            raise ValueError("boom went the environment")
        self.left -= 1
        if self.left == 0:
            return BaseTextEnvStepOutput(observations=[], reward=2.0, done=True, metadata={})
        message = {"role": "user", "content": f"{self.left} left"}
        return BaseTextEnvStepOutput(observations=[message], reward=0.5, done=False, metadata={})


if "grpo_test_countdown" not in skyrl_gym.registry:
    skyrl_gym.register(id="grpo_test_countdown", entry_point=f"{__name__}:CountdownEnv")


def question(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def gsm8k_row(text: str, answer: str, env_class: str = "gsm8k_multi_turn") -> dict:
    """A row in SkyRL's dataset format."""
    spec = {"method": "rule", "ground_truth": answer}
    return {"prompt": question(text), "env_class": env_class, "reward_spec": spec, "extra_info": {"split": "train"}}


def columns(rows: list[dict]) -> dict[str, list]:
    return {key: [row.get(key) for row in rows] for key in rows[0]}


def math_policy(context: str) -> str:
    """Answers 5 first, then 4 (the right answer to every question here but the last, 7)."""
    answered = context.count("<|im_start|>user") - 1
    return ("I think #### 5" if answered == 0 else "So #### 4") + END


def rollout(env, rows, policy, group=2, max_new_tokens=600):
    tokenizer = qwen_tokenizer()
    env.setup(tokenizer)
    return chat_rollout(env, rows, policy, tokenizer, group, max_new_tokens)[0]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


MULTI_TURN_HINT = (
    "Please provide your step-by-step reasoning, and also include a tentative numeric answer at the end in the exact "
    "format: '#### ANSWER'."
)
LAST_TURN_HINT = "Now provide only the final numeric answer in the exact format: '#### ANSWER'."


# ------------------------------------------------------------------------------------------------ gsm8k
def test_gsm8k_multi_turn_trajectories_are_the_templates_rendering_and_earn_its_turn_rewards():
    rows = [gsm8k_row("2+2?", "4"), gsm8k_row("1+3?", "4"), gsm8k_row("3+4?", "7"), gsm8k_row("2*2?", "4", "gsm8k")]
    env = SkyRLGymEnvironment(max_turns=3, max_observation_tokens=200, max_concurrency=3)
    out = rollout(env, columns(rows), math_policy)
    tokenizer = env.tokenizer
    format_score = 0.2 / 3  # gsm8k_multi_turn's per-turn score of a well-formatted wrong answer (max_turns 3)
    assert out.env_rewards["skyrl_gym"] == pytest.approx([format_score + 1.0] * 4 + [3 * format_score] * 2 + [0] * 2)
    assert out.stats["turns"] == [2.0] * 4 + [3.0] * 2 + [1.0] * 2  # gsm8k: one answer, done (its 5 is wrong)
    for i in range(8):
        prompt, ids, observations = parts(out, i)
        text = rows[i // 2]["prompt"][0]["content"]
        assert prompt == ids_of(
            tokenizer, tokenizer.apply_chat_template(question(text), tokenize=False, add_generation_prompt=True)
        )
        # Each step's message: rendered by the template after the turn's end token, tokenized on its own.
        hints = {0: [], 1: [MULTI_TURN_HINT], 2: [MULTI_TURN_HINT, LAST_TURN_HINT]}[len(observations)]
        assert [tokenizer.decode(o) for o in observations] == [
            f"\n<|im_start|>user\n{hint}<|im_end|>\n<|im_start|>assistant\n" for hint in hints
        ]
        # The whole trajectory is the template's rendering of the conversation, token for token.
        conversation = question(text)
        for k in range(int(out.stats["turns"][i])):
            conversation.append({"role": "assistant", "content": "I think #### 5" if k == 0 else "So #### 4"})
            if k < len(hints):
                conversation.append({"role": "user", "content": hints[k]})
        whole = tokenizer.apply_chat_template(conversation, tokenize=False)
        assert prompt + ids == ids_of(tokenizer, whole.removesuffix("\n"))


def test_stepping_three_at_a_time_gives_the_trajectories_of_one_at_a_time():
    rows = columns([{"prompt": question(f"Count {n}."), "count": n} for n in (1, 2, 3, 4)])
    results, most = {}, {}
    for workers in (1, 3):
        STATS["most_in_flight"] = 0
        env = SkyRLGymEnvironment(
            env_id="grpo_test_countdown", max_turns=4, max_observation_tokens=64, max_concurrency=workers
        )
        results[workers] = rollout(env, rows, lambda context: "next" + END)
        most[workers] = STATS["most_in_flight"]
    one, three = results[1], results[3]
    assert most == {1: 1, 3: 3}  # one at a time, then up to (and no more than) max_concurrency at once
    assert torch.equal(one.completions.completion_ids, three.completions.completion_ids)
    assert one.env_rewards == three.env_rewards and one.stats == three.stats and one.transcripts == three.transcripts
    assert three.env_rewards["skyrl_gym"] == pytest.approx([2.0, 2.0, 2.5, 2.5, 3.0, 3.0, 3.5, 3.5])


def test_the_prompt_is_what_init_returned_and_env_config_reaches_the_environment():
    env = SkyRLGymEnvironment(
        env_id="grpo_test_countdown",
        env_config={"grpo_test_countdown": {"greeting": "Say next."}},
        max_turns=2,
        max_observation_tokens=64,
    )
    out = rollout(env, columns([{"prompt": question("Go."), "count": 5}]), lambda context: "next" + END, group=1)
    tokenizer = env.tokenizer
    prompt, ids, observations = parts(out, 0)
    system_first = [{"role": "system", "content": "Say next."}, *question("Go.")]
    assert prompt == ids_of(
        tokenizer, tokenizer.apply_chat_template(system_first, tokenize=False, add_generation_prompt=True)
    )
    assert out.prompts == [system_first]  # what the rewards see as the trajectory's prompt
    assert tokenizer.decode(observations[0]) == "\n<|im_start|>user\n4 left<|im_end|>\n<|im_start|>assistant\n"
    assert out.env_rewards["skyrl_gym"] == [1.0]  # two turns of 0.5: max_turns ends it before the count does
    # Pickled into a background rollout process (data.schedule.rollout_lag): the same settings there.
    copy = pickle.loads(pickle.dumps(env))
    assert copy.configs["grpo_test_countdown"].greeting == "Say next." and copy.env_id == "grpo_test_countdown"


# ------------------------------------------------------------------------------------------------ refusals
def test_rows_an_environment_cannot_start_from_are_refused_before_training():
    from datasets import Dataset

    env = SkyRLGymEnvironment()
    assert env.required_columns() == ("env_class",)
    good = gsm8k_row("2+2?", "4")
    env.check_rows(Dataset.from_list([good, {**good, "env_class": "gsm8k"}]), "data.dataset")
    unknown = Dataset.from_list([good, {**good, "env_class": "chess"}])
    with pytest.raises(ConfigError, match=r"data.dataset row 1: its env_class: 'chess' is not a registered skyrl-gym"):
        env.check_rows(unknown, "data.dataset")
    no_answer = Dataset.from_list([{**good, "reward_spec": {"method": "rule"}}])
    with pytest.raises(
        ConfigError,
        match=r"row 0: the skyrl-gym environment 'gsm8k_multi_turn' cannot start from this row \(AssertionError: "
        r"reward_spec.ground_truth is required\)",
    ):
        env.check_rows(no_answer, "data.dataset")


def test_an_environment_that_raises_is_one_line_naming_it():
    env = SkyRLGymEnvironment(env_id="grpo_test_countdown", max_observation_tokens=64)
    with pytest.raises(RuntimeError) as caught:
        rollout(env, columns([{"prompt": question("Go."), "count": 3}]), lambda context: "boom" + END)
    message = str(caught.value)
    assert message == (
        "data.environment: the skyrl-gym environment 'grpo_test_countdown' failed in step "
        "(ValueError: boom went the environment)"
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"env_id": "chess"}, r"env_id: 'chess' is not a registered skyrl-gym environment; registered: aime, gsm8k"),
        ({"env_config": {"chess": {}}}, "env_config: 'chess' is not a registered"),
        ({"env_config": {"gsm8k": 3}}, r"env_config must map an environment id to its config"),
        ({"imports": ["no_such_module"]}, "imports: cannot import 'no_such_module'"),
        ({"max_concurrency": 0}, "max_concurrency must be an integer >= 1"),
        ({"frame": "xml"}, "frame must be one of auto, chat_template, plain"),
    ],
)
def test_bad_settings_are_one_line_naming_the_field(kwargs, expected):
    with pytest.raises(ConfigError, match=expected) as caught:
        SkyRLGymEnvironment(**kwargs)
    assert "\n" not in str(caught.value)


def test_a_frame_too_long_for_max_observation_tokens_is_refused_at_setup():
    env = SkyRLGymEnvironment(env_id="gsm8k", max_observation_tokens=10)
    with pytest.raises(ConfigError, match=r"max_observation_tokens = 10 cannot hold .* set it to at least 23$"):
        env.setup(qwen_tokenizer())


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    with pytest.raises(ConfigError, match=r'needs skyrl-gym .*pip install -e "\.\[skyrl-gym\]"'):
        SkyRLGymEnvironment(env_id="gsm8k")


# ------------------------------------------------------------------------------------------------ a run, by YAML
def test_a_yaml_config_trains_a_round_against_gsm8k_multi_turn(tmp_path, monkeypatch):
    from helpers import save_tiny_llama

    from grpo_lightning.cli import GRPOCLI
    from grpo_lightning.models.tiny import TinyModelConfig

    monkeypatch.chdir(tmp_path)
    config = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    config.max_position_embeddings = 512
    model = save_tiny_llama(tmp_path / "model", config, qwen_tokenizer())
    rows = [gsm8k_row("2+2?", "4"), gsm8k_row("3+4?", "7")]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "run.yaml").write_text(
        f"""
trainer: {{accelerator: cpu, max_epochs: 1, logger: false, callbacks: [], enable_checkpointing: false,
          enable_progress_bar: false, enable_model_summary: false, limit_val_batches: 0}}
model: {{model_name_or_path: {model}}}
data:
  dataset: rows.jsonl
  val_split: null
  prompts_per_round: 2
  sampling: {{group_size: 2, max_new_tokens: 12}}
  rewards: [{{name: helpers.length_reward}}]
  environment:
    class_path: grpo_lightning.integrations.environments.SkyRLGymEnvironment
    init_args:
      max_turns: 2
      max_observation_tokens: 200
"""
    )
    cli = GRPOCLI(args=["--config", "run.yaml"], run=False)
    assert isinstance(cli.datamodule.environment, SkyRLGymEnvironment)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rollout_batch = cli.datamodule.last_rollout
    assert cli.trainer.global_step >= 1 and len(rollout_batch.prompts) == 4
    assert "env_skyrl_gym" in rollout_batch.reward_columns  # a random model's turns: scored, 0 or its format score
