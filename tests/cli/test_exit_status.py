"""A fault the user can fix ends the run with one ``error:`` line and the exit status of its kind (docs/checkpoints.md,
Exit status; ``grpo_lightning/errors.py``), through the CLI's entry point ``main``: a teacher or dataset path that is no
model or dataset (2), a served teacher or a vLLM server that is down (3). The OpenEnv faults (3 and 4) run in
``tests/environments/test_openenv_exit_status.py``; a run stopped by non-finite values (1) in
``tests/runs/test_crash.py``; bad settings (2) in ``test_bad_inputs.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from test_bad_inputs import BASE, error_lines

from grpo_lightning import GRPOModule
from grpo_lightning.cli import main
from grpo_lightning.errors import EXIT_CODES
from grpo_lightning.integrations.environments.local_server import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """``run(*flags, config=edits)``: ``cli_run``'s function."""
    return cli_run(tmp_path, monkeypatch, capsys)


def cli_run(tmp_path, monkeypatch, capsys):
    """``fit(*flags, config=edits)``: ``main(fit ...)`` on the catalogue's base config with ``edits`` (dotted keys),
    which must stop before any training step; its exit status and its ``error:`` lines."""

    def no_training(*_args, **_kwargs):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(GRPOModule, "training_step", no_training)
    monkeypatch.chdir(tmp_path)

    def fit(*flags: str, config: dict | None = None) -> tuple[int, list[str]]:
        settings = json.loads(json.dumps(BASE))
        for key, value in (config or {}).items():
            *parents, leaf = key.split(".")
            node = settings
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(settings))
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(tmp_path / "config.yaml"), *flags])
        err = capsys.readouterr().err
        assert "Traceback" not in err, err[-3000:]
        return exit_info.value.code, error_lines(err)

    return fit


def down() -> str:
    """A loopback URL nothing listens on (a refused connection)."""
    return f"http://127.0.0.1:{free_port()}"


# --------------------------------------------------------------------------------------------- 2: paths
def test_a_teacher_path_that_is_no_model_is_one_line_with_status_2(run):
    code, lines = run("--model.teacher.model_name_or_path", "no/such/teacher")
    assert code == 2
    assert lines == [
        "error: model.teacher.model_name_or_path: no such local folder 'no/such/teacher' (nor is it a Hub model name)"
    ]


def test_a_teacher_the_hub_cannot_give_is_one_line_with_status_2(run, monkeypatch):
    import transformers

    def offline(name, *_args, **_kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}.\nCheck your connection.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    code, lines = run("--model.teacher.model_name_or_path", "some-org/some-teacher")
    assert code == 2
    assert lines == [
        "error: model.teacher.model_name_or_path: cannot load 'some-org/some-teacher' (there is no local folder of "
        "that name either): We couldn't connect to 'https://huggingface.co' to load some-org/some-teacher."
    ]


def test_a_dataset_the_hub_cannot_give_is_one_line_with_status_2(run, monkeypatch):
    from grpo_lightning.rollout import prompts

    def offline(source, *_args, **_kwargs):
        raise ConnectionError(f"Couldn't reach '{source}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(prompts, "load_dataset", offline)
    code, lines = run("--data.dataset", "some-org/some-dataset", "--data.task_kwargs", "null")
    assert code == 2
    assert lines == [
        "error: data.dataset: cannot load 'some-org/some-dataset' (no local file or folder of that name either): "
        "Couldn't reach 'some-org/some-dataset' on the Hub (LocalEntryNotFoundError)"
    ]


def test_a_dataset_folder_without_data_files_is_one_line_with_status_2(run, tmp_path):
    folder = tmp_path / "not_a_dataset"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"\0")
    code, lines = run("--data.dataset", str(folder), "--data.task_kwargs", "null")
    assert code == 2
    assert lines == [f"error: data.dataset: cannot load '{folder}': No (supported) data files found in {folder}"]


# --------------------------------------------------------------------------------------------- 3: services
def test_a_served_teacher_that_is_down_is_one_line_with_status_3(run):
    url = down()
    code, lines = run("--model.teacher.url", url, "--model.teacher.retries", "0")
    assert code == 3
    assert len(lines) == 1 and lines[0].startswith(f"error: the vLLM server {url} is unreachable (")
    assert lines[0].endswith("on GET /v1/models")


def test_a_vllm_server_that_is_down_is_one_line_with_status_3(run):
    url = down()
    engine = {
        "class_path": "grpo_lightning.integrations.vllm.server.VLLMServerEngine",
        "init_args": {"base_urls": [url], "connect_timeout_s": 1},
    }
    code, lines = run(config={"data.engine": engine})
    assert code == 3
    assert len(lines) == 1 and lines[0].startswith(f"error: data.engine: the vLLM server {url} did not answer (")
    assert "data.engine.init_args.base_urls" in lines[0]


# --------------------------------------------------------------------------------------------- the docs
def test_the_readme_and_main_document_each_exit_status():
    """docs/checkpoints.md's table and ``main``'s docstring give each error class the status it exits with."""
    page = (ROOT / "docs" / "checkpoints.md").read_text()
    section = page.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d) \| [^|]* \| ([^|]*) \|$", section, flags=re.MULTILINE)
    documented = {name: int(code) for code, names in rows for name in re.findall(r"`(\w+)`", names)}
    assert {name: documented.get(name) for name in EXIT_CODES} == EXIT_CODES
    for name, code in EXIT_CODES.items():
        assert re.search(rf"- {code}: [^\n]*(\n      [^\n]*)*``{name}``", main.__doc__), name
