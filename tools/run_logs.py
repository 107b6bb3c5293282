"""Read a run's local logs back: an offline (or synced) W&B run directory, or a ``CSVLogger``'s ``metrics.csv``.

wandb 0.31 writes ``run-<id>.wandb`` from its Go core and ships no Python reader, so this module reads the file
itself: a 7-byte header (``:W&B``, magic, version) then LevelDB-log records (32 KiB blocks; each chunk has a
4-byte checksum, a 2-byte length and a type: full, first, middle, last) whose payloads are
``wandb.proto.wandb_internal_pb2.Record`` messages. Checksums are not verified (CRC-32C is not in the stdlib).
"""

from __future__ import annotations

import csv
import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # b":W&B" + 2-byte magic + 1-byte version
_CHUNK_HEADER = 7  # checksum (4) + length (2) + type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
STEP = "trainer/global_step"


@dataclass
class RunLog:
    """A run's logged rows, config, W&B tables and artifacts (the last two only for W&B runs)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # key → {"columns": [...], "data": [[...]]}
    artifacts: list[tuple[str, str]] = field(default_factory=list)  # (name, type)
    finished: bool = True  # False for a W&B run whose file has no exit record yet (running, or still being written)

    def keys(self) -> set[str]:
        """Every metric name logged at least once."""
        return {key for row in self.history for key in row}

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of ``key`` over the rows that hold a number for it."""
        steps, values = [], []
        for row in self.history:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                steps.append(float(row.get(STEP, row.get("_step", len(steps)))))
                values.append(float(value))
        return steps, values


def wandb_records(path: str | Path) -> Iterator[Any]:
    """The ``Record`` protos of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = _HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        payload = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0:  # preallocated zeros at the end of an unfinished file
            break
        pending = payload if kind in (_FULL, _FIRST) else pending + payload
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _set(target: dict[str, Any], key: str, nested: list[str], value_json: str) -> None:
    path = list(nested) or [key]
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = json.loads(value_json)


def read_wandb_run(path: str | Path) -> RunLog:
    """History, config, tables and artifacts of an offline W&B run (its directory or its ``.wandb`` file)."""
    path = Path(path)
    file = path if path.is_file() else _single(sorted(path.glob("run-*.wandb")), path)
    log = RunLog(finished=False)
    for record in wandb_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "exit":
            log.finished = True
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set(row, item.key, item.nested_key, item.value_json)
            log.history.append(row)
        elif kind in ("config", "run"):  # wandb.init(config=...) arrives inside the run record
            for item in (record.config if kind == "config" else record.run.config).update:
                if not (item.key or "").startswith("_wandb"):
                    _set(log.config, item.key, item.nested_key, item.value_json)
        elif kind == "artifact":
            log.artifacts.append((record.artifact.name, record.artifact.type))
    for row in log.history:  # a logged wandb.Table is a reference to a JSON file in the run's files/ folder
        for key, value in row.items():
            if isinstance(value, dict) and value.get("_type") == "table-file":
                table_file = file.parent / "files" / value["path"]
                if table_file.is_file():
                    log.tables[key] = json.loads(table_file.read_text())
    return log


def read_csv_metrics(path: str | Path) -> RunLog:
    """The rows of a ``CSVLogger`` ``metrics.csv`` (empty cells dropped; ``step`` also given as the W&B step)."""
    log = RunLog()
    with open(path, newline="") as handle:
        for raw in csv.DictReader(handle):
            row = {key: float(value) for key, value in raw.items() if key and value not in ("", None)}
            if "step" in row:
                row[STEP] = row["step"]
            log.history.append(row)
    return log


def _single(found: list[Path], where: Path) -> Path:
    if not found:
        raise FileNotFoundError(f"no run logs (run-*.wandb or metrics.csv) under {where}")
    return found[-1]


def find_run(path: str | Path) -> Path:
    """The log file behind ``path``: a ``.wandb`` or ``metrics.csv`` file itself, an offline W&B run directory, or
    a folder holding runs (the newest W&B run, else the newest ``metrics.csv`` below it)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no such file or directory: {path}")
    wandb_files = sorted(path.glob("run-*.wandb")) or sorted(
        path.glob("**/*run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime
    )
    if wandb_files:
        return wandb_files[-1]
    return _single(sorted(path.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime), path)


def load_run(path: str | Path, wait_s: float = 0.0) -> RunLog:
    """``read_wandb_run`` or ``read_csv_metrics``, whichever ``find_run(path)`` finds.

    ``wait_s``: wait up to this long for a W&B run to be complete. ``wandb.finish()`` can return before W&B's
    service process has written the run file out, so a run read right after it may still be empty.
    """
    file = find_run(path)
    if file.suffix != ".wandb":
        return read_csv_metrics(file)
    deadline = time.monotonic() + wait_s
    log = read_wandb_run(file)
    while not log.finished and time.monotonic() < deadline:
        time.sleep(0.2)
        log = read_wandb_run(file)
    return log
