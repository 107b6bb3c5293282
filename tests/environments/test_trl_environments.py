"""TRL's environment classes (``environment_factory``) through ``TRLEnvironment``, with TRL 1.16 itself as the
reference: its ``GRPOTrainer``, built on a tiny model, gives the tools it derives from a class, the prompt it renders
for a row and the frame it appends after a tool call, for the same Qwen-style tokenizer (the real Qwen2.5 template,
``tests/data/chat_templates``). A scripted policy calls the tools: the observations, the trajectory token for token
as the template writes the whole conversation, ``get_reward`` as a reward part, a per-row choice between two
classes, and failing calls answered with ``error: ...``. The refusals and a run by YAML:
``test_trl_environment_checks.py``.
"""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from test_chat_formats import qwen_tokenizer
from test_multiturn import ScriptedEngine, chat_rollout, parts

from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.integrations.environments import TRLEnvironment
from grpo_lightning.models.tiny import TinyModelConfig, build_tiny_llama
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.sample_and_score import sample_and_score

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl (a dev dependency) is not installed")

CALLS: list[tuple] = []  # every tool call the instances ran, with its arguments as the method got them
RESETS: list[dict] = []  # every reset's keyword arguments
INSTANCES: list[object] = []  # every instance made


class WeatherEnv:
    """Two tools with typed arguments, several each; rewarded for asking about the row's city."""

    def __init__(self) -> None:
        INSTANCES.append(self)
        self.asked: list[str] = []

    def reset(self, **row) -> str | None:
        RESETS.append(dict(row))
        self.city = row.get("city")
        return f" (You are in {self.city}.)" if self.city else None

    def forecast(self, city: str, days: int = 1) -> str:
        """The weather forecast for a city.

        Args:
            city: The city's name.
            days: How many days ahead.
        """
        CALLS.append(("forecast", city, days))
        if days < 1:
            raise ValueError("days must be at least 1")
        self.asked.append(city)
        return f"{city}: sunny for {days} days"

    def convert(self, celsius: float, unit: str = "F") -> float:
        """Converts a temperature.

        Args:
            celsius: The temperature in degrees Celsius.
            unit: The unit to convert to (choices: ["F", "K"]).
        """
        CALLS.append(("convert", celsius, unit))
        return celsius + 273.15 if unit == "K" else celsius * 9 / 5 + 32

    def get_reward(self) -> float:
        return float(self.city in self.asked)

    def _private(self) -> None:  # not a tool
        raise AssertionError("never called")


class MathEnv:
    """One tool, no reward of its own."""

    def reset(self, **row) -> None:
        RESETS.append(dict(row))

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        CALLS.append(("add", a, b))
        return a + b


class NoReset:
    def ask(self, question: str) -> str:
        """Asks.

        Args:
            question: The question.
        """
        return question


class Undocumented:
    def reset(self, **row) -> None:
        return None

    def lookup(self, key):
        return key


RECEIVED: list = []  # the prompts the test reward was given


def answer_length(prompts, completions, **_) -> list[float]:
    """The final answer's length (a conversational prompt's completion is one assistant message)."""
    RECEIVED.extend(prompts)
    return [float(len(c[-1]["content"])) for c in completions]


def cities_asked(environments) -> list[float]:
    """A TRL-style reward reading the trajectories' instances: how many forecasts each asked for."""
    return [float(len(env.asked)) for env in environments]


WEATHER, MATH = f"{__name__}:WeatherEnv", f"{__name__}:MathEnv"
QUESTION = [{"role": "user", "content": "What is the weather?"}]


def call(name: str, arguments: dict) -> str:
    """A tool call as the Qwen2.5 template writes one (and a model trained on it): what the scripted policy says."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def tool_call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TINY = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
FORECAST, CONVERT = {"city": "Paris", "days": "3"}, {"celsius": "25", "unit": "K"}  # strings for typed parameters


def weather_policy(context: str) -> str:
    """Asks for Paris' forecast, converts 25 °C to kelvin, then answers (babbling past each call: cut there)."""
    answered = context.count("<tool_response>")
    if answered == 0:
        return call("forecast", FORECAST) + "babble"
    if answered == 1:
        return call("convert", CONVERT) + "more babble"
    return "Sunny, 298.15 K.<|im_end|>"


def math_policy(context: str) -> str:
    if "<tool_response>" not in context:
        return call("add", {"a": 2, "b": "40"})
    return "42<|im_end|>"


def set_up(factory, tokenizer=None, **kwargs) -> TRLEnvironment:
    env = TRLEnvironment(factory=factory, **kwargs)
    env.setup(tokenizer or qwen_tokenizer())
    return env


def rollout(env, rows, policy, group=2, max_new_tokens=400):
    return chat_rollout(env, rows, policy, env.tokenizer, group, max_new_tokens)


# ------------------------------------------------------------------------------------------ TRL, the reference
@pytest.fixture(scope="module")
def trl(tmp_path_factory):
    """TRL's GRPOTrainer for one class and for two chosen per row, on a tiny model and the Qwen-style tokenizer."""
    tokenizer = qwen_tokenizer()
    model = build_tiny_llama(TINY, tokenizer)
    args = trl_grpo.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        use_cpu=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        report_to=[],
    )
    data = Dataset.from_list([{"prompt": QUESTION, "city": "Paris", "environment": "weather"}])

    def trainer(factory):
        return trl_grpo.GRPOTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer, environment_factory=factory
        )

    return {"one": trainer(WeatherEnv), "two": trainer({"weather": WeatherEnv, "math": MathEnv})}


def trl_prompt_ids(trainer, row: dict, name: str | None = None) -> list[int]:
    """TRL's prompt for ``row``: reset's text appended to the last message (as ``_generate_and_score_completions``
    does), rendered with the row's environment's tools by its own ``_tokenize_prompts``."""
    kwargs = {k: v for k, v in row.items() if k != "environment"} if trainer._multi_environment else row
    observation = trainer.environment_factories[name]().reset(**kwargs)
    prompt = row["prompt"]
    if observation is not None:
        prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
    trainer._batch_environments = [name]
    return list(trainer._tokenize_prompts([prompt])[0][0])


def test_the_tools_are_the_schemas_trl_derives_from_the_same_class(trl):
    from transformers.utils import get_json_schema

    one = TRLEnvironment(factory=WEATHER)
    assert one.classes[None].schemas == [get_json_schema(tool) for tool in trl["one"]._env_tools[None]]
    assert [s["function"]["name"] for s in one.classes[None].schemas] == ["convert", "forecast"]  # TRL's order
    forecast = one.classes[None].schemas[1]["function"]["parameters"]
    assert forecast["properties"]["days"]["type"] == "integer" and forecast["required"] == ["city"]
    two = TRLEnvironment(factory={"weather": WEATHER, "math": MATH})
    for name in ("weather", "math"):
        assert two.classes[name].schemas == [get_json_schema(tool) for tool in trl["two"]._env_tools[name]]
    assert two.required_columns() == ("environment",) and one.required_columns() == ()


def test_a_scripted_policy_calls_both_tools_token_for_token_as_trl_frames_them(trl):
    CALLS.clear()
    env = set_up(WEATHER)
    tokenizer, eos = env.tokenizer, env.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = {"prompt": [QUESTION, QUESTION], "city": ["Paris", "Oslo"]}
    out, engine = rollout(env, rows, weather_policy)
    # Each method got the call's arguments by name, typed by its schema ("3" → 3, "25" → 25), as TRL's parser types
    # them; the return value (a float) is the tool message's text.
    assert CALLS == [("forecast", "Paris", 3)] * 4 + [("convert", 25, "K")] * 4  # turn by turn
    assert [out.transcripts[i].count("<tool_response>") for i in range(4)] == [2] * 4
    prompt, ids, observations = parts(out, 0)
    texts = [tokenizer.decode(o) for o in observations]
    assert "\nParis: sunny for 3 days\n" in texts[0] and "\n298.15\n" in texts[1]
    # The prompt is TRL's for the row (tools listed, reset's text in the user message), token for token.
    assert prompt == trl_prompt_ids(trl["one"], {"prompt": QUESTION, "city": "Paris"})
    assert parts(out, 2)[0] == trl_prompt_ids(trl["one"], {"prompt": QUESTION, "city": "Oslo"})
    # Each observation is TRL's tool suffix after the turn's end token (our turn stops at </tool_call>; TRL's model
    # ends it with <|im_end|>, which the observation holds here).
    results = [("forecast", "Paris: sunny for 3 days"), ("convert", "298.15")]
    for observation, (name, content) in zip(observations, results):
        suffix = trl["one"]._get_tool_suffix_ids([{"role": "tool", "name": name, "content": content}])
        assert observation == [eos, *suffix]
    # The whole trajectory is the template's rendering of the conversation: no re-tokenization drift.
    conversation = [
        {"role": "user", "content": QUESTION[0]["content"] + " (You are in Paris.)"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("forecast", FORECAST)]},
        {"role": "tool", "name": "forecast", "content": "Paris: sunny for 3 days"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("convert", CONVERT)]},
        {"role": "tool", "name": "convert", "content": "298.15"},
        {"role": "assistant", "content": "Sunny, 298.15 K."},
    ]
    whole = tokenizer.apply_chat_template(conversation, tools=env.classes[None].schemas, tokenize=False)
    assert prompt + ids == tokenizer(whole.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    # Each later turn was sampled from the trajectory's own tokens so far, not from re-rendered text.
    action = out.action_mask[0, : len(ids)].tolist()
    turn_starts = [k for k in range(1, len(ids)) if action[k] and not action[k - 1]]
    assert len(turn_starts) == 2 and all(prompt + ids[:k] in engine.contexts for k in turn_starts)
    # get_reward, asked once at each trajectory's end: asked about Paris, so 1 for the Paris row, 0 for Oslo's.
    assert out.env_rewards == {"WeatherEnv": [1.0, 1.0, 0.0, 0.0]}
    assert out.stats["tool_calls"] == [2.0] * 4 and out.stats["tool_errors"] == [0.0] * 4


def test_trl_parses_the_policys_turn_into_the_same_typed_call(trl):
    from trl.chat_template_utils import parse_response

    trainer = trl["one"]
    tokenizer = trainer.processing_class
    turn = tokenizer(call("forecast", FORECAST) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    prompt = trl_prompt_ids(trainer, {"prompt": QUESTION, "city": "Paris"})
    parsed = parse_response(tokenizer, turn, prefix=prompt, tools=trainer._env_tools[None])
    assert parsed["tool_calls"][0]["function"] == {"name": "forecast", "arguments": {"city": "Paris", "days": 3}}
    CALLS.clear()
    env = set_up(WEATHER).spawn()
    env.reset({"prompt": QUESTION, "city": "Paris"})
    env.step(call("forecast", FORECAST))
    assert CALLS == [("forecast", "Paris", 3)]  # the same arguments TRL would call forecast with


def test_get_reward_joins_the_reward_functions_which_get_the_instances_as_in_trl():
    env = set_up(WEATHER)
    tokenizer = env.tokenizer
    engine = ScriptedEngine(tokenizer, weather_policy, honour_stops=True)
    engine.eos_token_ids = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    batch = sample_and_score(
        {"prompt": [QUESTION, QUESTION], "city": ["Paris", "Oslo"]},
        engine=engine,
        encoder=PromptEncoder(tokenizer, use_chat_template=True),
        scorer=Scorer([RewardSpec(f"{__name__}.answer_length", weight=0.5), RewardSpec(f"{__name__}.cities_asked")]),
        params=SamplingParams(group_size=2, max_new_tokens=400),
        environment=env,
    )
    length = 0.5 * len("Sunny, 298.15 K.")
    # The rewards see each trajectory's prompt as TRL's do: reset's text in its last message.
    cities = ("Paris", "Paris", "Oslo", "Oslo")
    assert [p[-1]["content"] for p in RECEIVED[-4:]] == [f"What is the weather? (You are in {c}.)" for c in cities]
    assert batch.reward_columns["env_WeatherEnv"] == [1.0, 1.0, 0.0, 0.0]
    assert batch.reward_columns[f"{__name__}.cities_asked"] == [1.0] * 4  # each instance asked once
    assert batch.rewards.tolist() == [length + 2.0, length + 2.0, length + 1.0, length + 1.0]


def test_a_row_chooses_its_class_and_its_prompt_lists_that_class_tools_only(trl):
    for record in (CALLS, RESETS, INSTANCES):
        record.clear()
    env = set_up({"weather": WEATHER, "math": MATH})
    rows = {"prompt": [QUESTION, [{"role": "user", "content": "2+40?"}]], "environment": ["weather", "math"]}
    rows["city"] = ["Paris", None]
    out, _ = rollout(env, rows, lambda c: math_policy(c) if "2+40?" in c else weather_policy(c))
    assert CALLS == [("forecast", "Paris", 3)] * 2 + [("add", 2, 40)] * 2 + [("convert", 25, "K")] * 2
    assert len(INSTANCES) == 2  # one fresh instance per trajectory of the weather row (MathEnv's are not recorded)
    # reset got the row without the column that chose the class, as TRL gives it
    assert RESETS == [{"prompt": QUESTION, "city": "Paris"}] * 2 + [{"prompt": rows["prompt"][1], "city": None}] * 2
    for i, row in enumerate(({"prompt": QUESTION, "city": "Paris"}, {"prompt": rows["prompt"][1], "city": None})):
        name = rows["environment"][i]
        assert parts(out, 2 * i)[0] == trl_prompt_ids(trl["two"], {**row, "environment": name}, name)
    tokenizer = env.tokenizer
    weather_prompt, math_prompt = tokenizer.decode(parts(out, 0)[0]), tokenizer.decode(parts(out, 2)[0])
    assert '"name": "forecast"' in weather_prompt and '"name": "add"' not in weather_prompt
    assert '"name": "add"' in math_prompt and '"name": "forecast"' not in math_prompt
    assert "\n42\n" in tokenizer.decode(parts(out, 2)[2][0])
    assert out.env_rewards == {"WeatherEnv": [1.0, 1.0, None, None]}  # MathEnv has no get_reward: None, as in TRL


def test_a_failing_call_is_an_error_observation_never_a_crash():
    env = set_up(WEATHER).spawn()
    env.reset({"prompt": QUESTION, "city": "Paris"})
    cases = {
        call("forecast", {"city": "Paris", "days": 0}): "error: days must be at least 1",
        call("forecast", {"days": 2}): "error: WeatherEnv.forecast() missing 1 required positional argument: 'city'",
        call("weather", {"city": "Paris"}): "error: unknown tool 'weather'; tools: convert, forecast",
        call("_private", {}): "error: unknown tool '_private'",
        '<tool_call>\n{"name": "forecast", "arguments": [1]}\n</tool_call>': "error: the arguments must be a JSON",
        "<tool_call>\nnot json\n</tool_call>": 'error: a call is {"name": ..., "arguments": ...} in JSON',
    }
    for turn, expected in cases.items():
        step = env.step(turn)
        assert expected in step.observation and step.metrics["tool_errors"] == 1.0 and not step.done, turn
    assert env.step("It is sunny.").done  # no call: the final answer
    assert env.final_rewards() == {"WeatherEnv": 0.0}  # nothing about Paris was answered
