"""kill -9, or SIGTERM to the whole job, in the middle of a background generation (``data.schedule.rollout_lag:
1``), then
``--ckpt_path last``: the run ends with the weights of an uninterrupted one.

The quickstart's command line, 5 rounds, a checkpoint every round. A reward of weight 0 counts the worker's
generations in a file and, in the interrupted run, sleeps in one of them (the 5th: round 4's, sampled while round 3
updates) until the test has sent its signal. kill -9 of the trainer takes the background process with it. A
SIGTERM sent to the process group (as SLURM or a terminal's Ctrl-C do) reaches both: the background process leaves
it to the trainer, which finishes its round (or, when the signal finds it still at the round boundary, abandons
the round not yet begun), waits for the round in flight, saves and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # about a minute a test: the slow tier (`pytest -m slow`, .ci/run)

ROOT = Path(__file__).resolve().parents[2]
ROUNDS, KILL_AT_CALL = 5, 5
LAST = Path("runs/quickstart/checkpoints/last.ckpt")


def counting_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Weight 0: appends a line per call to ``$GRPO_TEST_CALLS``; sleeps at call ``$GRPO_TEST_SLOW_AT``."""
    with open(os.environ["GRPO_TEST_CALLS"], "a") as calls:
        calls.write("call\n")
    count = len(Path(os.environ["GRPO_TEST_CALLS"]).read_text().splitlines())
    if os.environ.get("GRPO_TEST_SLOW_AT") == str(count):
        time.sleep(float(os.environ.get("GRPO_TEST_SLOW_S", "120")))
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


def start(cwd: Path, *args: str, slow: float = 0.0) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "every_round.yaml").write_text(EVERY_ROUND)
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ["PYTHONPATH"]]),  # the test folders (conftest)
        # The default threads of a 2-core machine (the suite's own are 1): at lag 1 one for the background process,
        # one for the update. Passive waiting: two fits run side by side (OpenMP's spinning would slow both).
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        "OMP_WAIT_POLICY": "PASSIVE",
        "GRPO_TEST_CALLS": str(cwd / "calls.txt"),
        "GRPO_TEST_SLOW_AT": str(KILL_AT_CALL) if slow else "",
        "GRPO_TEST_SLOW_S": str(slow),
    }
    command = [sys.executable, "-m", "grpo_lightning", "fit", "--config", str(ROOT / "configs/quickstart.yaml")]
    model = str(ROOT / "grpo_lightning/assets/tiny-arith")
    command += ["--config", "every_round.yaml", "--model.model_name_or_path", model]
    command += ["--trainer.max_epochs", str(ROUNDS), "--trainer.logger", "false", "--trainer.enable_progress_bar"]
    command += ["false", "--trainer.check_val_every_n_epoch", "100", *args]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


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


class Reference:
    """The uninterrupted run, started at once and waited for only when its weights are needed (it runs beside the
    first interrupted run)."""

    def __init__(self, root: Path) -> None:
        self.root, self.run, self.final = root, start(root), None

    def weights(self) -> dict[str, torch.Tensor]:
        if self.final is None:
            output, _ = self.run.communicate(timeout=300)
            assert self.run.returncode == 0, output[-3000:]
            self.final = weights(self.root / LAST)
        return self.final


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("reference"))


def interrupt(tmp_path: Path, send, *args: str) -> subprocess.Popen:
    """Start the run (``args`` added) slowed at the 5th generation, wait until the worker is inside it, call
    ``send(run)``."""
    run = start(tmp_path, *args, slow=3.0)
    calls = tmp_path / "calls.txt"
    deadline = time.monotonic() + 300
    while not (calls.exists() and len(calls.read_text().splitlines()) >= KILL_AT_CALL):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0][-3000:]
        time.sleep(0.2)
    send(run)
    return run


def resume_and_compare(tmp_path: Path, reference: Reference) -> None:
    resumed = start(tmp_path, "--ckpt_path", "last")
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    final, expected = weights(tmp_path / LAST), reference.weights()
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)


def test_kill_9_mid_generation_then_resume_equals_an_uninterrupted_run(reference, tmp_path):
    workers: list[int] = []

    def kill(run: subprocess.Popen) -> None:
        workers.extend(children(run.pid))
        os.kill(run.pid, signal.SIGKILL)

    run = interrupt(tmp_path, kill)
    run.communicate()
    assert workers, "no background process"
    time.sleep(2)
    assert not [w for w in workers if alive(w)], "the background process outlived the trainer"
    resume_and_compare(tmp_path, reference)


def test_sigterm_to_the_whole_job_saves_and_stops_then_resume_equals_an_uninterrupted_run(reference, tmp_path):
    run = interrupt(tmp_path, lambda run: os.killpg(run.pid, signal.SIGTERM))
    output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output[-3000:]
    # Which of the two stops it takes is a race: the signal lands during an update (finish it, save that round) or,
    # on a loaded machine, while the trainer is still at the round boundary (abandon the round not yet begun, save
    # the one before). Both must resume exactly (both were seen: 2 of 3 and 1 of 3 runs under a 2-core load).
    assert "SIGTERM: stopping after round" in output or "SIGTERM during the rollout of round" in output, output[-3000:]
    resume_and_compare(tmp_path, reference)
