"""Format, overlong, countdown and model-based rewards; errors and time limits of ``score``; the docs example."""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_lightning.rewards import RewardError, RewardSpec, available, get, register, score
from grpo_lightning.rewards.combine import TimeLimitExceeded, time_limit
from grpo_lightning.rewards.format import overlong_penalty, r1_format, r1_format_ok, soft_overlong
from grpo_lightning.tasks import load_task
from grpo_lightning.tasks.countdown import countdown_reward, evaluate_expression

REWARDS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def test_builtin_names() -> None:
    names = {"math_accuracy", "format", "overlong_penalty", "code_execution", "reward_model", "llm_judge", "countdown"}
    assert names <= set(available())
    for name in names:
        assert get(name).__doc__, f"{name} has no docstring"


# ------------------------------------------------------------------------------------------------- format
def test_r1_format_strict_and_lenient() -> None:
    good = "<think>\n2 + 2 is 4\n</think>\n<answer>\n4\n</answer>"
    assert r1_format_ok(good) and r1_format_ok("<think>a</think><answer>4</answer>")
    assert not r1_format_ok("Sure! " + good)  # text before the layout
    assert r1_format_ok("Sure! " + good + " Bye", mode="lenient")
    assert not r1_format_ok(good + "<answer>5</answer>")  # a tag twice
    assert not r1_format_ok("<think></think><answer>4</answer>", mode="lenient")  # empty think
    assert not r1_format_ok("<answer>4</answer><think>a</think>", mode="lenient")  # wrong order
    assert r1_format_ok("2 + 2 is 4</think><answer>4</answer>", think_in_prompt=True)
    assert r1_format([""] * 2, [good, "4"], reward=0.5) == [0.5, 0.0]
    with pytest.raises(ValueError):
        r1_format_ok(good, mode="loose")


def test_soft_overlong_values() -> None:
    assert soft_overlong(80, 100, 20) == 0.0
    assert soft_overlong(90, 100, 20, penalty=2.0) == pytest.approx(-1.0)
    assert soft_overlong(100, 100, 20) == -1.0 and soft_overlong(150, 100, 20) == -1.0
    assert soft_overlong(101, 100, 0) == -1.0 and soft_overlong(100, 100, 0) == 0.0
    with pytest.raises(ValueError):
        soft_overlong(1, 10, 20)


def test_overlong_penalty_length_sources(tmp_path: Path) -> None:
    from grpo_lightning.models.tiny import build_char_tokenizer

    completions = ["a" * 5, "b" * 15, "c" * 30]
    assert overlong_penalty([""] * 3, completions, max_length=20, buffer=10) == [0.0, -0.5, -1.0]  # characters
    tokens = overlong_penalty([""] * 3, completions, max_length=20, buffer=10, completion_lengths=[30, 15, 5])
    assert tokens == [-1.0, -0.5, 0.0]
    build_char_tokenizer().save_pretrained(tmp_path)  # one token per character
    assert overlong_penalty([""] * 3, completions, max_length=20, buffer=10, tokenizer=str(tmp_path)) == [
        0.0,
        -0.5,
        -1.0,
    ]


# ---------------------------------------------------------------------------------------------- countdown
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(3 + 5) * 2", 16),
        ("10 / 4", 2.5),
        ("((1))", 1),
        ("7 - 9", -2),
        ("1 / 0", None),
        ("-3 + 5", None),
        ("2 ** 3", None),
        ("2.5 * 2", None),
        ("__import__('os')", None),
        ("abs(3)", None),
        ("3 +", None),
        ("x + 1", None),
        ("True + 1", None),
        ("9" * 300, None),
    ],
)
def test_countdown_evaluator(expression: str, value: float | None) -> None:
    result = evaluate_expression(expression)
    assert (result is None) if value is None else float(result[0]) == value


def test_countdown_reward() -> None:
    numbers = [[3, 5, 2, 7]] * 6
    completions = [
        "<think>..</think><answer>(3 + 5) * 2</answer>",  # 16, numbers at most once
        "<answer>(3 + 5) * 2 = 16</answer>",
        "<answer>(3 + 3) * 2 + 4</answer>",  # 3 twice, 4 not given
        "<answer>3 * 5</answer>",  # 15: wrong value
        "no answer",
        "<answer>(7 - 5) * (3 + 5)</answer>",  # 5 twice
    ]
    assert countdown_reward([""] * 6, completions, numbers=numbers, answer=["16"] * 6, format_score=0.1) == [
        1.0,
        1.0,
        0.1,
        0.1,
        0.0,
        0.1,
    ]
    once = ["<answer>(3 + 5) * 2</answer>", "<answer>7 * 2 + 5 - 3</answer>"]  # 7 unused / all four once
    assert countdown_reward([""] * 2, once, numbers=numbers[:2], answer=["16", "16"], use_all=True) == [0.0, 1.0]
    assert countdown_reward(
        [""], ["<answer>(7 + 3) * 2 - 5 + 1</answer>"], numbers=[[7, 3, 2, 5, 1]], target=[16], use_all=True
    ) == [1.0]


def test_countdown_task_is_solvable_and_split() -> None:
    data = load_task("countdown", train_size=300, test_size=50, seed=7)
    assert (len(data["train"]), len(data["test"])) == (300, 50)
    train_keys = {(tuple(sorted(r["numbers"])), r["target"]) for r in data["train"]}
    assert not any((tuple(sorted(r["numbers"])), r["target"]) in train_keys for r in data["test"])
    rows = data["test"]
    solved = countdown_reward(
        rows["prompt"],
        [f"<answer>{s}</answer>" for s in rows["solution"]],
        numbers=rows["numbers"],
        answer=rows["answer"],
        target=rows["target"],
        use_all=True,
    )
    assert solved == [1.0] * 50 and "<answer>" in rows[0]["prompt"]
    assert load_task("countdown", train_size=300, test_size=50, seed=7)["test"]["prompt"] == rows["prompt"]  # seeded


# ------------------------------------------------------------------------------------------------- score
def _bad_count(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [1.0]


def _nan(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [math.nan] * len(completions)


def _raises(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    raise KeyError("answer")


def _spin(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Never returns on a completion that says so; swallows ordinary exceptions on the way."""
    for completion in completions:
        while "spin" in completion:
            try:
                time.sleep(0.01)
            except Exception:
                pass
    return [1.0] * len(completions)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_bad_count, r"returned 1 values for 3 completions"),
        (_nan, r"returned nan for completion 0"),
        (_raises, r"raised KeyError"),
    ],
)
def test_errors_name_the_function_on_one_line(fn: object, message: str) -> None:
    spec = RewardSpec("my_reward")
    with pytest.raises(RewardError, match=message) as info:
        score([spec], [fn], ["p"] * 3, ["a", "b", "c"], {})
    assert "'my_reward'" in str(info.value) and "\n" not in str(info.value)
    total, per_function = score([spec], [fn], ["p"] * 3, ["a", "b", "c"], {}, on_error="zero")
    assert total == [0.0] * 3 and per_function["my_reward"] == [0.0] * 3


def test_timeout_names_function_and_completion() -> None:
    spec = RewardSpec("spinner", weight=2.0)
    with pytest.raises(RewardError, match=r"'spinner' ran longer than timeout_s=0.2s") as info:
        score([spec], [_spin], ["p"] * 3, ["ok", "spin forever", "ok"], {}, timeout_s=0.2)
    # _spin never returns on "spin forever": that score() returned at all shows each call, probes included, was
    # stopped by the limit; the message shows the probing found the culprit.
    assert "completion 1 alone ('spin forever')" in str(info.value)
    total, _ = score([spec], [_spin], ["p"] * 2, ["ok", "spin"], {}, timeout_s=0.2, on_error="zero")
    assert total == [0.0, 0.0]
    assert score([spec], [_spin], ["p"], ["ok"], {}, timeout_s=0.2)[0] == [2.0]


def test_timeout_off_the_main_thread() -> None:
    """Off the main thread the call is abandoned at its limit: score() reports it while the function still runs."""
    release = threading.Event()
    finished: list[bool] = []

    def sleepy(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        release.wait(60)  # until the test lets it go: only the time limit can end the call before that
        finished.append(True)
        return [1.0] * len(completions)

    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            score([RewardSpec("sleepy")], [sleepy], ["p"], ["c"], {}, timeout_s=0.2)
        except BaseException as err:
            outcome["error"] = err
        outcome["calls_finished"] = len(finished)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    release.set()  # lets the abandoned calls end
    assert not worker.is_alive()
    assert isinstance(outcome["error"], RewardError) and "'sleepy' ran longer" in str(outcome["error"])
    assert outcome["calls_finished"] == 0  # score() did not wait for the function


def test_time_limits_nest() -> None:
    with pytest.raises(TimeLimitExceeded) as info:
        with time_limit(0.2) as outer:
            with time_limit(5.0) as inner:  # the outer one ends first: the inner sets no timer
                assert inner is None
                while True:
                    time.sleep(0.01)
    assert info.value.token is outer
    with time_limit(1.0) as outer, time_limit(0.1) as inner:  # inner expires, outer is re-armed afterwards
        with pytest.raises(TimeLimitExceeded) as info:
            while True:
                time.sleep(0.01)
        assert info.value.token is inner is not outer


# ------------------------------------------------------------------------------------------- model-based
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from grpo_lightning.models.tiny import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        num_labels=1,
    )
    paths = {}
    for kind, cls in (("classifier", LlamaForSequenceClassification), ("causal", LlamaForCausalLM)):
        path = tmp_path_factory.mktemp(kind)
        cls(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[kind] = str(path)
    return paths


PROMPTS = ["What is 2+2?", "Name a color.", "Say hi", "7*6="]
COMPLETIONS = ["4", "Blue, of course.", "hi there, how are you doing today?", "42"]


def test_reward_model_batched_deterministic_frozen(tiny_models: dict[str, str]) -> None:
    from grpo_lightning.rewards.model import _load, reward_model

    path = tiny_models["classifier"]
    one = reward_model(PROMPTS, COMPLETIONS, model_name_or_path=path, batch_size=1)
    three = reward_model(PROMPTS, COMPLETIONS, model_name_or_path=path, batch_size=3)
    assert len(one) == 4 and all(isinstance(v, float) and math.isfinite(v) for v in one)
    assert three == pytest.approx(one, abs=1e-4) and len(set(one)) > 1
    sig = reward_model(PROMPTS, COMPLETIONS, model_name_or_path=path, normalize="sigmoid")
    assert sig == pytest.approx([1 / (1 + math.exp(-v)) for v in one], abs=1e-4)
    model, _ = _load("classifier", path, "cpu", None)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert _load.cache_info().currsize >= 1 and _load("classifier", path, "cpu", None)[0] is model  # loaded once


def test_a_half_copied_reward_model_folder_is_named_in_one_line(tiny_models: dict[str, str], tmp_path) -> None:
    import shutil

    from grpo_lightning.config import ConfigError
    from grpo_lightning.rewards.model import reward_model

    folder = tmp_path / "copied"
    shutil.copytree(tiny_models["classifier"], folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"^data.rewards: the classifier folder .* has no weights"):
        reward_model(PROMPTS, COMPLETIONS, model_name_or_path=str(folder))


def test_llm_judge_expected_and_generate(tiny_models: dict[str, str]) -> None:
    from grpo_lightning.rewards.model import llm_judge

    path = tiny_models["causal"]
    expected = llm_judge(PROMPTS, COMPLETIONS, model_name_or_path=path, batch_size=3, scale=(1, 5))
    again = llm_judge(PROMPTS, COMPLETIONS, model_name_or_path=path, batch_size=1, scale=(1, 5))
    assert len(expected) == 4 and all(0.0 <= v <= 1.0 for v in expected) and again == pytest.approx(expected, abs=1e-4)
    generated = llm_judge(
        PROMPTS,
        COMPLETIONS,
        model_name_or_path=path,
        method="generate",
        max_new_tokens=3,
        unparsable=None,
        answer=["4", "blue", "hi", "42"],
    )
    assert len(generated) == 4 and all(v is None or 0.0 <= v <= 1.0 for v in generated)
    with pytest.raises(ValueError, match="single-digit"):
        llm_judge(PROMPTS, COMPLETIONS, model_name_or_path=path, scale=(0, 10))


def test_chat_template_is_used_when_present() -> None:
    from grpo_lightning.models.tiny import build_char_tokenizer
    from grpo_lightning.rewards.model import _chat

    tokenizer = build_char_tokenizer()
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert _chat(tokenizer, messages, "QA", False) == "QA"
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert _chat(tokenizer, messages, "QA", False) == "[user]Q[assistant]A"


# ------------------------------------------------------------------------------------------------- docs
def test_docs_example_runs() -> None:
    section = REWARDS_PAGE.read_text().split("## Writing your own", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert 8 <= len(block.strip().splitlines()) <= 15
    namespace: dict[str, object] = {}
    exec(compile(block, str(REWARDS_PAGE), "exec"), namespace)  # registers "mentions_answer"
    fn = get("mentions_answer")
    assert fn is namespace["mentions_answer"] and fn.required_columns == ("answer",)
    total, per_function = score(
        [RewardSpec("mentions_answer", weight=0.5)],
        [fn],
        ["p"] * 3,
        ["it is 42", "it is 41", "?"],
        {"answer": ["42", "42", None]},
    )
    assert total == [0.5, 0.0, 0.0] and per_function["mentions_answer"] == [1.0, 0.0, None]


def test_register_refuses_a_second_function_under_a_taken_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register("format")(lambda prompts, completions, **_: [0.0] * len(completions))
