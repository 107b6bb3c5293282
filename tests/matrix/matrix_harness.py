"""One tiny round of a matrix case (``matrix_cases.Case``) through the real ``RolloutDataModule`` / ``GRPOModule``
and a Lightning ``Trainer``, and the invariants the project promises of every supported case.

What a case needs to run is built here, once per process (``Models``): a tiny model of each modality (a 2-layer
Llama with a Qwen-style chat template; the tiny Qwen2-VL), a tiny reward model, a prompt file each. A kind needs a
small instance (``KIND_FACTORIES``, by class name); a signal is the data's rewards and the model's teacher
(``signal_settings``). Nothing here decides whether a case is supported: ``run_case`` runs it, and the package's
checks before training refuse it or let it train.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from conftest import quiet_trainer
from helpers import save_tiny_reward_model
from lightning import Callback

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError, ScheduleConfig, UpdateConfig
from grpo_lightning.distillation import TeacherConfig
from grpo_lightning.engines import RolloutEngine, SamplingParams, build_engine, engine_class
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.tiny import TinyModelConfig, build_tiny_llama
from grpo_lightning.rewards import RewardSpec, register

# 2 layers; a head size vLLM's CPU attention has kernels for (32), so that the vLLM tier runs the same model.
MATRIX_TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=1024
)
ATOL = 1e-5  # float32 on the policy's own weights
ROUND = {"prompts_per_round": 2, "group_size": 2, "max_new_tokens": 4}
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    # vLLM on CPU: a small KV cache and a context that fits the tiny model (tests/engines/test_vllm.py).
    "vllm": {"max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20},
}


# ------------------------------------------------------------------------------------------------ signals
def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


@register("matrix_every_other")
def every_other(prompts, completions, **_):
    """The length of every other completion of a call; None (not applicable) for the rest."""
    return [float(len(_text(c))) if j % 2 == 0 else None for j, c in enumerate(completions)]


@register("matrix_every_fourth")
def every_fourth(prompts, completions, **_):
    """A checksum of every fourth completion of a call; None for the rest: rows 1 and 3 of every four no function
    scores (unscorable), rows 2 one function alone does."""
    return [float(sum(map(ord, _text(c))) % 5) if j % 4 == 0 else None for j, c in enumerate(completions)]


def signal_settings(signal: str, models: Models) -> tuple[list[RewardSpec], TeacherConfig | None]:
    """``data.rewards`` and ``model.teacher`` of a signal."""
    if signal == "reward_functions":
        return [RewardSpec("matrix_every_other"), RewardSpec("matrix_every_fourth", weight=0.5)], None
    if signal == "kind_reward":
        return [], None
    if signal == "reward_model":
        return [RewardSpec("reward_model", kwargs={"model_name_or_path": models.reward_model})], None
    if signal == "teacher":
        return [], TeacherConfig(model_name_or_path=models.model)  # the student's own architecture and tokenizer
    raise ValueError(f"no signal {signal!r}")


# -------------------------------------------------------------------------------------------------- kinds
class MatrixCounter:
    """A TRL ``environment_factory`` class: one tool, and a reward of its own."""

    def reset(self, **row) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def matrix_agent(base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
    """An agent making one call through the run's gateway; its return is the answer's length, None when odd."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
    text = client.completions.create(model="policy", prompt=prompt, max_tokens=ROUND["max_new_tokens"]).choices[0].text
    return float(len(text)) if len(text) % 2 == 0 else None


def _tool_environment():
    from grpo_lightning.integrations.environments import ToolEnvironment

    return ToolEnvironment(tools=["calculator"], format="tag")


def _trl_environment():
    from grpo_lightning.integrations.environments import TRLEnvironment

    return TRLEnvironment(factory=f"{__name__}:MatrixCounter")


def _agent_environment():
    from grpo_lightning.integrations.agents import AgentEnvironment

    return AgentEnvironment(agent=f"{__name__}:matrix_agent", max_calls=2, timeout_s=60.0)


KIND_FACTORIES: dict[str, Callable[[], Any]] = {
    "single_turn": lambda: None,
    "ToolEnvironment": _tool_environment,
    "TRLEnvironment": _trl_environment,
    "AgentEnvironment": _agent_environment,
}
"""A small instance of each rollout kind, by class name (a kind the package adds needs one here: the matrix test
that lists the kinds says so)."""


# ------------------------------------------------------------------------------------------------- models
@dataclass
class Models:
    """A tiny model folder and a prompt file per modality, and a tiny reward model (built once per process)."""

    folders: dict[str, str]
    datasets: dict[str, str]
    reward_model: str
    model: str = ""  # the case's model (``for_modality``)

    def for_modality(self, modality: str) -> Models:
        if modality not in self.folders:
            raise KeyError(f"the matrix has no tiny model of the {modality!r} modality: add one to matrix_harness")
        return Models(self.folders, self.datasets, self.reward_model, self.folders[modality])


_BUILT: dict[str, Models] = {}


def build_models(folder: Path) -> Models:
    """The text model (tiny Llama, Qwen-style chat template with tools), the tiny Qwen2-VL, their prompt files and
    a reward model, in ``folder``; once per process."""
    if _BUILT:
        return _BUILT["models"]
    from test_chat_formats import qwen_tokenizer
    from vision_models import COLOURS, image_prompt, squares

    from grpo_lightning.integrations.vision.tiny import build_tiny_vlm

    tokenizer = qwen_tokenizer()
    torch.manual_seed(0)
    text_model = folder / "text"
    build_tiny_llama(MATRIX_TINY, tokenizer).save_pretrained(text_model)
    tokenizer.save_pretrained(text_model)
    image_model = build_tiny_vlm("qwen2_vl", folder / "image")
    text_rows = [{"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)} for i in range(8)]
    image_rows = []
    for i in range(8):
        path = folder / f"squares_{i}.png"
        squares(i % 3 + 1, COLOURS[i % 4]).save(path)
        image_rows.append({"prompt": image_prompt("How many?", 1), "images": [str(path)], "answer": str(i % 3 + 1)})
    datasets = {}
    for name, rows in (("text", text_rows), ("image", image_rows)):
        datasets[name] = str(folder / f"{name}.jsonl")
        Path(datasets[name]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    models = Models(
        {"text": str(text_model), "image": str(image_model)}, datasets, save_tiny_reward_model(folder / "rm")
    )
    _BUILT["models"] = models
    return models


# ------------------------------------------------------------------------------------------------ a round
def make_engine(name: str) -> RolloutEngine:
    """The registry's engine ``name``, with the matrix's settings for it (a small vLLM)."""
    if name not in ENGINE_SETTINGS:
        return build_engine(name)
    return engine_class(name)(**ENGINE_SETTINGS[name])


class StartWeights(Callback):
    """The policy's weights when training starts: what the first round samples from, at every lag."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer, module) -> None:
        self.state = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


@dataclass
class Outcome:
    """What a case did: refused (``error``) or trained (the module, the data, the weights it started from)."""

    error: ConfigError | None
    module: GRPOModule
    data: RolloutDataModule
    trainer: Any
    start: StartWeights


def run_case(case: Any, models: Models, root: Path) -> Outcome:
    """One round of ``case`` (2 prompts × G 2, 4 new tokens, two optimizer steps), or its refusal."""
    models = models.for_modality(case.modality)
    rewards, teacher = signal_settings(case.signal, models)
    module = GRPOModule(model_name_or_path=models.model, objective=ObjectiveConfig(beta=0.0), lr=1e-2, teacher=teacher)
    engine = make_engine(case.engine)
    data = RolloutDataModule(
        dataset=models.datasets[case.modality],
        val_split=None,
        engine=engine,
        environment=KIND_FACTORIES[case.kind](),
        rewards=rewards,
        sampling=SamplingConfig(group_size=ROUND["group_size"], max_new_tokens=ROUND["max_new_tokens"]),
        prompts_per_round=ROUND["prompts_per_round"],
        update=UpdateConfig(
            mini_batch_size=ROUND["prompts_per_round"],
            micro_batch_size=ROUND["prompts_per_round"],
            old_logprobs="sampler" if case.lag == 0 and engine.shares_weights else "auto",
        ),  # two optimizer steps: π_old is recorded
        schedule=ScheduleConfig(rollout_lag=case.lag, rollout_threads=1),
    )
    start = StartWeights()
    trainer = quiet_trainer(root, max_epochs=1, callbacks=[start])
    try:
        trainer.fit(module, datamodule=data)
    except ConfigError as err:
        return Outcome(err, module, data, trainer, start)
    return Outcome(None, module, data, trainer, start)


# ---------------------------------------------------------------------------------------------- invariants
def logprobs_of(model: torch.nn.Module, module: GRPOModule, batch: Any, rows: slice | None = None) -> torch.Tensor:
    """The policy's log-probs of ``batch``'s completions (``rows`` of it), through the package's pass."""
    rows = rows or slice(None)
    vision = batch.vision[rows] if module.modality.has_row_inputs else None
    with torch.no_grad():
        out, _ = completion_logprobs(
            model,
            batch.prompt_ids[rows],
            batch.prompt_mask[rows],
            batch.completion_ids[rows],
            batch.completion_mask[rows],
            temperature=batch.temperature,
            vision=vision,
            modality=module.modality,
        )
    return out


def policy_at(module: GRPOModule, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = copy.deepcopy(module.policy).eval()
    model.load_state_dict(state)
    return model


def check_token_exact(outcome: Outcome) -> None:
    """(a) The batch's ids are the ids the engine sampled: the engine's log-probs of them (kept with the rollout) are
    the policy's, recomputed over the batch's ids with the weights the round sampled from; and the action mask
    covers exactly the tokens the engine gave log-probs for (a multi-turn row's environment tokens: none)."""
    batch, module = outcome.data.last_rollout, outcome.module
    sampled = batch.engine_logprobs if batch.engine_logprobs is not None else batch.old_logprobs
    assert sampled is not None, "the rollout kept none of the engine's log-probs"
    mask = batch.completion_mask.bool()
    action = mask if batch.action_mask is None else mask & batch.action_mask.bool()
    assert action.any()
    assert bool((sampled[mask & ~action] == 0).all()), "the engine gave log-probs for tokens the action mask leaves out"
    assert bool((sampled[action] < 0).all()), "a policy token without the engine's log-prob"
    recomputed = logprobs_of(policy_at(module, outcome.start.state), module, batch)
    if batch.engine_logprobs is not None and module.modality.suppressed_tokens(module.policy):
        # Only μ was kept (a lag's behaviour weight), and the modality's sampler never draws some tokens (an image
        # placeholder): μ renormalises over the rest, so each drawn token's μ is its π raised by the small mass
        # left out; a wrong token would be off by its whole log-prob either way.
        gap = sampled[action] - recomputed[action]
        assert bool((gap > -ATOL).all() and (gap < 0.1).all()), f"μ − π outside [0, 0.1): {gap.tolist()}"
        return
    torch.testing.assert_close(recomputed[action], sampled[action], atol=ATOL, rtol=0)


def check_none_rule(outcome: Outcome) -> None:
    """(b) A column's None is out of its row's total; a row no column scores is unscorable, advantage 0."""
    batch = outcome.data.last_rollout
    columns, weights = batch.reward_columns, batch.reward_weights
    for i in range(len(batch)):
        values = {name: column[i] for name, column in columns.items() if column[i] is not None}
        assert bool(batch.unscorable[i]) == (not values), f"row {i}: unscorable {bool(batch.unscorable[i])}, {values}"
        if values:
            total = sum(weights.get(name, 1.0) * value for name, value in values.items())
            assert float(batch.rewards[i]) == torch.tensor(total, dtype=batch.rewards.dtype).item()
        elif outcome.module.teacher is None:  # a teacher's distillation advantage is added to every row
            assert bool((batch.advantages[i] == 0).all())


def check_batch_company(outcome: Outcome) -> None:
    """(c) A row's log-probs computed alone equal its log-probs computed in the batch (float32, 1e-5)."""
    batch, module = outcome.data.last_rollout, outcome.module
    together = logprobs_of(module.policy, module, batch)
    for i in range(len(batch)):
        alone = logprobs_of(module.policy, module, batch, slice(i, i + 1))
        mask = batch.completion_mask[i].bool()
        torch.testing.assert_close(alone[0][mask], together[i][mask], atol=ATOL, rtol=0)


def check_nothing_stale(outcome: Outcome) -> None:
    """(d) After the round the engine is current (a push, where it holds a copy), and what it samples now has the
    trained policy's log-probs."""
    collector, module = outcome.data.collector, outcome.module
    engine = collector.evaluation_engine()  # pushes the weights when the engine's copy is stale
    assert engine.is_current(module.global_step)
    if not engine.is_setup:  # at a lag the background process holds the engine (its pushes: check_token_exact)
        return
    batch = outcome.data.last_rollout
    rows = slice(0, 1)
    params = SamplingParams(group_size=1, max_new_tokens=ROUND["max_new_tokens"], temperature=batch.temperature)
    generate = {"vision": batch.vision[rows]} if module.modality.has_row_inputs else {}
    with torch.no_grad():
        out = engine.generate(
            batch.prompt_ids[rows],
            batch.prompt_mask[rows],
            params,
            generator=torch.Generator().manual_seed(0),
            return_logprobs=True,
            **generate,
        )
    now = copy.copy(batch)
    now.prompt_ids, now.prompt_mask = out.prompt_ids, out.prompt_mask
    now.completion_ids, now.completion_mask, now.vision = out.completion_ids, out.completion_mask, batch.vision[rows]
    mask = out.completion_mask.bool()
    recomputed = logprobs_of(module.policy, module, now)
    # The tempered policy's log-probs, unfiltered (μ leaves out what the modality suppresses: image placeholders).
    engine_policy = out.policy_logprobs if out.policy_logprobs is not None else out.logprobs
    torch.testing.assert_close(recomputed[mask], engine_policy[mask], atol=ATOL, rtol=0)


INVARIANTS = (check_token_exact, check_none_rule, check_batch_company, check_nothing_stale)
