"""``OpenEnvEnvironment`` against a real OpenEnv server (``openenv_guess.py``: guess a number), offline.

The server runs in this process (uvicorn in a thread) for most tests, and as a subprocess the run starts for the
tests of that path. A scripted policy with the Qwen-style tokenizer checks the trajectories token for token
(observations rendered by the chat template, each tokenized alone: the whole trajectory is the template's rendering
of the conversation); the demo's tiny-calc model runs real multi-turn rollouts with plain frames. Stepping 8
trajectories with 3 workers gives the same trajectories as one at a time. Faults: a refused connection, a timeout,
a crashing environment, a transient fault recovered by replaying the trajectory on a new session (and one that
cannot be, a reset that is not deterministic), a server at capacity, a server killed mid-run; each ends in one line.
The server the run started is stopped by ``close`` and when its parent dies.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("openenv", reason="openenv is not installed: pip install -e .[openenv]")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn (an openenv dependency) is not installed")

import openenv_guess  # noqa: E402
from openenv.core import EnvClient  # noqa: E402
from openenv.core.client_types import StepResult  # noqa: E402
from openenv.core.env_server.types import State  # noqa: E402
from test_chat_formats import qwen_tokenizer  # noqa: E402
from test_multiturn import chat_rollout  # noqa: E402

from grpo_lightning.config import ConfigError  # noqa: E402
from grpo_lightning.engines import LeanEngine, SamplingParams  # noqa: E402
from grpo_lightning.integrations.environments import OpenEnvEnvironment  # noqa: E402
from grpo_lightning.integrations.environments.local_server import free_port  # noqa: E402
from grpo_lightning.integrations.environments.multiturn import generate_trajectories  # noqa: E402
from grpo_lightning.rollout.prompts import PromptEncoder  # noqa: E402

TINY_CALC = str(Path(__file__).resolve().parents[2] / "grpo_lightning" / "assets" / "tiny-calc")
END = "<|im_end|>"


@contextlib.contextmanager
def served(app):
    """``app`` served by uvicorn in a thread of this process, on a free port; its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def url():
    with served(openenv_guess.app) as address:
        yield address


def question(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


ROWS = {  # targets: found at turn 3, 2, 1, never (out of turns)
    "prompt": [question(f"Guess {k}.") for k in range(4)],
    "target": [42, 50, 10, 99],
}
GUESSES = ("I say 10", "I say 50", "it is 42")


def guessing_policy(context: str, extra: str = "") -> str:
    """Guesses 10, then 50, then 42 (one per observation so far), ending each turn with the end token."""
    answered = context.count("<|im_start|>user") - 1  # the prompt's own user message aside
    return GUESSES[min(answered, 2)] + extra + END


def make_env(url: str | None, **kwargs) -> OpenEnvEnvironment:
    kwargs = {"url": url, "reset_columns": ["target"], "max_turns": 3, "max_observation_tokens": 128, **kwargs}
    return OpenEnvEnvironment(**kwargs)


def rollout(env, rows, policy, tokenizer=None, group=2, max_new_tokens=300):
    return chat_rollout(env, rows, policy, tokenizer or qwen_tokenizer(), group, max_new_tokens)[0]


def parts(out, row: int):
    """Trajectory ``row``: its prompt ids, its ids after the prompt, its policy stretches and environment ones."""
    c = out.completions
    n = int(c.completion_mask[row].sum())
    ids, action = c.completion_ids[row, :n].tolist(), out.action_mask[row, :n].tolist()
    stretches: list[tuple[int, list[int]]] = []
    for token, policy in zip(ids, action):
        if stretches and stretches[-1][0] == policy:
            stretches[-1][1].append(token)
        else:
            stretches.append((policy, [token]))
    turns = [s for policy, s in stretches if policy]
    observations = [s for policy, s in stretches if not policy]
    return c.prompt_ids[row][c.prompt_mask[row].bool()].tolist(), ids, turns, observations


def guess_reward(turn: str, target: int) -> float:
    """The reward ``openenv_guess`` gives a turn: 1 for the target as its last number, -0.1 for another, else 0."""
    numbers = re.findall(r"-?\d+", turn)
    return 0.0 if not numbers else 1.0 if int(numbers[-1]) == target else -0.1


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------ token-exact trajectories
def test_observations_are_chat_frames_tokenized_alone_and_the_trajectory_is_the_templates(url):
    env = make_env(url, max_concurrency=3)
    out = rollout(env, ROWS, guessing_policy)
    tokenizer = env.tokenizer
    feedback = {42: ["higher", "lower"], 50: ["higher"], 10: [], 99: ["higher", "higher"]}
    for i in range(8):
        target = ROWS["target"][i // 2]
        prompt, ids, turns, observations = parts(out, i)
        # The prompt: the row's, reset's text appended to its last message, rendered by the template.
        content = f"Guess {i // 2}.\n\nGuess the number."
        rendered = tokenizer.apply_chat_template(question(content), tokenize=False, add_generation_prompt=True)
        assert prompt == ids_of(tokenizer, rendered)
        # Each observation: the template's user message frame (after the turn's end token), tokenized on its own.
        assert [tokenizer.decode(o) for o in observations] == [
            f"\n<|im_start|>user\n{word}<|im_end|>\n<|im_start|>assistant\n" for word in feedback[target]
        ]
        for observation in observations:
            assert observation == ids_of(tokenizer, tokenizer.decode(observation))
        assert [tokenizer.decode(t) for t in turns] == [g + END for g in GUESSES[: len(turns)]]
        # The whole trajectory is the template's rendering of the conversation: no re-tokenization drift.
        conversation = question(content)
        for k in range(len(turns)):
            conversation.append({"role": "assistant", "content": GUESSES[k]})
            if k < len(observations):
                conversation.append({"role": "user", "content": feedback[target][k]})
        whole = tokenizer.apply_chat_template(conversation, tokenize=False)
        assert prompt + ids == ids_of(tokenizer, whole.removesuffix("\n"))
    # Each step's reward is the reward part "openenv": -0.1 per wrong guess, 1 for the right one.
    assert out.env_rewards["openenv"] == pytest.approx([0.8, 0.8, 0.9, 0.9, 1.0, 1.0, -0.3, -0.3])
    assert out.stats["turns"] == [3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 3.0, 3.0]
    assert out.stats["openenv_retries"] == [0.0] * 8
    assert env.backend.sessions == set()  # every trajectory's session closed when it ended
    env.close()


def test_stepping_three_at_a_time_gives_the_trajectories_of_one_at_a_time(url):
    """8 trajectories stepped by 3 workers (each step sleeps 50 ms on the server, so they overlap) equal the same
    rollout stepped one at a time: ids, rewards, turn counts, transcripts."""
    results, most = {}, {}
    for workers in (1, 3):
        openenv_guess.STATS["most_in_flight"] = 0
        env = make_env(url, max_concurrency=workers)
        results[workers] = rollout(env, ROWS, lambda context: guessing_policy(context, " sleep:0.05"))
        most[workers] = openenv_guess.STATS["most_in_flight"]
        env.close()
    one, three = results[1], results[3]
    assert most == {1: 1, 3: 3}  # one at a time, then up to (and no more than) max_concurrency at once
    assert torch.equal(one.completions.completion_ids, three.completions.completion_ids)
    assert torch.equal(one.action_mask, three.action_mask)
    assert one.env_rewards == three.env_rewards and one.stats == three.stats and one.transcripts == three.transcripts


def test_a_tiny_model_plays_several_turns_with_plain_frames(url):
    """The demo's tiny-calc model (no chat template: plain frames) guesses products; the server's feedback is
    appended as its own tokens, and the model's next turn continues the trajectory's tokens."""
    from transformers import AutoModelForCausalLM

    from grpo_lightning.models.build import load_tokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval(), load_tokenizer(TINY_CALC)
    engine = LeanEngine()
    engine.setup(model, tokenizer)
    prompts = ["123*456=", "5071*938=", "2222*3333=", "640*1212="]
    rows = {"prompt": prompts, "target": [eval(p[:-1]) for p in prompts]}  # noqa: S307 - the test's own literals
    env = make_env(url, observe_reset=False, max_turns=4, max_turn_tokens=24, max_concurrency=4)
    out = generate_trajectories(
        rows,
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        environment=env,
        params=SamplingParams(group_size=4, max_new_tokens=96),
        generator=torch.Generator().manual_seed(0),
    )
    env.close()
    assert env.frame is not None and not env.frame.chat
    assert max(out.stats["turns"]) >= 2  # real multi-turn trajectories
    seen = set()
    for i in range(16):
        prompt, ids, turns, observations = parts(out, i)
        assert prompt == tokenizer([prompts[i // 4]])["input_ids"][0]
        for observation in observations:
            text = tokenizer.decode(observation)
            seen.add(text)
            assert text in ("higher", "lower", "say a number") and observation == ids_of(tokenizer, text)
        assert all(turn[-1] == tokenizer.eos_token_id for turn in turns[: len(observations)])  # each ended
        # The server's reward for each turn (the final one too), summed into the reward part.
        target = rows["target"][i // 4]
        expected = sum(guess_reward(tokenizer.decode(turn, skip_special_tokens=True), target) for turn in turns)
        assert out.env_rewards["openenv"][i] == pytest.approx(expected)
    assert seen  # the server answered at least one turn with feedback


# ------------------------------------------------------------------------------------------------- faults
def one_line_error(kind, call) -> str:
    with pytest.raises(kind) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("data.environment")
    return message


def test_a_refused_connection_is_retried_then_one_line_naming_the_url():
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = make_env(address, max_retries=1, timeout_s=1.0)
    started = time.perf_counter()
    message = one_line_error(RuntimeError, lambda: env.setup(qwen_tokenizer()))  # checked before training
    assert address in message and "after 2 tries" in message and "refused" in message.lower()
    assert time.perf_counter() - started < 5


def test_a_step_past_timeout_s_is_retried_then_one_line(url):
    env = make_env(url, max_retries=1, timeout_s=0.3)
    env.setup(qwen_tokenizer())
    trajectory = env.spawn()
    trajectory.reset({"prompt": question("Guess."), "target": 5})
    started = time.perf_counter()
    message = one_line_error(RuntimeError, lambda: trajectory.step("sleep:1.5 3"))
    assert url in message and "failed to step after 2 tries (no answer within timeout_s = 0.3s)" in message
    assert time.perf_counter() - started < 5  # two tries of 0.3 s and a pause (the server sleeps 1.5 s a step)
    env.close()


def test_a_crashing_environment_is_retried_then_one_line_with_its_error(url):
    env = make_env(url, max_retries=1)
    env.setup(qwen_tokenizer())
    message = one_line_error(RuntimeError, lambda: rollout(env, ROWS, lambda context: "crash" + END))
    assert url in message and "the environment crashed" in message and "after 2 tries" in message
    assert env.backend.sessions == set()  # the failed sessions were dropped, not left open
    env.close()


def test_a_transient_fault_is_recovered_by_replaying_the_trajectory_on_a_new_session(url):
    """The second turn fails once (a new session answers it): replayed from reset, the trajectory goes on as if
    nothing happened, and the retry is counted."""
    openenv_guess.STATS["flaky_failed"] = False
    rows = {"prompt": [question("Guess 0.")], "target": [42]}
    env = make_env(url, max_concurrency=2)
    out = rollout(env, rows, lambda context: guessing_policy(context, " flaky" if "higher" in context else ""))
    env.close()
    clean = make_env(url)
    reference = rollout(clean, rows, lambda context: guessing_policy(context, " flaky" if "higher" in context else ""))
    clean.close()
    # One of the two trajectories (stepped at once: whichever came first) retried its second turn, once.
    assert sorted(out.stats["openenv_retries"]) == [0.0, 1.0] and openenv_guess.STATS["flaky_failed"]
    assert out.env_rewards == reference.env_rewards == {"openenv": [pytest.approx(0.8)] * 2}
    assert torch.equal(out.completions.completion_ids, reference.completions.completion_ids)


def test_a_replay_that_answers_differently_is_one_line_not_a_silent_new_episode(url):
    """Without a target, reset draws a puzzle at random: a session replayed after a fault starts another one."""
    openenv_guess.STATS["flaky_failed"] = False
    env = make_env(url, reset_columns=[])
    env.setup(qwen_tokenizer())
    trajectory = env.spawn()
    trajectory.reset({"prompt": question("Guess.")})
    trajectory.step("I say 3")
    message = one_line_error(RuntimeError, lambda: trajectory.step("flaky 4"))
    assert "not deterministic" in message and "reset_columns" in message
    env.close()


def test_a_server_at_capacity_says_how_many_sessions_it_needs():
    with served(openenv_guess.small_app) as address:  # room for 2 sessions; a round here has 4 trajectories
        env = make_env(address, max_retries=0)
        message = one_line_error(
            RuntimeError, lambda: rollout(env, {k: v[:2] for k, v in ROWS.items()}, guessing_policy)
        )
        env.close()
    assert address in message and "max_concurrent_envs" in message


# ------------------------------------------------------------------------------------------------- settings
def test_settings_the_server_does_not_know_are_refused_before_training(url):
    env = make_env(url, action_field="text")
    with pytest.raises(
        ConfigError, match=r"init_args.action_field: the server's action has no field 'text'; it has message"
    ):
        env.setup(qwen_tokenizer())
    env = make_env(url, observation_field="answer")
    with pytest.raises(ConfigError, match=r"init_args.observation_field: .* no field 'answer'; it has feedback"):
        env.setup(qwen_tokenizer())
    env = make_env(url, max_observation_tokens=20)  # the Qwen frame and "...": 23 tokens (special ones whole)
    with pytest.raises(ConfigError, match=r"max_observation_tokens = 20 cannot hold .* set it to at least 23$"):
        env.setup(qwen_tokenizer())


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "give url .* or server"),
        ({"url": "http://x:1", "server": "a.b:app"}, "give url .* or server"),
        ({"url": "localhost:8000"}, "url must be http://host:port"),
        ({"server": ["python", "serve.py"]}, r"write \{port\} where the command takes its port"),
        ({"url": "http://x:1", "client": "collections:OrderedDict"}, "is not an OpenEnv client class"),
        ({"url": "http://x:1", "client": "no_such_module:Env"}, "cannot import 'no_such_module:Env'"),
        ({"url": "http://x:1", "max_concurrency": 0}, "max_concurrency must be an integer >= 1"),
        ({"url": "http://x:1", "timeout_s": 0}, "timeout_s must be > 0"),
        ({"url": "http://x:1", "frame": "html"}, "frame must be one of auto, chat_template, plain"),
    ],
)
def test_bad_settings_are_one_line_naming_the_field(kwargs, expected):
    with pytest.raises(ConfigError, match=expected) as caught:
        OpenEnvEnvironment(**kwargs)
    assert "\n" not in str(caught.value)


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core.env_client", None)  # an import of it fails, as when missing
    with pytest.raises(ConfigError, match=r'needs the openenv package .*pip install -e "\.\[openenv\]"'):
        OpenEnvEnvironment(url="http://x:1")


class TypedGuessClient(EnvClient[openenv_guess.GuessAction, openenv_guess.GuessObservation, State]):
    """The guessing environment's own client, as an OpenEnv environment ships one: typed actions and observations."""

    def _step_payload(self, action: openenv_guess.GuessAction) -> dict:
        return {"message": action.message}

    def _parse_result(self, payload: dict) -> StepResult:
        observation = openenv_guess.GuessObservation(**payload.get("observation", {}))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


def test_a_typed_client_sends_its_action_class_and_reads_its_observations(url):
    env = make_env(url, client=f"{__name__}:TypedGuessClient")
    assert env.action_class is openenv_guess.GuessAction  # from EnvClient[GuessAction, ...]
    assert env.make_action("guess 3") == openenv_guess.GuessAction(message="guess 3")
    out = rollout(env, {k: v[:2] for k, v in ROWS.items()}, guessing_policy, group=1)
    env.close()
    assert out.env_rewards["openenv"] == pytest.approx([0.8, 0.9])
    assert "<|im_start|>user\nhigher<|im_end|>" in out.transcripts[0]
    env.action_field = "text"
    with pytest.raises(ConfigError, match=r"action_field: GuessAction\(text=<turn text>\) fails"):
        env.make_action("guess 3")


# ------------------------------------------------------------------------------------------ a server of the run's own
def gone(pid: int, within_s: float = 10.0) -> bool:
    """The process group ``pid`` leads has no process left (waited for up to ``within_s``)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_server_the_run_starts_serves_rollouts_a_killed_one_is_one_line_and_close_leaves_nothing():
    env = make_env(None, server="openenv_guess:app", startup_timeout_s=120)
    two_rows = {k: v[:2] for k, v in ROWS.items()}
    out = rollout(env, two_rows, guessing_policy)  # the first reset starts the server
    assert out.env_rewards["openenv"] == pytest.approx([0.8, 0.8, 0.9, 0.9])
    server = env.backend.server
    process, log = server.process, server.log
    assert process.poll() is None and server.url.startswith("http://127.0.0.1:")
    # Pickled into a background rollout process (data.schedule.rollout_lag): a fresh backend there, which starts its
    # own.
    copy = pickle.loads(pickle.dumps(env))
    assert copy.backend.server.process is None and copy.backend.server_argv == env.backend.server_argv

    def killing_policy(context: str) -> str:  # kills the server before the trajectories' second turn is stepped
        if "higher" in context and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        return guessing_policy(context)

    message = one_line_error(RuntimeError, lambda: rollout(env, two_rows, killing_policy))
    assert f"the OpenEnv server the run started at {server.url} exited with code -9" in message
    env.close()
    assert gone(process.pid) and log.closed and server.log is None


def test_close_stops_a_server_and_one_whose_parent_is_killed_stops_with_it(tmp_path):
    """``LocalServer`` with a plain HTTP server: ``stop`` ends it; a process killed with SIGKILL (no atexit, no
    close) takes its server with it (the parent-death signal)."""
    from grpo_lightning.integrations.environments.local_server import LocalServer

    command = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "{port}", "--directory", str(tmp_path)]
    server = LocalServer(command, "test")
    server.start()
    pid = server.process.pid
    server.stop()
    assert gone(pid)
    child = textwrap.dedent(
        f"""
        import os, signal, sys
        from grpo_lightning.integrations.environments.local_server import LocalServer
        server = LocalServer({command!r}, "test")
        server.start()
        print(server.process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert gone(int(run.stdout.strip()))


def test_a_yaml_config_names_the_environment_by_class_path(tmp_path, monkeypatch, url):
    """``data.environment`` from YAML: a running server by URL, and a server command as a list (``{port}`` in it)."""
    from helpers import save_tiny_llama

    from grpo_lightning.cli import GRPOCLI
    from grpo_lightning.models.tiny import TinyModelConfig

    monkeypatch.chdir(tmp_path)
    model = save_tiny_llama(
        tmp_path / "model", TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2), qwen_tokenizer()
    )
    (tmp_path / "rows.jsonl").write_text('{"prompt": "Guess.", "target": 3}\n')

    def environment(init_args: str) -> OpenEnvEnvironment:
        (tmp_path / "run.yaml").write_text(
            f"""
trainer: {{accelerator: cpu, max_epochs: 1, logger: false}}
model: {{model_name_or_path: {model}}}
data:
  dataset: rows.jsonl
  rewards: [{{name: helpers.length_reward}}]
  environment: {{class_path: grpo_lightning.integrations.environments.OpenEnvEnvironment, init_args: {init_args}}}
"""
        )
        return GRPOCLI(args=["--config", "run.yaml"], run=False).datamodule.environment

    by_url = environment(f"{{url: {url}, reset_columns: [target], max_concurrency: 4}}")
    assert isinstance(by_url, OpenEnvEnvironment) and by_url.backend.fixed_url == url
    assert by_url.reset_columns == ["target"] and by_url.max_concurrency == 4 and by_url.backend.server is None
    started = environment('{server: [python, -m, uvicorn, "openenv_guess:app", --port, "{port}"], max_retries: 0}')
    assert started.backend.server_argv == ["python", "-m", "uvicorn", "openenv_guess:app", "--port", "{port}"]
    assert started.backend.server.process is None and started.max_retries == 0  # started by the first reset


def test_a_server_that_exits_at_start_is_one_line_with_its_last_output():
    from grpo_lightning.integrations.environments.local_server import LocalServer

    command = [sys.executable, "-c", "import sys; print('no such model: x'); sys.exit(3)", "{port}"]
    with pytest.raises(RuntimeError) as caught:
        LocalServer(command, "test").start()
    assert str(caught.value).endswith("exited with code 3; its last output: no such model: x")
