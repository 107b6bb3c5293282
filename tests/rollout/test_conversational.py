"""Conversational data and held-out rows: prompts that are lists of messages, rendered with a real chat template
(Qwen3's, ``tests/data/chat_templates/qwen3.jinja``, on the character tokenizer with Qwen's special tokens: nothing
is downloaded), through GRPO's ``fit`` and ``validate``, SFT's cold start, multi-turn rollouts and the background
rollout worker; ``system_prompt``, ``chat_template_kwargs`` and the ``auto`` chat template; and a local file that is
never evaluated on the rows it trains on (no validation without a held-out source, or ``val_fraction``'s seeded,
disjoint split).
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from conftest import quiet_trainer
from helpers import attach, save_tiny_llama
from lightning import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from test_multiturn import ScriptedEngine

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError, EvalConfig, ScheduleConfig
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.environments.multiturn import generate_trajectories
from grpo_lightning.integrations.sft import IGNORE_INDEX, SFTDataModule, SFTModule
from grpo_lightning.models.build import load_tokenizer
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout import schedule
from grpo_lightning.rollout.curriculum import CurriculumConfig
from grpo_lightning.rollout.data_sources import PromptSource
from grpo_lightning.rollout.prompts import PromptEncoder, check_prompt_rows

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = (ROOT / "tests" / "data" / "chat_templates" / "qwen3.jinja").read_text()
TINY_ARITH = ROOT / "grpo_lightning" / "assets" / "tiny-arith"
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=256)
NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's generation prompt, enable_thinking: false
RECEIVED: list = []  # the prompts the test reward was given


@register("test_conversation_answer")
def conversation_answer(prompts, completions, answer, **_):
    """1 for the right sum; records the prompts it was given (they must arrive as the dataset holds them)."""
    RECEIVED.extend(prompts)
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(t.strip() == a) for t, a in zip(texts, answer)]


def qwen3_tokenizer():
    """The character tokenizer with Qwen3's special tokens and its chat template (EOS ``<|im_end|>``)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN3
    return tokenizer


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> str:
    """A tiny random Llama with the Qwen3-templated tokenizer, saved as a Hugging Face folder."""
    return save_tiny_llama(tmp_path_factory.mktemp("qwen3-tiny"), SMALL, qwen3_tokenizer())


def conversation(a: int, b: int, system: bool = True) -> list[dict]:
    messages = [{"role": "user", "content": f"{a}+{b}="}]
    return [{"role": "system", "content": "Add the numbers."}, *messages] if system else messages


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def conversational_file(path: Path, count: int = 8, response: bool = False) -> str:
    rows = []
    for i in range(count):
        row = {"prompt": conversation(i, 1), "answer": str(i + 1)}
        rows.append({**row, "response": str(i + 1)} if response else row)
    return write_rows(path, rows)


def plain_file(path: Path, count: int = 20) -> str:
    return write_rows(path, [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(count)])


# ------------------------------------------------------------------------------------------ rendering
def test_a_conversation_is_rendered_by_the_template_with_the_generation_prompt_and_the_kwargs():
    tokenizer = qwen3_tokenizer()
    encoder = PromptEncoder(tokenizer, "auto", chat_template_kwargs={"enable_thinking": False})
    text = encoder.render(conversation(12, 3))
    assert text == ("<|im_start|>system\nAdd the numbers.<|im_end|>\n<|im_start|>user\n12+3=<|im_end|>\n" + NO_THINKING)
    # Without the kwarg, Qwen3 thinks: no empty think block after the generation prompt.
    assert PromptEncoder(tokenizer, True).render(conversation(12, 3)).endswith("<|im_end|>\n<|im_start|>assistant\n")
    # Earlier assistant turns are part of the prompt; the completion is the assistant's next message.
    turns = [*conversation(1, 1), {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2="}]
    assert encoder.render(turns).endswith(
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\nand 2+2=<|im_end|>\n" + NO_THINKING
    )
    # A conversation that ends with the assistant's message is continued (a prefilled answer).
    prefilled = encoder.render([*conversation(1, 1), {"role": "assistant", "content": "The sum is"}])
    assert prefilled.endswith("The sum is")
    # Special tokens are single tokens, and none is added on top of the template's.
    ids = encoder.token_ids([conversation(12, 3)])[0]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text


def test_the_system_prompt_goes_first_where_there_is_none():
    encoder = PromptEncoder(qwen3_tokenizer(), "auto", system_prompt="Be brief.")
    assert encoder.render("1+2=").startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2=")
    assert encoder.render(conversation(1, 2, system=False)).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    own = encoder.render(conversation(1, 2))  # has its own system message: kept, not doubled
    assert own.startswith("<|im_start|>system\nAdd the numbers.<|im_end|>") and "Be brief." not in own


def test_auto_uses_the_chat_template_when_the_tokenizer_has_one_and_false_still_wins():
    assert PromptEncoder(qwen3_tokenizer(), "auto").use_chat_template
    assert PromptEncoder(qwen3_tokenizer(), None).use_chat_template
    assert PromptEncoder(qwen3_tokenizer(), False).texts(["1+2="]) == ["1+2="]
    assert not PromptEncoder(build_char_tokenizer(), "auto").use_chat_template
    # The quickstart's tokenizer has no chat template: its prompts stay as they were.
    quickstart = load_tokenizer(str(TINY_ARITH))
    assert not getattr(quickstart, "chat_template", None)
    assert PromptEncoder(quickstart, "auto").texts(["12+34="]) == ["12+34="]
    # The modules' default is auto.
    assert RolloutDataModule().use_chat_template == "auto"
    assert SFTDataModule(dataset="x.jsonl").use_chat_template == "auto"


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"use_chat_template": True}, r"^data\.use_chat_template is true but the tokenizer has no chat template"),
        ({"system_prompt": "Be brief."}, r"^data\.system_prompt needs a chat template"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, r"^data\.chat_template_kwargs needs a chat template"),
    ],
)
def test_chat_settings_without_a_chat_template_are_refused_in_one_line(settings, match):
    with pytest.raises(ConfigError, match=match):
        PromptEncoder(build_char_tokenizer(), settings.pop("use_chat_template", "auto"), **settings)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"use_chat_template": "yes"}, r"^data\.use_chat_template must be true, false or auto"),
        ({"use_chat_template": False, "system_prompt": "x"}, r"^data\.system_prompt needs .* is false$"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, r"'add_generation_prompt' is set by the"),
        ({"system_prompt": " "}, r"^data\.system_prompt must be a non-empty string"),
        ({"val_fraction": 1.5}, r"^data\.val_fraction must be in \(0, 1\), or null \(got 1\.5\)$"),
        ({"val_fraction": 0.1, "val_dataset": "arithmetic"}, r"^data\.val_fraction holds out training rows"),
        ({"val_fraction": 0.1, "val_split": None}, r"^data\.val_fraction holds out rows for validation"),
    ],
)
def test_bad_data_settings_are_refused_before_anything_is_built(settings, match):
    with pytest.raises(ConfigError, match=match):
        RolloutDataModule(**settings)
    with pytest.raises(ConfigError, match=match):
        SFTDataModule(dataset="x.jsonl", **settings)


def test_conversations_need_a_chat_template_and_bad_rows_are_named():
    rows = {"prompt": [conversation(1, 2)]}
    with pytest.raises(ConfigError, match=r"^data\.prompt_column holds conversations .* data\.use_chat_template"):
        check_prompt_rows(rows, "data.dataset (x.jsonl)", PromptEncoder(build_char_tokenizer(), "auto"))
    encoder = PromptEncoder(qwen3_tokenizer(), "auto")
    bad = {"prompt": [conversation(1, 2), [{"content": "no role"}]]}
    with pytest.raises(ConfigError, match=r"^data\.dataset \(x\.jsonl\) row 1: message 0 of the prompt is"):
        check_prompt_rows(bad, "data.dataset (x.jsonl)", encoder)
    with pytest.raises(ConfigError, match=r"row 0: the prompt is an empty list of messages"):
        check_prompt_rows({"prompt": [[]]}, "data.dataset (x.jsonl)", encoder)
    with pytest.raises(ConfigError, match=r"row 0: the prompt is '  '; every row needs a non-empty prompt"):
        check_prompt_rows({"prompt": ["  "]}, "data.dataset (x.jsonl)", encoder)


# ------------------------------------------------------------------------------------ GRPO fit / validate
def test_fit_and_validate_on_a_conversational_file(tmp_path, qwen3_model):
    RECEIVED.clear()
    module = GRPOModule(model_name_or_path=qwen3_model, objective=ObjectiveConfig(beta=0.0), lr=1e-3)
    data = RolloutDataModule(
        dataset=conversational_file(tmp_path / "chats.jsonl"),
        val_fraction=0.25,
        chat_template_kwargs={"enable_thinking": False},
        rewards=[RewardSpec("test_conversation_answer")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=4),
        prompts_per_round=2,
    )
    trainer = quiet_trainer(tmp_path, max_epochs=2, limit_val_batches=1.0, check_val_every_n_epoch=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2 and "val/accuracy" in trainer.callback_metrics  # trained, then evaluated
    tokenizer = module.tokenizer
    rollout = data.last_rollout
    context = tokenizer.decode(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()])
    assert context.startswith("<|im_start|>system\nAdd the numbers.<|im_end|>") and context.endswith(NO_THINKING)
    # The rewards got the prompts as the dataset holds them: lists of messages.
    assert RECEIVED and all(isinstance(p, list) and p[0]["role"] == "system" for p in RECEIVED)
    assert rollout.prompts[0] in [conversation(i, 1) for i in range(8)]
    # Held-out rows are never trained on.
    train = {json.dumps(p) for p in data.train_data["prompt"]}
    held = {json.dumps(p) for p in data.val_data["prompt"]}
    assert len(train) == 6 and len(held) == 2 and not train & held
    results = trainer.validate(module, datamodule=data, verbose=False)
    assert 0.0 <= results[0]["val/accuracy"] <= 1.0


def test_the_background_worker_renders_prompts_as_the_trainer_does(tmp_path, qwen3_model, monkeypatch):
    module = GRPOModule(model_name_or_path=qwen3_model, objective=ObjectiveConfig(beta=0.0))
    data = RolloutDataModule(
        dataset=conversational_file(tmp_path / "chats.jsonl"),
        val_split=None,
        system_prompt="Be brief.",
        chat_template_kwargs={"enable_thinking": False},
        rewards=[RewardSpec("test_conversation_answer")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=4),
        prompts_per_round=2,
        schedule=ScheduleConfig(rollout_lag=1),
    )
    attach(module, data, quiet_trainer(tmp_path))
    module.configure_model()
    data.setup("fit")
    specs = []
    monkeypatch.setattr(schedule, "RolloutWorker", lambda spec, timeout_s: specs.append(spec))
    data.collector.background._start(data.collector._worker_spec, None)
    sent = pickle.loads(pickle.dumps(specs[0].encoder))  # as the spawned process receives it
    prompts = [conversation(1, 2, system=False), "3+4="]
    assert sent.texts(prompts) == data.encoder().texts(prompts)
    assert sent.render("3+4=").startswith("<|im_start|>system\nBe brief.") and sent.render("3+4=").endswith(NO_THINKING)


def test_the_curriculum_tracks_conversational_prompts(tmp_path, qwen3_model):
    module = GRPOModule(model_name_or_path=qwen3_model, objective=ObjectiveConfig(beta=0.0))
    data = RolloutDataModule(
        dataset=conversational_file(tmp_path / "chats.jsonl"),
        val_split=None,
        curriculum=CurriculumConfig(),
        rewards=[RewardSpec("test_conversation_answer")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=4),
        prompts_per_round=2,
    )
    quiet_trainer(tmp_path, max_epochs=1).fit(module, datamodule=data)
    # Groups are matched to their rows by prompt (a conversation by its JSON text): both got a pass rate.
    assert data.last_rollout.metrics["curriculum/tracked_prompts"] == 2
    assert isinstance(data.last_rollout.prompts[0], list)  # the rollout keeps the prompts as the rows hold them


# ---------------------------------------------------------------------------------------- SFT cold start
def test_sft_cold_start_on_a_conversational_file(tmp_path, qwen3_model):
    module = SFTModule(model_name_or_path=qwen3_model, lr=1e-2)
    data = SFTDataModule(
        dataset=conversational_file(tmp_path / "pairs.jsonl", response=True),
        val_fraction=0.25,
        system_prompt="Be brief.",
        chat_template_kwargs={"enable_thinking": False},
        rewards=[RewardSpec("test_conversation_answer")],
        sampling=SamplingConfig(max_new_tokens=4),
        batch_size=2,
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["train/loss"])
    tokenizer = module.tokenizer
    ids, labels = data.train_examples[0]
    prompt = [i for i, label in zip(ids, labels) if label == IGNORE_INDEX]
    response = [label for label in labels if label != IGNORE_INDEX]
    # The prompt as the rollout renders it (its own system message kept, thinking off), the response + EOS after.
    rendered = tokenizer.decode(prompt)
    assert rendered.startswith("<|im_start|>system\nAdd the numbers.") and rendered.endswith(NO_THINKING)
    assert response[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(response[:-1]) in [str(i + 1) for i in range(8)]
    assert len(data.train_examples) == 6 and len(data.val_data) == 2
    results = trainer.validate(module, datamodule=data, verbose=False)
    assert 0.0 <= results[0]["val/accuracy"] <= 1.0


def test_sft_reads_a_response_given_as_an_assistant_message(tmp_path, qwen3_model):
    rows = [{"prompt": conversation(1, 2), "response": [{"role": "assistant", "content": "3"}]}]
    data = SFTDataModule(dataset=write_rows(tmp_path / "pairs.jsonl", rows), val_split=None)
    attach(SFTModule(model_name_or_path=qwen3_model), data, quiet_trainer(tmp_path))
    data.setup("fit")
    ids, labels = data.train_examples[0]
    assert [label for label in labels if label != IGNORE_INDEX][:-1] == data.encoder().tokenizer.encode("3")


# ------------------------------------------------------------------------------------------ multi-turn
def test_multi_turn_rollouts_render_the_conversation_and_the_tool_frame_with_the_kwargs():
    tokenizer = qwen3_tokenizer()
    kwargs = {"enable_thinking": False}
    env = ToolEnvironment(tools=["calculator"], format="chat_template", max_observation_tokens=128)
    env.chat_template_kwargs = kwargs  # as RolloutDataModule sets it from data.chat_template_kwargs
    env.setup(tokenizer)
    assert env.format.result("408").endswith("</tool_response><|im_end|>\n" + NO_THINKING)

    def policy(context: str) -> str:
        if context.endswith("</tool_response><|im_end|>\n" + NO_THINKING):
            return "408<|im_end|>"
        return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'

    engine = ScriptedEngine(tokenizer, policy)
    engine.eos_token_ids = (tokenizer.eos_token_id,)
    encoder = PromptEncoder(tokenizer, "auto", chat_template_kwargs=kwargs)
    prompt = conversation(12, 34)
    out = generate_trajectories(
        {"prompt": [prompt]},
        engine=engine,
        encoder=encoder,
        environment=env,
        params=SamplingParams(group_size=1, max_new_tokens=300),
    )
    assert tokenizer.decode(engine.contexts[0]) == encoder.render(prompt)  # the first turn: the prompt, rendered
    assert tokenizer.decode(engine.contexts[1]).endswith(NO_THINKING)  # the second: after the tool's frame
    assert out.final_texts == ["408"]


# ----------------------------------------------------------------------------------- held-out rows
def test_a_local_file_without_a_held_out_source_is_never_evaluated_on_its_training_rows(tmp_path, caplog):
    path = plain_file(tmp_path / "rows.jsonl")
    for data, module in (
        (RolloutDataModule(dataset=path), GRPOModule(tiny_model=SMALL)),
        (SFTDataModule(dataset=path, response_column="answer"), SFTModule(tiny_model=SMALL)),
    ):
        trainer = quiet_trainer(tmp_path)
        attach(module, data, trainer)
        with caplog.at_level(logging.WARNING, logger="grpo_lightning.rollout.data_sources"):
            data.setup("fit")
        assert data.val_data is None
        assert "no validation (set data.val_fraction: 0.1" in caplog.text
        assert data.val_dataloader() == []  # fit goes on without validation
        trainer.state.fn = TrainerFn.VALIDATING
        with pytest.raises(ConfigError, match=r"^no held-out data: .* set data\.val_fraction \(e\.g\. 0\.1\)"):
            data.val_dataloader()
        caplog.clear()


def test_val_fraction_holds_out_seeded_rows_that_are_not_trained_on(tmp_path):
    path = plain_file(tmp_path / "rows.jsonl")

    def split(seed: int) -> tuple[list[str], list[str]]:
        source = PromptSource(path, val_fraction=0.25, seed=seed)
        held, where = source.held_out()
        assert "data.val_fraction 0.25" in where
        return list(source.training_rows()["prompt"]), list(held["prompt"])

    train, held = split(seed=3)
    assert len(held) == 5 and len(train) == 15
    assert not set(train) & set(held) and sorted(train + held) == sorted(f"{i}+2=" for i in range(20))
    assert split(seed=3) == (train, held)  # reproducible
    assert split(seed=4)[1] != held  # another seed, another split
    # The data module trains on the rest only, and evaluates (val_limit: the first rows) on the held-out ones.
    data = RolloutDataModule(dataset=path, val_fraction=0.25, seed=3, eval=EvalConfig(limit=2))
    attach(GRPOModule(tiny_model=SMALL), data, quiet_trainer(tmp_path))
    data.setup("fit")
    assert list(data.train_data["prompt"]) == train and list(data.val_data["prompt"]) == held[:2]
    with pytest.raises(ConfigError, match=r"^data\.val_fraction = 0\.5 of 1 rows leaves no row to train on"):
        PromptSource(write_rows(tmp_path / "one.jsonl", [{"prompt": "1+1="}]), val_fraction=0.5).training_rows()


def test_built_in_tasks_keep_their_own_test_split():
    source = PromptSource("arithmetic", task_kwargs={"test_size": 10})
    held, where = source.held_out()
    assert where == "validation data (arithmetic, split test)" and len(held) == 10
    assert not set(held["prompt"]) & set(source.training_rows()["prompt"])
