"""The names vLLM's loaders want for a vision-language model's weights, where transformers 5 names them otherwise.

transformers 5 flattened the CLIP and SigLIP vision models: a LLaVA tower's weights are
``vision_tower.embeddings.*``, ``vision_tower.encoder.*``, ... (in the folder it saves and in the model's own
names, which every weight push carries), where transformers 4 and vLLM 0.32 nest them one level down,
``vision_tower.vision_model.embeddings.*``. vLLM's LLaVA builds its tower as that nested module and refuses the
flat names ("There is no module or parameter named 'vision_tower.embeddings'"). Every other name is vLLM's
already: its LLaVA maps transformers 5's ``model.language_model.*``, ``model.multi_modal_projector.*`` and
``lm_head.*`` itself, and its CLIP / SigLIP loaders drop what its tower does not build (``post_layernorm``, whose
output LLaVA's features never take; SigLIP's pooling ``head``).

``vllm_name`` maps one name (the saved folder's ``vision_tower.*`` or the model's ``model.vision_tower.*``);
``vllm_load_problem`` names a tower weight it cannot map; ``vllm_model_folder`` writes a folder whose weights carry
vLLM's names when the model's own folder does not (the in-process engine starts vLLM from it);
``rename_for_vllm`` renames a saved folder's weights in place and ``copy_for_vllm`` copies a model folder so
renamed: the folder a user serves with ``vllm serve`` for the ``vllm_server`` engine (``tools/export_hf.py
--for-vllm``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The children of a tower that vLLM's LLaVA nests under ``vision_model`` (its CLIPVisionModel, SiglipVisionModel),
# by the tower config's model_type; a Pixtral tower is flat in both, so its names pass as they are.
NESTED_TOWERS = {
    "clip_vision_model": frozenset({"embeddings", "pre_layrnorm", "encoder", "post_layernorm"}),
    "siglip_vision_model": frozenset({"embeddings", "encoder", "post_layernorm", "head"}),
}
_TOWER_NAME = re.compile(r"^((?:model\.)?vision_tower\.)(.+)$")
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|gguf)$|\.index\.json$")


def _tower_children(config: Any) -> frozenset[str] | None:
    """The tower children vLLM nests under ``vision_model`` for a model of ``config``; None when nothing is."""
    if getattr(config, "model_type", None) != "llava":
        return None
    return NESTED_TOWERS.get(getattr(getattr(config, "vision_config", None), "model_type", None))


def vllm_name(config: Any, name: str) -> str:
    """The name vLLM (0.32)'s loader wants for the weight ``name`` of a model of ``config``: a flat LLaVA tower
    weight (``[model.]vision_tower.embeddings.*``) nested under ``vision_model``; every other name as it is."""
    children = _tower_children(config)
    match = _TOWER_NAME.match(name) if children else None
    if match is None or match[2].split(".", 1)[0] not in children:
        return name
    return f"{match[1]}vision_model.{match[2]}"


def renames(config: Any) -> bool:
    """Whether ``vllm_name`` may change a name of a model of ``config`` (the engine then maps every push)."""
    return _tower_children(config) is not None


def vllm_load_problem(model: Any) -> str | None:
    """Why vLLM (0.32) cannot load this vision-language ``model``'s weights, or None: a LLaVA tower weight that is
    neither nested already (``vision_tower.vision_model.*``) nor one of the flat children ``vllm_name`` nests (a
    tower named some other way than transformers 4 and 5 name it)."""
    children = _tower_children(model.config)
    if children is None:
        return None
    for name, _ in model.named_parameters():
        match = _TOWER_NAME.match(name)
        child = match[2].split(".", 1)[0] if match else None
        if child is not None and child != "vision_model" and child not in children:
            return (
                f"its LLaVA vision tower holds {name}, which vLLM's LLaVA loader has no name for (it loads "
                f"vision_tower.vision_model.{{{', '.join(sorted(children))}}}); set data.engine: transformers"
            )
    return None


def _saved_names(folder: Path) -> list[str] | None:
    """The weight names of a folder's safetensors files (None when it has none: ``.bin`` weights, or nothing)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    names = []
    for file in files:
        with safe_open(str(file), "pt") as opened:
            names.extend(opened.keys())
    return names


def _rename_saved(folder: Path, rename: Callable[[str], str]) -> int:
    """Rename the weights of every safetensors file in ``folder`` (and its shard index) by ``rename``; how many
    changed. A file none of whose names change is left as it is."""
    from safetensors.torch import load_file, save_file

    changed = 0
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        renamed = {rename(name): tensor for name, tensor in tensors.items()}
        moved = sum(new != old for new, old in zip(renamed, tensors))
        if moved:
            save_file(renamed, str(file), metadata={"format": "pt"})
        changed += moved
    for index in folder.glob("*.safetensors.index.json"):
        content = json.loads(index.read_text())
        content["weight_map"] = {rename(name): shard for name, shard in content.get("weight_map", {}).items()}
        index.write_text(json.dumps(content, indent=2))
    return changed


def _check_renamable(folder: Path, config: Any) -> None:
    """Refuse (ValueError) a folder whose weights ``vllm_name`` may change but that holds no safetensors."""
    if renames(config) and _saved_names(folder) is None:
        raise ValueError(f"{folder} holds no .safetensors weights to rename for vLLM (save the model with safetensors)")


def rename_for_vllm(folder: str | Path, config: Any) -> int:
    """Rename, in place, the saved weights of the model folder ``folder`` (of a model of ``config``) to the names
    vLLM's loader wants (``vllm_name``); how many changed (0 for a model whose names are vLLM's already).

    transformers reads the renamed folder back into the same weights (it maps the nested names it used to write),
    so the folder serves both. Only safetensors weights are renamed: a folder whose weights ``vllm_name`` may
    change but holds none (``.bin`` files) is refused with a ValueError.
    """
    folder = Path(folder)
    _check_renamable(folder, config)
    return _rename_saved(folder, lambda name: vllm_name(config, name)) if renames(config) else 0


def copy_for_vllm(source: str | Path, out_dir: str | Path) -> int:
    """Copy the Hugging Face model folder ``source`` (weights, config, processor, tokenizer, every other file) to
    ``out_dir`` with its weights under the names vLLM's loader wants (``rename_for_vllm``); how many were renamed.

    The folder to start ``vllm serve`` from for the ``vllm_server`` engine where the model's own folder was saved
    by transformers 5 (a LLaVA model: vLLM 0.32 refuses its flat tower names at start). ``out_dir`` may exist; its
    files of the same names are replaced.
    """
    from transformers import AutoConfig

    source, out_dir = Path(source), Path(out_dir)
    if not (source / "config.json").is_file():
        raise ValueError(f"{source} is not a Hugging Face model folder (no config.json)")
    if out_dir.resolve() == source.resolve():
        raise ValueError(f"{out_dir}: write the copy for vLLM to another folder than the model's own")
    config = AutoConfig.from_pretrained(str(source))
    _check_renamable(source, config)  # before copying anything
    shutil.copytree(source, out_dir, dirs_exist_ok=True)
    return rename_for_vllm(out_dir, config)


def vllm_model_folder(model: Any, processor: Any) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """A folder vLLM can start ``model`` from, and the temporary directory holding it (None: the model's own).

    The model's own folder (``name_or_path``) when its saved weights carry vLLM's names already (a transformers 4
    LLaVA checkpoint, any model ``vllm_name`` leaves alone). Otherwise the model saved in a temporary directory,
    every weight renamed by ``vllm_name``, beside its own folder's other files (processor and tokenizer settings,
    chat template: vLLM runs that processor) or, without a folder, ``processor`` (or the tokenizer) saved there.
    """
    source = getattr(model, "name_or_path", "") or ""
    own = Path(source) if os.path.isdir(source) and os.path.isfile(os.path.join(source, "config.json")) else None
    if own is not None:
        names = _saved_names(own) if renames(model.config) else []
        if names is not None and all(vllm_name(model.config, name) == name for name in names):
            return source, None
    folder = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
    model.save_pretrained(folder.name)
    if own is None:
        processor.save_pretrained(folder.name)  # a processor saves its tokenizer
    else:
        for file in own.iterdir():
            if file.is_file() and not _WEIGHT_FILE.search(file.name) and not (Path(folder.name) / file.name).exists():
                shutil.copy2(file, folder.name)
    rename_for_vllm(folder.name, model.config)
    return folder.name, folder
