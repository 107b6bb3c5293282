"""kill -9 in the middle of a background generation (``data.rollout_lag: 1``), then ``--ckpt_path last``: the run
ends with the weights of an uninterrupted one, and the background process dies with the trainer.

The quickstart's command line, 5 rounds, a checkpoint every round. A reward of weight 0 counts the worker's
generations in a file and, in the killed run, sleeps in the 5th (round 4's, sampled while round 3 updates): the
test kills the trainer while the worker is inside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, KILL_AT_CALL = 5, 5
LAST = Path("runs/quickstart/checkpoints/last.ckpt")


def counting_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Weight 0: appends a line per call to ``$GRPO_TEST_CALLS``; sleeps at call ``$GRPO_TEST_SLOW_AT``."""
    with open(os.environ["GRPO_TEST_CALLS"], "a") as calls:
        calls.write("call\n")
    count = len(Path(os.environ["GRPO_TEST_CALLS"]).read_text().splitlines())
    if os.environ.get("GRPO_TEST_SLOW_AT") == str(count):
        time.sleep(120)
    return [0.0] * len(completions)


EVERY_ROUND = """
trainer:
  callbacks:
    - class_path: grpo_lightning.callbacks.RoundCheckpoint
      init_args: {every_n_rounds: 1}
data:
  rollout_lag: 1
  rewards:
    - {name: exact_answer}
    - {name: test_async_kill.counting_reward, weight: 0.0}
"""


def start(cwd: Path, *args: str, slow: bool = False) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "every_round.yaml").write_text(EVERY_ROUND)
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
        "GRPO_TEST_CALLS": str(cwd / "calls.txt"),
        "GRPO_TEST_SLOW_AT": str(KILL_AT_CALL) if slow else "",
    }
    command = [sys.executable, "-m", "grpo_lightning", "fit", "--config", str(ROOT / "configs/quickstart.yaml")]
    model = str(ROOT / "grpo_lightning/assets/tiny-arith")
    command += ["--config", "every_round.yaml", "--model.model_name_or_path", model]
    command += ["--trainer.max_epochs", str(ROUNDS), "--trainer.logger", "false", "--trainer.enable_progress_bar"]
    command += ["false", "--trainer.check_val_every_n_epoch", "100", *args]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.")}


def test_kill_9_mid_generation_then_resume_equals_an_uninterrupted_run(tmp_path):
    reference, killed = start(tmp_path / "reference"), start(tmp_path / "killed", slow=True)
    calls = tmp_path / "killed" / "calls.txt"
    deadline = time.monotonic() + 300
    while not (calls.exists() and len(calls.read_text().splitlines()) >= KILL_AT_CALL):
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()[0][-3000:]
        time.sleep(0.2)
    workers = children(killed.pid)
    assert workers, "no background process"
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate()
    time.sleep(2)
    assert not [w for w in workers if alive(w)], "the background process outlived the trainer"
    resumed = start(tmp_path / "killed", "--ckpt_path", "last")
    for run in (reference, resumed):
        output, _ = run.communicate(timeout=300)
        assert run.returncode == 0, output[-3000:]
    a, b = weights(tmp_path / "reference" / LAST), weights(tmp_path / "killed" / LAST)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
