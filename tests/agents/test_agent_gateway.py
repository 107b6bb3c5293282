"""Agents that run their own loop (``grpo_lightning/integrations/agents/``): a two-turn agent written here with the
``openai`` client, run unchanged against the round's gateway on the lean engine.

Checked: what is recorded is what the engine drew (ids and log-probs, the trainer's own on the policy's tokens);
turns that extend the previous prompt + completion are one row with the model's tokens alone in the loss; a history
that is rewritten makes a row of its own, counted, and the advantages stay per session (group statistics over
sessions); a whole fit; who may write rows (the token, the session, the bind address); failures and limits.

The model is the demo's ``tiny-calc`` (a character tokenizer, trained on calculator traces), so the completions are
the calculator's format and not random special tokens; a tiny chat template is set on its tokenizer here.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from lightning import Callback, Trainer, seed_everything
from transformers import AutoModelForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.advantages import group_advantages
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import AdvantageConfig, ConfigError, UpdateConfig
from grpo_lightning.engines import LeanEngine, SamplingParams
from grpo_lightning.integrations.agents import AgentEnvironment
from grpo_lightning.integrations.agents.calls import AgentRow, Call, merge_calls
from grpo_lightning.integrations.agents.gateway import Gateway
from grpo_lightning.integrations.agents.rollout import rows_batch, sample_and_score_agents
from grpo_lightning.integrations.agents.serving import CallServer
from grpo_lightning.integrations.environments.tools import calculator
from grpo_lightning.models.build import load_tokenizer
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, SampledRound, finish_round, refill_informative
from grpo_lightning.update_plan import UpdatePlan

TINY_CALC = str(Path(__file__).resolve().parents[2] / "grpo_lightning" / "assets" / "tiny-calc")
# A user message is its text; an assistant message its text and the end token; no generation prompt.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
ROWS = {"prompt": ["12*34=", "56*78="], "answer": ["408", "4368"]}


class Recording:
    """Wraps an engine and records each call's contexts, drawn tokens and log-probs (real tokens only)."""

    def __init__(self, engine):
        self.engine, self.drawn = engine, {}  # context → [(drawn ids, their log-probs), ...]

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, prompt_mask, params, **kwargs):
        out = self.engine.generate(prompt_ids, prompt_mask, params, **kwargs)
        for i in range(len(out)):
            context = tuple(prompt_ids[i][prompt_mask[i].bool()].tolist())
            n = int(out.completion_mask[i].sum())
            self.drawn.setdefault(context, []).append(
                (out.completion_ids[i, :n].tolist(), out.logprobs[i, :n].tolist())
            )
        return out

    def drawn_at_start_of(self, context, tokens):
        """What the engine drew from ``context`` that ``tokens`` start with (None: nothing)."""
        return next(((ids, lps) for ids, lps in self.drawn.get(tuple(context), []) if tokens[: len(ids)] == ids), None)


@pytest.fixture(scope="module")
def calc():
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tokenizer = load_tokenizer(TINY_CALC)
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = LeanEngine()
    engine.setup(model, tokenizer)
    return model, tokenizer, engine


def result_of(call: str) -> str:
    """The calculator's answer to the model's call (``?`` when it made none, ``error`` when it cannot be read)."""
    if "calculator:" not in call:
        return "?"
    try:
        return calculator(call.split("calculator:")[-1].split("</tool>")[0])
    except Exception:
        return "error"


def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)


def two_turn_agent(base_url, api_key, row):
    """Asks, runs the calculator on the model's call, answers with the result as the next user message."""
    model = client(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = model.chat.completions.create(
        model="policy",
        messages=messages,
        max_tokens=40,
        stop=["</tool>"],
        extra_body={"include_stop_str_in_output": True},  # the text keeps the tag the model drew
    )
    call = first.choices[0].message.content
    messages += [
        {"role": "assistant", "content": call},
        {"role": "user", "content": f"<result>{result_of(call)}</result>"},
    ]
    second = model.chat.completions.create(model="policy", messages=messages, max_tokens=20)
    return float(sum(map(ord, second.choices[0].message.content)) % 5)  # spread, so groups have advantages


def rewriting_agent(base_url, api_key, row):
    """Two turns, the second with the history rewritten (its first call summarised): two rows per session."""
    model = client(base_url, api_key)
    first = model.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    summary = f"Q {row['prompt']} said {first.choices[0].message.content[:6]}"
    second = model.chat.completions.create(model="policy", messages=[{"role": "user", "content": summary}])
    return float(len(second.choices[0].message.content) % 3)


def run(engine, tokenizer, agent, rows=ROWS, group=2, scorer=None, **env_kwargs):
    env = AgentEnvironment(agent=agent, **env_kwargs)
    with torch.no_grad():
        return sample_and_score_agents(
            rows,
            agent=env,
            engine=engine,
            encoder=PromptEncoder(tokenizer, False),
            scorer=scorer or Scorer(),
            params=SamplingParams(group_size=group, max_new_tokens=48),
            generator=torch.Generator().manual_seed(0),
        )


# ------------------------------------------------------------------------------------------- the merge rule
def call(prompt, completion, text="t", finish="stop"):
    return Call(prompt, completion, [-0.5] * len(completion), [-0.25] * len(completion), text, finish)


def test_calls_that_extend_merge_and_others_start_a_row():
    rows = merge_calls([call([1, 2], [3, 4]), call([1, 2, 3, 4, 5, 6], [7], "last", "length"), call([9], [8])])
    assert [r.prompt_ids for r in rows] == [[1, 2], [9]]
    assert rows[0].completion_ids == [3, 4, 5, 6, 7] and rows[0].action == [1, 1, 0, 0, 1]
    assert rows[0].logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5] and rows[0].policy_logprobs == [-0.25, -0.25, 0, 0, -0.25]
    assert rows[0].calls == 2 and rows[0].truncated and rows[0].text == "last"
    # Interleaved conversations each continue their own row; a changed token anywhere breaks the extension.
    rows = merge_calls([call([1], [2]), call([5], [6]), call([1, 2, 3], [4]), call([5, 6, 7], [8]), call([1, 9], [0])])
    assert [r.ids for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [1, 9, 0]]
    no_policy = Call([1], [2], [-1.0], None, "t", "stop")
    assert merge_calls([call([0], [1]), Call([0, 1], [2], [-1.0], None, "t", "stop")])[0].policy_logprobs is None
    assert merge_calls([no_policy])[0].logprobs == [-1.0]


# ---------------------------------------------------------------------------------- on the lean engine
def test_a_two_turn_agent_is_recorded_as_drawn_and_merged_into_one_row(calc):
    model, tokenizer, engine = calc
    recording = Recording(engine)
    batch = run(recording, tokenizer, two_turn_agent)
    assert batch.agent_log["sessions"] == 4 and batch.agent_log["calls_per_session"] == 2
    assert batch.agent_log["rows_per_session"] == 1 and batch.agent_log["split_sessions"] == 0
    assert batch.trajectory.tolist() == [0, 1, 2, 3] and len(batch) == 4
    for row in range(4):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        n = int(batch.completion_mask[row].sum())
        full, action = batch.completion_ids[row, :n].tolist(), batch.action_mask[row, :n].tolist()
        assert prompt == tokenizer(ROWS["prompt"][row // 2], add_special_tokens=False)["input_ids"]
        first, first_lp = recording.drawn_at_start_of(prompt, full)  # the first call: drawn from the prompt
        # The second call's prompt is the template's (prompt + call + <eos> + the user's message, re-tokenized): it
        # extends the first call's tokens, so the row goes on with the frame out of the loss, the answer in it.
        k = next(
            k for k in range(len(first) + 1, len(full)) if recording.drawn_at_start_of(prompt + full[:k], full[k:])
        )
        second, second_lp = recording.drawn_at_start_of(prompt + full[:k], full[k:])
        observation = full[len(first) : k]
        # The template closes the model's message with <eos>: a frame token unless the model drew it itself.
        closed = first[-1] == tokenizer.eos_token_id
        frame = r"<result>[^<]*</result>" if closed else r"<eos><result>[^<]*</result>"
        assert re.fullmatch(frame, tokenizer.decode(observation)), tokenizer.decode(observation)
        assert full == first + observation + second
        assert action == [1] * len(first) + [0] * len(observation) + [1] * len(second)
        assert batch.engine_logprobs[row, :n].tolist() == first_lp + [0.0] * len(observation) + second_lp
    # The recorded log-probs are the trainer's own on the policy's tokens (float32; reordered sums)
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
    policy = batch.action_mask.bool()
    torch.testing.assert_close(trainer[policy], batch.policy_logprobs[policy], rtol=0, atol=1e-4)
    assert batch.reward_columns["agent"] == [float(sum(map(ord, t)) % 5) for t in batch.completions]


def test_a_rewritten_history_makes_rows_of_its_own_and_advantages_stay_per_session(calc):
    _, tokenizer, engine = calc
    batch = run(engine, tokenizer, rewriting_agent)
    assert batch.agent_log["split_sessions"] == 4 and batch.agent_log["rows_per_session"] == 2 and len(batch) == 8
    assert batch.trajectory.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(
        text.startswith("Q ") for text in tokenizer.batch_decode(batch.prompt_ids[1::2], skip_special_tokens=True)
    )
    assert batch.rewards[0::2].tolist() == batch.rewards[1::2].tolist()  # a session's rows share its reward
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=2), advantage=AdvantageConfig(), optimizer_steps=1, reference=False
    )
    batch.rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])  # sessions: 1, 0 | 2, 2
    rollout = finish_round(SampledRound(batch), logprobs=lambda b, old, ref: (None, None), settings=settings)
    per_session = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)  # statistics over sessions, not rows
    assert rollout.advantages.tolist() == per_session.repeat_interleave(2).tolist()
    assert rollout.metrics["rollout/zero_std_group_fraction"] == 0.5 and rollout.metrics["agent/split_sessions"] == 4
    # The round keeps its planned steps and forwards (4 trajectories: one mini-batch of 2 micro-batches), every
    # row once.
    plan = UpdatePlan(num_iterations=1, rows_per_round=4, mini_batch_size=4, micro_batch_size=2)
    batches = rollout.micro_batches(plan, generator=torch.Generator().manual_seed(0))
    assert len(batches) == 2 and sum(len(b["completion_ids"]) for b in batches) == 8


def sessions_batch(rows_per_session, rewards):
    """A batch of agent rows: each session's rows (made up tokens), its reward on each."""
    counts = torch.tensor(rows_per_session)
    rows = [
        AgentRow([1, 2], [3 + s, 4], [1, 1], [-0.1, -0.2], [-0.1, -0.2]) for s, n in enumerate(counts) for _ in range(n)
    ]
    batch = rows_batch(rows, 0, "cpu")
    batch.trajectory = torch.arange(len(counts)).repeat_interleave(counts)
    batch.rewards = torch.tensor(rewards, dtype=torch.float32).repeat_interleave(counts)
    batch.prompts = ["p"] * len(rows)
    return batch


def test_dynamic_sampling_keeps_and_counts_whole_sessions():
    first = sessions_batch([2, 1, 1, 1], [1.0, 0.0, 3.0, 3.0])  # groups of 2 sessions: informative, not
    second = sessions_batch([1, 3, 1, 1], [0.0, 2.0, 5.0, 5.0])
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=2), advantage=AdvantageConfig(), optimizer_steps=1, max_sampling_rounds=2
    )
    out, generated, draws = refill_informative(first, lambda: second, settings, pad_token_id=0)
    assert draws == 2 and len(out) == 2 + 1 + 1 + 3  # the informative group of each draw, every row of it
    assert out.trajectory.tolist() == [0, 0, 1, 2, 3, 3, 3] and out.per_trajectory().rewards.tolist() == [1, 0, 0, 2]


def test_the_completions_endpoint_takes_token_ids_and_returns_them(calc):
    _, tokenizer, engine = calc
    seen = {}

    def token_agent(base_url, api_key, row):
        model = client(base_url, api_key)
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        first = model.completions.create(
            model="policy", prompt=prompt, max_tokens=8, logprobs=0, extra_body={"return_token_ids": True}
        )
        ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        second = model.completions.create(model="policy", prompt=ids + [5, 6], max_tokens=4)
        seen[row["prompt"]] = (first, second)
        return None

    batch = run(engine, tokenizer, token_agent, group=1)
    assert batch.agent_log["rows_per_session"] == 1 and batch.unscorable.tolist() == [False, False]
    first, _ = seen["12*34="]
    n = len(first.choices[0].model_extra["token_ids"])
    assert batch.completion_ids[0, :n].tolist() == first.choices[0].model_extra["token_ids"]
    assert batch.engine_logprobs[0, :n].tolist() == pytest.approx(first.choices[0].logprobs.token_logprobs)
    assert batch.completion_ids[0, n : n + 2].tolist() == [5, 6] and batch.action_mask[0, n : n + 2].tolist() == [0, 0]
    assert first.usage.prompt_tokens == 6 and first.usage.completion_tokens == n <= 8
    batch = run(engine, tokenizer, token_agent, group=1, scorer=Scorer([]))  # no data.rewards, no agent reward
    assert batch.unscorable.tolist() == [True, True]


# ------------------------------------------------------------------------------------- through training
class Recorder(Callback):
    def __init__(self):
        self.rollouts = []

    def on_train_epoch_end(self, trainer, module):
        self.rollouts.append(trainer.datamodule.last_rollout)


def calculator_agent(base_url, api_key, row):
    """Token-exact by text on a character tokenizer: the prompt, the call and the result, through /completions;
    rows whose prompt starts with an odd digit also ask a check from a fresh prompt (a second row)."""
    model = client(base_url, api_key)
    extra = {"include_stop_str_in_output": True}
    first = model.completions.create(model="p", prompt=row["prompt"], max_tokens=40, stop=["</tool>"], extra_body=extra)
    text = first.choices[0].text
    if "calculator:" in text:
        prompt = row["prompt"] + text + f"<result>{result_of(text)}</result>"
        model.completions.create(model="p", prompt=prompt, max_tokens=16)
    if row["prompt"][0] in "13579":
        model.completions.create(model="p", prompt=f"{row['answer']}=", max_tokens=8)
    return None  # exact_answer scores the last call's text


def test_rounds_through_the_trainer(tmp_path):
    seed_everything(0)
    module = GRPOModule(model_name_or_path=TINY_CALC, objective=ObjectiveConfig(beta=0.05), lr=1e-3)
    data = RolloutDataModule(
        dataset="multiplication",
        task_kwargs={"train_size": 50, "test_size": 4},
        environment=AgentEnvironment(agent=calculator_agent, max_concurrency=4),
        sampling=SamplingConfig(group_size=4, max_new_tokens=48),
        prompts_per_round=2,
        update=UpdateConfig(mini_batch_size=4),  # two optimizer steps per round: π_old is recorded (the lean engine's)
        val_split=None,
    )
    recorder = Recorder()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[recorder],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    assert len(recorder.rollouts) == 2
    rows = 0
    for rollout in recorder.rollouts:
        assert rollout.metrics["agent/sessions"] == 8 and rollout.metrics["agent/calls_per_session"] >= 1
        assert torch.equal(rollout.loss_mask, rollout.action_mask)
        assert (rollout.old_logprobs[rollout.action_mask == 0] == 0).all()
        assert "rollout/turns_mean" in rollout.metrics and "time/environment" in rollout.metrics
        rows += len(rollout)
    assert rows >= 16 + 3 * 4  # 3 of the 4 prompts' sessions made a second row; the rounds ran their planned steps
    assert trainer.global_step == 4


# --------------------------------------------------------------------------------------------- security
def serve_while(server, fn):
    """``fn()`` in a thread (an agent) while this thread serves the gateway, as a round does; its result."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            out["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    while thread.is_alive():
        server.serve(server.gateway.next_requests(0.01))
    if "error" in out:
        raise out["error"]
    return out["value"]


def post(url, body, token=None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def gateway_server(calc):
    _, tokenizer, engine = calc
    gateway = Gateway()
    server = CallServer(
        gateway,
        engine=engine,
        tokenizer=tokenizer,
        params=SamplingParams(max_new_tokens=8),
        generator=torch.Generator().manual_seed(0),
        max_call_tokens=8,
        max_calls=2,
        context_limit=128,
    )
    yield gateway, server
    gateway.close()


def test_only_the_runs_sessions_with_its_token_write_rows(gateway_server):
    gateway, server = gateway_server
    assert gateway.address[0] == "127.0.0.1"  # this machine only, unless told otherwise
    session = gateway.open_session()
    url = gateway.base_url(session) + "/completions"
    body = {"model": "p", "prompt": "12*34=", "max_tokens": 4}
    assert serve_while(server, lambda: post(url, body))[0] == 401  # no token
    assert serve_while(server, lambda: post(url, body, token="not-the-token"))[0] == 401
    other = url.replace(session.id, "made-up-session")
    assert serve_while(server, lambda: post(other, body, token=gateway.token))[0] == 404
    assert session.calls == [] and gateway.refused == 3
    status, answer = serve_while(server, lambda: post(url, body, token=gateway.token))
    assert status == 200 and len(session.calls) == 1 and answer["usage"]["completion_tokens"] <= 4
    gateway.close_session(session)  # its agent returned: nothing more of it is served or recorded
    status, answer = serve_while(server, lambda: post(url, body, token=gateway.token))
    assert status == 403 and answer["error"]["code"] == "session_ended" and len(session.calls) == 1


def test_a_call_whose_session_ends_while_it_generates_leaves_no_row(gateway_server):
    gateway, server = gateway_server
    session = gateway.open_session()
    generate = server.engine.generate

    def ending_generate(*args, **kwargs):  # the session times out while the engine draws the completion
        gateway.close_session(session)
        return generate(*args, **kwargs)

    server.engine = type("Ending", (), {"generate": staticmethod(ending_generate)})()
    url = gateway.base_url(session) + "/completions"
    status, _ = serve_while(server, lambda: post(url, {"prompt": "1+1=", "max_tokens": 3}, token=gateway.token))
    assert status == 403 and session.calls == []


def test_requests_it_cannot_serve_are_answered_and_counted(gateway_server):
    gateway, server = gateway_server
    session = gateway.open_session()
    url = gateway.base_url(session)
    for body in ({"prompt": "1=", "n": 2}, {"prompt": "1=", "stream": True}, {"prompt": "9" * 200}, {"prompt": ""}):
        status, answer = serve_while(server, lambda b=body: post(url + "/completions", b, token=gateway.token))
        assert status == 400 and answer["error"]["message"], body
    for _ in range(2):
        assert serve_while(server, lambda: post(url + "/completions", {"prompt": "1="}, token=gateway.token))[0] == 200
    assert serve_while(server, lambda: post(url + "/completions", {"prompt": "1="}, token=gateway.token))[0] == 429
    assert server.bad_requests == 4 and session.refused == 1 and len(session.calls) == 2


def test_after_the_round_the_gateway_is_gone_and_a_wildcard_bind_is_reached_locally(calc):
    _, tokenizer, engine = calc
    urls = []

    def remembering_agent(base_url, api_key, row):
        urls.append((base_url, api_key))
        return 1.0

    batch = run(engine, tokenizer, remembering_agent, group=1, host="0.0.0.0")
    assert all(url.startswith("http://127.0.0.1:") for url, _ in urls)
    assert batch.agent_log["empty_sessions"] == 2 and batch.unscorable.all()  # no call: nothing to train on
    assert (batch.action_mask == 0).all()
    url, key = urls[0]
    with pytest.raises(urllib.error.URLError):  # nothing listens any more: the agent cannot write a row
        post(url + "/completions", {"prompt": "1="}, token=key)


# ------------------------------------------------------------------------------------ failures, settings
def test_a_failing_agent_stops_the_run_or_is_left_out(calc):
    _, tokenizer, engine = calc

    def flaky_agent(base_url, api_key, row):
        client(base_url, api_key).completions.create(model="p", prompt=row["prompt"], max_tokens=4)
        if row["prompt"].startswith("56"):
            raise ValueError("the tool broke")
        return 1.0

    with pytest.raises(RuntimeError, match="the agent failed on the prompt '56\\*78=': ValueError: the tool broke"):
        run(engine, tokenizer, flaky_agent, group=1)
    batch = run(engine, tokenizer, flaky_agent, group=1, on_error="skip")
    assert batch.agent_log["failed_sessions"] == 1 and batch.unscorable.tolist() == [False, True]
    assert batch.action_mask[1].sum() == 0 and batch.action_mask[0].sum() > 0  # the failed one: out of the loss

    def slow_agent(base_url, api_key, row):
        time.sleep(3 if row["prompt"].startswith("56") else 0)
        return 1.0

    start = time.monotonic()
    batch = run(engine, tokenizer, slow_agent, group=1, on_error="skip", timeout_s=0.3)
    assert batch.agent_log["timed_out_sessions"] == 1 and time.monotonic() - start < 2


def test_a_program_is_run_with_the_endpoint_in_its_environment(calc, tmp_path):
    _, tokenizer, engine = calc
    program = tmp_path / "agent.py"
    # The endpoint as the ``openai`` client reads it (OPENAI_BASE_URL, OPENAI_API_KEY); plain urllib here, which
    # starts in a fraction of the time the client's imports take.
    program.write_text(
        "import json, os, sys, urllib.request\n"
        "row = json.load(sys.stdin)\n"
        "body = json.dumps({'model': 'p', 'prompt': row['prompt'], 'max_tokens': 6}).encode()\n"
        "headers = {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'}\n"
        "url = os.environ['OPENAI_BASE_URL'] + '/completions'\n"
        "answer = json.load(urllib.request.urlopen(urllib.request.Request(url, body, headers)))\n"
        "print('log line')\n"
        "print(json.dumps({'format': 1.0, 'length': len(answer['choices'][0]['text'])}))\n"
    )
    batch = run(engine, tokenizer, None, group=1, command=[sys.executable, str(program)], scorer=Scorer([]))
    assert batch.agent_log["calls_per_session"] == 1
    lengths = [float(len(t)) for t in batch.completions]
    assert batch.reward_columns == {"agent_format": [1.0, 1.0], "agent_length": lengths}  # data.rewards: [] here
    assert batch.rewards.tolist() == [1.0 + length for length in lengths] and not batch.unscorable.any()


def test_a_port_in_use_is_refused_in_one_line():
    taken = Gateway()
    try:
        with pytest.raises(ConfigError, match="cannot listen on 127.0.0.1"):
            Gateway(port=taken.address[1])
    finally:
        taken.close()


def test_bad_settings_are_refused_in_one_line():
    for kwargs, match in (
        ({}, "exactly one of agent"),
        ({"agent": "no_such_module:fn"}, "cannot import"),
        ({"agent": "no colon"}, "package.module:function"),
        ({"agent": two_turn_agent, "max_calls": 0}, "max_calls must be"),
        ({"agent": two_turn_agent, "timeout_s": 0}, "timeout_s must be"),
        ({"agent": two_turn_agent, "on_error": "ignore"}, "on_error must be"),
        ({"agent": two_turn_agent, "port": -1}, "port must be"),
    ):
        with pytest.raises(ConfigError, match=match):
            AgentEnvironment(**kwargs)
