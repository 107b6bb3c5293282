"""``AtomicCheckpointIO``: checkpoint files that are at every moment either the old or the new file.

A Lightning ``CheckpointIO`` plugin: ``Trainer(plugins=[AtomicCheckpointIO()])`` (the CLI gives it to every run
whose strategy writes single files). Each file is written to a temporary name in the same folder, fsynced and
renamed over the target: a kill mid-write leaves the previous checkpoint intact, and the temporary name never
matches ``last*.ckpt``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

_TMP_MARKER = ".tmp-"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file next to the target, fsync, then ``os.replace`` (atomic on POSIX).

    Lightning's own writer stages the bytes in memory and in the system temp folder, then moves them: a copy, not a
    rename, when that folder is on another file system, and nothing is fsynced. Remote paths (``s3://``...) keep
    Lightning's writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Write ``checkpoint`` to ``path`` so that ``path`` is at every moment either the old or the new file."""
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Same folder, so the rename cannot cross file systems; a name ending in neither .ckpt nor "last".
        tmp = target.parent / f".{target.name}{_TMP_MARKER}{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                self.before_sync(tmp)
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)  # the rename itself survives a power cut only once the folder is synced

    def before_sync(self, tmp: Path) -> None:
        """Called once the bytes are written to ``tmp``, before the fsync and the rename (a no-op; a subclass
        may wait here, e.g. to test a kill in the middle of a write)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_partial_checkpoints(dirpath: str | Path) -> list[Path]:
    """Delete the temporary files that a write killed mid-way left in ``dirpath``; returns what was removed."""
    folder = Path(dirpath)
    if not folder.is_dir():
        return []
    removed = [p for p in folder.glob(f".*{_TMP_MARKER}*") if p.is_file()]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed
