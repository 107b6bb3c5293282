"""The core reaches the teacher, SFT, vLLM's engines and the integrations' rewards through plug-in paths only
(``grpo_lightning.plugins.load_plugin``): importing the command line or the module imports none of them; each is
imported when a run names it (``python -m grpo_lightning sft ...``, ``model.teacher``, ``data.engine: vllm``, a
reward ``code_execution``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from grpo_lightning import cli
from grpo_lightning.plugins import load_plugin

# The integration modules whose entry points these registries hold (``rewards.sandbox``, which ``code_execution``
# runs, is also a tool environment's: not listed here).
PLUGGED_IN = (
    "grpo_lightning.integrations.distillation.teacher",
    "grpo_lightning.integrations.distillation.served_teacher",
    "grpo_lightning.integrations.sft",
    "grpo_lightning.integrations.vllm.engine",
    "grpo_lightning.integrations.vllm.server",
    "grpo_lightning.integrations.sandbox.code",
    "grpo_lightning.integrations.reasoning_gym.rewards",
)


def loaded_after(code: str) -> dict[str, list[str]]:
    """Which of ``PLUGGED_IN`` a fresh interpreter has imported at each ``mark(label)`` of ``code``."""
    header = f"""
import json, sys
PLUGGED_IN, seen = {PLUGGED_IN!r}, {{}}
def mark(label):
    seen[label] = [name for name in PLUGGED_IN if name in sys.modules]
"""
    program = header + textwrap.dedent(code) + "\nprint(json.dumps(seen))\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_cli_and_the_module_imports_no_plugged_in_integration():
    seen = loaded_after(
        """
        import grpo_lightning.cli, grpo_lightning.module, grpo_lightning.engines
        mark("imported")
        from grpo_lightning import rewards
        rewards.get("exact_answer"), rewards.available()
        mark("a core reward")
        rewards.get("code_execution")
        mark("code_execution")
        """
    )
    assert seen["imported"] == []
    assert seen["a core reward"] == []
    assert seen["code_execution"] == ["grpo_lightning.integrations.sandbox.code"]


def test_the_sft_subcommand_comes_from_the_table_of_integration_commands():
    assert cli.SUBCOMMANDS == {"sft": "grpo_lightning.integrations.sft:SFTCLI"}
    sft_cli = load_plugin(cli.SUBCOMMANDS["sft"])
    assert cli.SFTCLI is sft_cli and issubclass(sft_cli, cli.GRPOCLI)  # importable from the CLI as before
    assert not sft_cli.epochs_are_rounds and cli.GRPOCLI.epochs_are_rounds
    with pytest.raises(AttributeError, match="no attribute 'NoSuchCLI'"):
        cli.NoSuchCLI  # noqa: B018


def test_an_unknown_sft_setting_is_refused_as_before(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["sft", "fit", "--model.no_such_setting", "1"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: unknown setting 'model.no_such_setting'")


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("code_execution", "grpo_lightning.integrations.sandbox.code"),
        ("reasoning_gym", "grpo_lightning.integrations.reasoning_gym.rewards"),
    ],
)
def test_the_integrations_rewards_are_listed_and_resolve_to_their_functions(name, module):
    from grpo_lightning import rewards

    assert name in rewards.available()
    assert rewards.get(name).__module__ == module
