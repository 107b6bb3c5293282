"""``RolloutKind`` (``rollout/kind.py``): the one rollout interface. A user's kind, written without any environment
base class, plugs in through ``data.environment`` and its rows are scored by the one scorer rule; the core's own
kind (single-turn sampling) gives what ``sample_and_score`` gave before the interface, bit for bit."""

from __future__ import annotations

from typing import Any

import torch
from helpers import save_tiny_llama
from test_rollout_metrics import CountingEngine

from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.engines.lean import LeanEngine
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.datamodule import RolloutDataModule
from grpo_lightning.rollout.kind import RolloutKind
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, run_round
from grpo_lightning.rollout.sample_and_score import SingleTurn, repeat_each, sample_and_score, score_completions


@register("test_kind_abstains")
def abstains(prompts: list[str], completions: list[str], **_: Any) -> list[None]:
    """Not applicable to any completion (TRL's None): only the kind's own part can score a row."""
    return [None] * len(completions)


class Judged(RolloutKind):
    """A user's rollout kind: the engine's single-turn samples, judged by the kind itself (``verdicts``, cycled over
    the round's completions; None: the judge abstains), its part weighed ``weight``."""

    gives_rewards = True

    def __init__(self, verdicts: list[float | None] | None = None, weight: float = 2.0) -> None:
        self.verdicts = list(verdicts) if verdicts is not None else [1.0, None, 0.0, None]
        self.weight = weight

    def reward_weights(self) -> dict[str, float]:
        return {"judge": self.weight}

    def rollout(
        self,
        rows: dict[str, list[Any]],
        *,
        engine: Any,
        encoder: PromptEncoder,
        scorer: Scorer,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
        device: torch.device | str = "cpu",
        timings: dict[str, float] | None = None,
    ) -> Any:
        prompt_ids, prompt_mask, _ = encoder.encode_rows(rows, device)
        completions = engine.generate(prompt_ids, prompt_mask, params, generator=generator)
        texts = encoder.decode(completions.completion_ids, completions.completion_mask)
        verdicts = [self.verdicts[i % len(self.verdicts)] for i in range(len(texts))]
        return score_completions(
            rows,
            completions,
            texts,
            encoder=encoder,
            scorer=scorer,
            params=params,
            parts={"judge": verdicts},
            part_weights=self.reward_weights(),
            timings=timings,
        )


def test_a_user_rollout_kind_runs_a_round_scored_by_the_one_rule() -> None:
    """Judge [1, None, 0, None] (weight 2) beside a reward function that abstains everywhere: the None rows are
    unscorable (advantage 0, out of the baseline), the others ±1 around the mean of {2, 0}."""
    tokenizer = build_char_tokenizer()
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=4, max_new_tokens=8),
        advantage=AdvantageConfig(),
        optimizer_steps=1,
        environment=Judged(),
        reference=False,
    )
    prompts = iter([["1+1=", "2+2="]])
    batch = run_round(
        lambda: {"prompt": next(prompts)},
        engine=CountingEngine(tokenizer),
        encoder=PromptEncoder(tokenizer),
        scorer=Scorer([RewardSpec("test_kind_abstains")]),
        logprobs=lambda batch, *, old, ref: (None, None),
        settings=settings,
        generator=torch.Generator().manual_seed(0),
    )
    assert batch.reward_columns == {"test_kind_abstains": [None] * 8, "judge": [1.0, None, 0.0, None] * 2}
    assert batch.reward_weights["judge"] == 2.0
    assert batch.unscorable.tolist() == [False, True, False, True] * 2
    assert batch.rewards[[0, 2, 4, 6]].tolist() == [2.0, 0.0, 2.0, 0.0]
    advantages = batch.advantages.tolist()
    assert [advantages[i] for i in (1, 3, 5, 7)] == [0.0] * 4
    assert advantages[0] > 0 > advantages[2] and advantages[0] == -advantages[2] == advantages[4]


def test_a_user_rollout_kind_is_taken_by_the_data_module_and_from_yaml(tmp_path, monkeypatch) -> None:
    """``data.environment`` takes any ``RolloutKind``: built in code, and named by class path in YAML (before: "must
    be ... a grpo_lightning.integrations.environments.Environment subclass")."""
    kind = Judged([0.5])
    data = RolloutDataModule(rewards=[], environment=kind)
    assert data.environment is kind and data.rollout_kind is kind and data.collector.environment is kind

    from grpo_lightning.cli import GRPOCLI

    monkeypatch.chdir(tmp_path)
    model = save_tiny_llama(tmp_path / "model", TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2))
    (tmp_path / "run.yaml").write_text(
        f"""
trainer: {{accelerator: cpu, max_epochs: 1, logger: false}}
model: {{model_name_or_path: {model}}}
data:
  rewards: []
  environment: {{class_path: test_rollout_kind.Judged, init_args: {{verdicts: [1.0, null], weight: 3.0}}}}
"""
    )
    from_yaml = GRPOCLI(args=["--config", "run.yaml"], run=False).datamodule.environment
    assert isinstance(from_yaml, Judged) and from_yaml.verdicts == [1.0, None] and from_yaml.weight == 3.0


def todays_single_turn(rows, *, engine, encoder, scorer, params, generator, return_logprobs):
    """``sample_and_score`` without an environment as it was written before ``RolloutKind``: encode, generate,
    decode, score (the completions, their texts and the scorer's result)."""
    group = 1 if params.greedy else params.group_size
    prompt_ids, prompt_mask, _ = encoder.encode_rows(rows, "cpu")
    completions = engine.generate(prompt_ids, prompt_mask, params, generator=generator, return_logprobs=return_logprobs)
    texts = encoder.decode(completions.completion_ids, completions.completion_mask)
    prompts = repeat_each(rows["prompt"], group)
    columns = {name: repeat_each(values, group) for name, values in rows.items() if name != "prompt"}
    columns["completion_lengths"] = completions.completion_mask.sum(-1).tolist()
    ids, mask = completions.completion_ids, completions.completion_mask.bool()
    columns["completion_ids"] = [row[keep].tolist() for row, keep in zip(ids, mask)]
    return completions, texts, prompts, scorer(prompts, texts, columns, parts=None, part_weights=None)


def test_the_single_turn_kind_gives_what_sample_and_score_gave(tokenizer, tiny_llama) -> None:
    """On a tiny model (G = 4, 12 new tokens, two prompts): the same tokens, log-probs, rewards, columns and
    correctness as the code before the interface, through ``SingleTurn`` and through ``sample_and_score``."""
    engine = LeanEngine()
    engine.setup(tiny_llama, tokenizer)
    encoder = PromptEncoder(tokenizer)
    scorer = Scorer([RewardSpec("exact_answer"), RewardSpec("helpers.length_reward", weight=0.1)])
    params = SamplingParams(group_size=4, max_new_tokens=12, temperature=1.0)
    rows = {"prompt": ["1+1=", "12+3="], "answer": ["2", "15"]}

    with torch.no_grad():
        before, texts, prompts, scores = todays_single_turn(
            rows, engine=engine, encoder=encoder, scorer=scorer, params=params,
            generator=torch.Generator().manual_seed(3), return_logprobs=True,
        )  # fmt: skip
        batches = [
            SingleTurn().rollout(
                rows, engine=engine, encoder=encoder, scorer=scorer, params=params,
                generator=torch.Generator().manual_seed(3), return_logprobs=True,
            ),
            sample_and_score(
                rows, engine=engine, encoder=encoder, scorer=scorer, params=params,
                generator=torch.Generator().manual_seed(3), return_logprobs=True,
            ),
        ]  # fmt: skip
    for batch in batches:
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
            assert torch.equal(getattr(batch, name), getattr(before, name)), name
        assert torch.equal(batch.engine_logprobs, before.logprobs)
        assert torch.equal(batch.policy_logprobs, before.policy_logprobs)
        assert torch.equal(batch.rewards, torch.tensor(scores.total, dtype=torch.float32))
        assert batch.reward_columns == scores.per_function
        assert batch.unscorable.tolist() == scores.unscorable and batch.correct == scores.correct
        assert batch.completions == texts and batch.prompts == prompts and batch.action_mask is None
        assert batch.reward_weights == scores.weights and batch.temperature == 1.0 and batch.max_new_tokens == 12
    assert len(set(batches[0].completions)) > 1  # sampled: the groups differ
