"""Multi-turn rollouts: token-exact concatenation, limits, truncation, and no loss or KL on environment tokens.

A scripted engine (it answers each context with a fixed text, ignoring stop sequences unless asked) drives the
rollout's bookkeeping exactly; the real engines run in ``test_multiturn_engines.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams, stop_lengths
from grpo_lightning.integrations.environments import Environment, Step, ToolEnvironment
from grpo_lightning.integrations.environments.multiturn import cut_at_stop_text, generate_trajectories
from grpo_lightning.losses import grpo_loss
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.sample_and_score import sample_and_score


class ScriptedEngine(RolloutEngine):
    """Answers a context (decoded) with ``script(context) -> text``; records every context it was given."""

    name = "scripted"

    def __init__(self, tokenizer, script, honour_stops: bool = False, odd_token: bool = False) -> None:
        super().__init__()
        self.odd_token = odd_token
        self.tokenizer, self.script, self.honour_stops = tokenizer, script, honour_stops
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.policy = object()
        self.contexts: list[list[int]] = []

    def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False):
        group = 1 if params.greedy else params.group_size
        rows, lps = [], []
        for ids, mask in zip(prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0)):
            context = ids[mask.bool()].tolist()
            self.contexts.append(context)
            text = self.script(self.tokenizer.decode(context))
            out = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.odd_token and len(out) > 3:
                # A token whose text is empty (decoded without special tokens): re-tokenizing the text of the
                # trajectory would lose it, so only a rollout in token space keeps it in the next context.
                out = out[:3] + [self.tokenizer.unk_token_id] + out[3:]
            out = out[: params.max_new_tokens]
            if self.honour_stops:
                out = out[: int(stop_lengths(torch.tensor([out]), params.stop_sequences).clamp(max=len(out))[0])]
            rows.append(out)
            lps.append([-0.5 - 0.01 * i for i in range(len(out))])
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        ended = torch.tensor([bool(r) and (r[-1] == self.eos_token_id or len(r) < params.max_new_tokens) for r in rows])
        logprobs = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in lps]) if return_logprobs else None
        return Completions(
            prompt_ids.repeat_interleave(group, 0), prompt_mask.repeat_interleave(group, 0), ids, mask, ~ended, logprobs
        )


EOS = "<eos>"


def calculator_policy(context: str) -> str:
    """Calls the calculator on the prompt's expression, then copies the result."""
    if context.endswith("</result>"):
        return context.rsplit("<result>", 1)[1].split("</result>")[0] + EOS
    expression = context.rstrip("=").split("=")[0]
    return f"<tool>calculator: {expression}</tool>and then some babble"  # past the close tag: cut there


def run(
    script, *, max_new_tokens=96, honour_stops=False, odd_token=False, prompts=("12*34=", "5*6="), group=2, **env_kwargs
):
    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, script, honour_stops, odd_token)
    env = ToolEnvironment(tools=["calculator"], format="tag", **env_kwargs)
    params = SamplingParams(group_size=group, max_new_tokens=max_new_tokens)
    out = generate_trajectories(
        {"prompt": list(prompts)},
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        environment=env,
        params=params,
        return_logprobs=True,
    )
    return out, engine, tokenizer


def chat_rollout(env, rows, policy, tokenizer, group: int, max_new_tokens: int):
    """Trajectories of a scripted chat policy against ``env`` (stops honoured, turns ending at the chat template's
    ``<|im_end|>``), and the engine that played it."""
    engine = ScriptedEngine(tokenizer, policy, honour_stops=True)
    engine.eos_token_ids = (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    encoder = PromptEncoder(tokenizer, use_chat_template=True)
    params = SamplingParams(group_size=group, max_new_tokens=max_new_tokens)
    return generate_trajectories(rows, engine=engine, encoder=encoder, environment=env, params=params), engine


def parts(out, row: int):
    """Trajectory ``row``: its prompt ids, its ids after the prompt, and the environment's stretches of them."""
    c = out.completions
    n = int(c.completion_mask[row].sum())
    ids, action = c.completion_ids[row, :n].tolist(), out.action_mask[row, :n].tolist()
    observations, current = [], []
    for token, policy in zip(ids, action):
        if not policy:
            current.append(token)
        elif current:
            observations, current = [*observations, current], []
    return c.prompt_ids[row][c.prompt_mask[row].bool()].tolist(), ids, observations + ([current] if current else [])


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("honour_stops", [False, True])
def test_turns_and_observations_concatenate_token_for_token(honour_stops):
    out, engine, tokenizer = run(calculator_policy, honour_stops=honour_stops, odd_token=True)
    unk = [tokenizer.unk_token_id]
    turn1 = ids_of(tokenizer, "<to") + unk + ids_of(tokenizer, "ol>calculator: 12*34</tool>")
    obs = ids_of(tokenizer, "<result>408</result>")
    turn2 = ids_of(tokenizer, "408") + unk + [tokenizer.eos_token_id]
    expected = turn1 + obs + turn2
    for row in (0, 1):  # the two samples of the first prompt
        n = int(out.completions.completion_mask[row].sum())
        assert out.completions.completion_ids[row, :n].tolist() == expected
        assert out.action_mask[row, :n].tolist() == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
        # The engine's log-probs of the policy's tokens, kept in place; 0 on the observation
        logprobs = out.completions.logprobs[row, :n].tolist()
        assert logprobs[len(turn1) : len(turn1) + len(obs)] == [0.0] * len(obs)
        assert logprobs[: len(turn1)] == pytest.approx([-0.5 - 0.01 * i for i in range(len(turn1))])
    # The second turn was sampled from the trajectory's own tokens: prompt + turn 1 + observation, not re-encoded text
    prompt = ids_of(tokenizer, "12*34=")
    assert prompt + turn1 + obs in engine.contexts
    assert out.final_texts[0] == "408" and out.transcripts[0] == "<tool>calculator: 12*34</tool><result>408</result>408"
    assert out.stats["turns"] == [2.0] * 4 and out.stats["tool_calls"] == [1.0] * 4
    assert not out.completions.truncated.any()


def test_max_turns_ends_a_trajectory_that_keeps_calling_tools():
    out, _, _ = run(lambda context: "<tool>calculator: 1+1</tool>", max_turns=3, max_new_tokens=200)
    # Every turn is stepped (the environment may reward the last one); the last result is not appended.
    assert out.stats["turns"] == [3.0] * 4 and out.stats["tool_calls"] == [3.0] * 4
    assert not out.completions.truncated.any()
    assert out.final_texts[0] == "<tool>calculator: 1+1</tool>"
    assert out.transcripts[0].count("<result>2</result>") == 2


def test_a_turn_cut_by_its_length_limit_truncates_the_trajectory():
    out, _, _ = run(lambda context: "x" * 50, max_turn_tokens=7)
    assert out.completions.truncated.all() and out.stats["turns"] == [1.0] * 4
    assert out.completions.completion_mask.sum(-1).tolist() == [7] * 4


def test_the_total_limit_cuts_a_trajectory_and_is_never_exceeded():
    # Each turn is a 30-token call answered by a 21-token result: after two turns (81 tokens), the second result
    # would leave no room for a third turn in 100 tokens.
    out, _, _ = run(lambda context: "<tool>calculator: 99*99</tool>", max_new_tokens=100, max_turns=10)
    lengths = out.completions.completion_mask.sum(-1)
    assert lengths.tolist() == [81] * 4 and out.completions.truncated.all()
    assert out.stats["turns"] == [2.0] * 4
    # With room for exactly one more turn, the third turn is cut by the total limit instead.
    out, _, _ = run(lambda context: "<tool>calculator: 99*99</tool>", max_new_tokens=110, max_turns=10)
    assert out.completions.completion_mask.sum(-1).tolist() == [110] * 4 and out.completions.truncated.all()


def test_the_first_observation_and_environment_rewards_reach_the_trajectory():
    class Quiz(Environment):
        def reset(self, row):
            self.answer = row["answer"]
            return "Q:"

        def step(self, turn):
            return Step(rewards={"bonus": 0.5}, done=True, metrics={"steps": 1})

    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, lambda context: "42" + EOS)
    rows = {"prompt": ["a=", "b="], "answer": ["42", "7"]}
    batch = sample_and_score(
        rows,
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        scorer=Scorer(),
        params=SamplingParams(group_size=2, max_new_tokens=20),
        environment=Quiz(),
    )
    n = int(batch.completion_mask[0].sum())
    assert batch.completion_ids[0, :n].tolist() == ids_of(tokenizer, "Q:42") + [tokenizer.eos_token_id]
    assert batch.action_mask[0, :n].tolist() == [0, 0, 1, 1, 1]
    assert batch.completions == ["42"] * 4 and batch.transcripts == ["Q:42"] * 4
    assert batch.reward_columns["env_bonus"] == [0.5] * 4
    assert batch.rewards.tolist() == [1.5, 1.5, 0.5, 0.5]  # exact_answer + the environment's part
    assert batch.turn_stats["steps"] == [1.0] * 4


def test_a_stop_text_split_across_tokens_is_found_in_the_text():
    tokenizer = build_char_tokenizer()
    ids = ids_of(tokenizer, "ab</tool>cd")
    assert cut_at_stop_text(ids, ("</tool>",), tokenizer) == len("ab</tool>")
    assert cut_at_stop_text(ids, ("</nope>",), tokenizer) == len(ids)
    assert stop_lengths(torch.tensor([ids, ids]), (tuple(ids_of(tokenizer, "</tool>")),)).tolist() == [9, 9]


def test_a_turn_ending_on_any_end_token_of_the_engine_is_over_not_truncated():
    # Llama-3.1-Instruct ends turns on <|eot_id|> or <|eom_id|>, both EOS ids of its generation_config besides the
    # tokenizer's EOS (engine.eos_token_ids): a turn ending on either is over, not cut by a length limit.
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eom_id|>"]})

    def policy(context: str) -> str:
        return "5<|eom_id|>" if context.endswith("</result>") else "<tool>calculator: 2+3</tool>"

    engine = ScriptedEngine(tokenizer, policy)
    engine.eos_token_ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eom_id|>"))
    out = generate_trajectories(
        {"prompt": ["2+3="]},
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        environment=ToolEnvironment(tools=["calculator"], format="tag"),
        params=SamplingParams(group_size=2, max_new_tokens=80),
    )
    assert not out.completions.truncated.any() and out.final_texts == ["5", "5"] and out.stats["turns"] == [2.0] * 2


# ------------------------------------------------------------------ no loss, no KL on environment tokens
@pytest.fixture
def trajectory_batch():
    """A real tiny model's log-probs over scripted two-turn trajectories (the environment's tokens inside)."""
    out, _, tokenizer = run(calculator_policy)
    torch.manual_seed(0)
    model = build_tiny_llama(TINY, tokenizer)
    c = out.completions
    return model, c, out.action_mask


def loss_and_grads(model, c, mask, ref, old, advantages, beta=0.5):
    model.zero_grad()
    logprobs, _ = completion_logprobs(model, c.prompt_ids, c.prompt_mask, c.completion_ids, c.completion_mask)
    logprobs.retain_grad()
    loss, _ = grpo_loss(logprobs, old, ref, advantages, mask, beta=beta)
    loss.backward()
    return logprobs.grad, [p.grad.clone() for p in model.parameters()]


def test_environment_tokens_get_no_gradient_from_the_loss_or_the_kl(trajectory_batch):
    model, c, action = trajectory_batch
    n, t = c.completion_ids.shape
    generator = torch.Generator().manual_seed(1)
    ref = -torch.rand(n, t, generator=generator) * 3
    old = -torch.rand(n, t, generator=generator) * 3
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    env = (c.completion_mask == 1) & (action == 0)
    assert env.any() and (action == 1).any()

    grad_tokens, grads = loss_and_grads(model, c, action, ref, old, advantages)
    assert (grad_tokens[env] == 0).all()  # d loss / d log p(environment token) = 0 exactly
    assert (grad_tokens[action.bool()] != 0).any()
    for beta in (0.0, 0.5):  # the KL term alone, too
        kl_only, _ = loss_and_grads(model, c, action, ref, old, torch.zeros(4), beta=beta)
        assert (kl_only[env] == 0).all()

    # Anything on environment tokens (the reference's and π_old's log-probs there, even NaN) changes no gradient.
    ref_perturbed = torch.where(env, torch.full_like(ref, float("nan")), ref)
    old_perturbed = torch.where(env, ref + 5.0, old)
    _, grads_perturbed = loss_and_grads(model, c, action, ref_perturbed, old_perturbed, advantages)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_perturbed))

    # The masked run differs from one that trains on every token: the mask is what keeps them out.
    _, grads_all = loss_and_grads(model, c, c.completion_mask, ref, old, advantages)
    assert any(not torch.equal(a, b) for a, b in zip(grads, grads_all))
