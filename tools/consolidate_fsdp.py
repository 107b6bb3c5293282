"""Consolidate a GRPO checkpoint saved under FSDP2 (a sharded folder) into a Hugging Face model folder.

    python tools/consolidate_fsdp.py runs/gsm8k/checkpoints/last.ckpt runs/gsm8k/hf [--dtype bfloat16]

``FSDP2Strategy`` / ``ModelParallelStrategy`` save a checkpoint as a folder: one shard file per rank (PyTorch
distributed checkpoint format) plus ``meta.pt`` (hyperparameters, loop state). This script rebuilds the module
from the saved hyperparameters, reads the policy's shards into it in one process (no process group, no GPU; one
full copy of the policy in memory) and exports it as ``tools/export_hf.py`` does (LoRA adapters merged, tokenizer
and generation config alongside). A single-file ``.ckpt`` (DDP, one device) is handed to ``export_hf.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from grpo_lightning.module import GRPOModule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is a folder of scripts, not a package
from export_hf import export_checkpoint, export_module  # noqa: E402

_PREFIX = "policy."


def _load_sharded(path: Path, state: dict[str, torch.Tensor]) -> tuple[set[str], dict[str, torch.dtype]]:
    """Fill ``state`` (policy keys, tensors of the module) in place from the sharded checkpoint at ``path``.

    Returns the keys found and the dtype each was saved in.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    present = {key: tensor for key, tensor in state.items() if f"state_dict.{key}" in saved}
    # Partial load: weights tied to another key (lm_head ↔ embed_tokens) may be stored under one name only.
    dcp.load(
        {"state_dict": present},
        checkpoint_id=str(path),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    dtypes = {key: saved[f"state_dict.{key}"].properties.dtype for key in present}
    return set(present), dtypes


def _module_of(meta: dict) -> GRPOModule:
    """The module the checkpoint's hyperparameters describe, its policy built, weights not loaded yet.

    Built as ``load_from_checkpoint`` builds it, from a file holding the checkpoint's meta data and no weights: a
    checkpoint of the command line holds its settings as the config gave them (dicts) and the instantiator that
    makes them objects again, which Lightning applies there.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "meta.ckpt"
        torch.save({**meta, "state_dict": {}}, path)
        with warnings.catch_warnings():  # every weight is "missing" from that file: they come from the shards
            warnings.simplefilter("ignore")
            return GRPOModule.load_from_checkpoint(path, map_location="cpu", weights_only=False, strict=False)


def consolidate(checkpoint: str | Path, output: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write the policy of ``checkpoint`` (sharded folder or single file) as a Hugging Face folder ``output``.

    ``dtype`` defaults to the dtype the weights were trained in.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():  # a single-file checkpoint holds full weights already
        return export_checkpoint(checkpoint, output, dtype=str(dtype).removeprefix("torch.") if dtype else None)
    # Unpickled in full, as Lightning resumes: the hyperparameters hold the run's config objects.
    meta = torch.load(checkpoint / "meta.pt", map_location="cpu", weights_only=False)
    module = _module_of(meta)
    # The module's own tensors, keyed as in the checkpoint; loading writes into them.
    state = {key: value for key, value in module.state_dict(keep_vars=False).items() if key.startswith(_PREFIX)}
    found, dtypes = _load_sharded(checkpoint, state)
    loaded_storage = {state[key].untyped_storage().data_ptr() for key in found}
    missing = [k for k in state if k not in found and state[k].untyped_storage().data_ptr() not in loaded_storage]
    if missing:
        raise SystemExit(f"{checkpoint} lacks {len(missing)} policy weights, e.g. {missing[:3]}")
    if dtype is None:  # as trained: the dtype most weights were saved in
        dtype = max(set(dtypes.values()), key=list(dtypes.values()).count) if dtypes else torch.float32
    module.policy.config.use_cache = True  # gradient checkpointing turned it off for training
    # export_hf.export_module: LoRA adapters merged, tokenizer and generation config written alongside.
    sampling = (meta.get("RolloutDataModule") or {}).get("sampling")
    return export_module(module, output, dtype=str(dtype).removeprefix("torch."), sampling=sampling)


def main() -> None:
    """Command line: ``consolidate_fsdp.py CHECKPOINT OUTPUT [--dtype float32|bfloat16|float16]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a sharded checkpoint folder (or a single-file .ckpt)")
    parser.add_argument("output", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: as trained")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    print(f"wrote {consolidate(args.checkpoint, args.output, dtype=dtype)}")


if __name__ == "__main__":
    main()
