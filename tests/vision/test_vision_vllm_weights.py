"""The names a vision-language model's weights go to vLLM under (``integrations/vision/vllm_weights.py``), without vLLM:
transformers 5's flat LLaVA tower names nested under ``vision_model`` as vLLM 0.32's loader wants, in the folder
vLLM starts from and in every push; other names and other families as they are; a tower name with no vLLM name
refused; ``tools/export_hf.py --for-vllm`` (the folder a user serves): a model folder copied, a checkpoint's
policy exported, under those names. (vLLM loading them, and its log-probs after a push: test_vision_vllm.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import load_tool
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, LlavaConfig
from vision_models import encoder_for, shared_vlms

from grpo_lightning import GRPOModule
from grpo_lightning.integrations.vision.vllm_weights import vllm_load_problem, vllm_model_folder, vllm_name


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


def _saved(folder: str | Path) -> list[str]:
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as saved:
        return list(saved.keys())


def _llava(tower: str) -> LlavaConfig:
    vision = {"model_type": tower, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    return LlavaConfig(vision_config=vision, text_config={"model_type": "llama"})


def test_a_flat_clip_or_siglip_tower_is_nested_and_nothing_else_renamed(tiny_vlms):
    clip = AutoModelForImageTextToText.from_pretrained(str(tiny_vlms["llava"])).config
    for name, wanted in {
        # the model's names (every push) and the saved folder's (transformers 5 saves the old top-level ones)
        "model.vision_tower.embeddings.patch_embedding.weight": "model.vision_tower.vision_model.embeddings.patch_"
        "embedding.weight",
        "vision_tower.encoder.layers.0.self_attn.q_proj.weight": "vision_tower.vision_model.encoder.layers.0."
        "self_attn.q_proj.weight",
        "vision_tower.pre_layrnorm.bias": "vision_tower.vision_model.pre_layrnorm.bias",
        "model.vision_tower.post_layernorm.weight": "model.vision_tower.vision_model.post_layernorm.weight",
        # nested already (a transformers 4 checkpoint), and everything outside the tower: vLLM maps those itself
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": None,
        "model.multi_modal_projector.linear_1.weight": None,
        "model.language_model.layers.0.self_attn.q_proj.weight": None,
        "language_model.model.embed_tokens.weight": None,
        "lm_head.weight": None,
    }.items():
        assert vllm_name(clip, name) == (wanted or name), name
    siglip = _llava("siglip_vision_model")
    assert vllm_name(siglip, "model.vision_tower.head.probe") == "model.vision_tower.vision_model.head.probe"
    assert vllm_name(siglip, "vision_tower.embeddings.patch_embedding.weight").startswith("vision_tower.vision_model.")
    pixtral = _llava("pixtral")  # flat in vLLM too
    assert vllm_name(pixtral, "model.vision_tower.transformer.layers.0.ffn_norm.weight").count("vision_model") == 0
    qwen = AutoModelForImageTextToText.from_pretrained(str(tiny_vlms["qwen2_vl"])).config
    assert vllm_name(qwen, "model.visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"


def test_a_tower_name_with_no_vllm_name_is_named(tiny_vlms):
    llava = AutoModelForImageTextToText.from_pretrained(str(tiny_vlms["llava"]))
    assert vllm_load_problem(llava) is None  # every name of transformers 5's tower has a vLLM name
    assert vllm_load_problem(AutoModelForImageTextToText.from_pretrained(str(tiny_vlms["qwen2_vl"]))) is None
    llava.model.vision_tower.add_module("extra", torch.nn.Linear(2, 2))
    problem = vllm_load_problem(llava)
    assert "model.vision_tower.extra.weight" in problem and problem.endswith("set data.engine: transformers")


def test_vllm_starts_from_a_renamed_copy_beside_the_folders_other_files(tiny_vlms):
    path = tiny_vlms["llava"]
    llava = AutoModelForImageTextToText.from_pretrained(str(path))
    folder, temporary = vllm_model_folder(llava, encoder_for(path).processor)
    try:
        assert temporary is not None and folder != str(path)
        tower = [name for name in _saved(folder) if "vision_tower" in name]
        assert tower and all(name.startswith("vision_tower.vision_model.") for name in tower)
        assert sorted(vllm_name(llava.config, name) for name in _saved(path)) == sorted(_saved(folder))
        for file in Path(path).iterdir():  # the processor's and tokenizer's files: vLLM runs that processor
            assert (Path(folder) / file.name).exists(), file.name
        # transformers still reads the copy (its old nested names), into the same weights
        again = AutoModelForImageTextToText.from_pretrained(folder)
        for (name, weight), (_, other) in zip(llava.state_dict().items(), again.state_dict().items()):
            assert torch.equal(weight, other), name
        # a model from a folder vLLM reads as it is (a transformers 4 LLaVA checkpoint): that folder, no copy
        assert vllm_model_folder(again, None) == (folder, None)
    finally:
        temporary.cleanup()
    qwen = AutoModelForImageTextToText.from_pretrained(str(tiny_vlms["qwen2_vl"]))
    assert vllm_model_folder(qwen, None) == (str(tiny_vlms["qwen2_vl"]), None)


def _same_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """transformers reads ``folder`` (vLLM's names) back into ``model``'s very weights."""
    again = AutoModelForImageTextToText.from_pretrained(str(folder)).state_dict()
    assert again.keys() == model.state_dict().keys()
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, again[name]), name


def test_export_hf_for_vllm_copies_a_model_folder_under_vllms_names(tiny_vlms, tmp_path, capsys):
    export = load_tool("export_hf")
    path = tiny_vlms["llava"]
    export.main(["--for-vllm", str(path), str(tmp_path / "llava")])
    renamed = sum(name.startswith("vision_tower.") for name in _saved(path))
    assert capsys.readouterr().out.strip() == f"copied to {tmp_path / 'llava'} for vLLM ({renamed} weights renamed)"
    llava = AutoModelForImageTextToText.from_pretrained(str(path))
    tower = [name for name in _saved(tmp_path / "llava") if "vision_tower" in name]
    assert len(tower) == renamed and all(name.startswith("vision_tower.vision_model.") for name in tower)
    assert sorted(vllm_name(llava.config, name) for name in _saved(path)) == sorted(_saved(tmp_path / "llava"))
    assert {file.name for file in path.iterdir()} == {file.name for file in (tmp_path / "llava").iterdir()}
    _same_weights(llava, tmp_path / "llava")
    # the engines start vLLM from such a folder as it is
    assert vllm_model_folder(AutoModelForImageTextToText.from_pretrained(str(tmp_path / "llava")), None)[1] is None
    # a model whose names are vLLM's already: copied as it is
    export.main(["--for-vllm", str(tiny_vlms["qwen2_vl"]), str(tmp_path / "qwen")])
    assert capsys.readouterr().out.strip().endswith("(0 weights renamed)")
    assert _saved(tmp_path / "qwen") == _saved(tiny_vlms["qwen2_vl"])
    for argv, message in [
        ([str(path), str(tmp_path / "plain")], "is a model folder, not a checkpoint"),
        (["--for-vllm", "--dtype", "bfloat16", str(path), str(tmp_path / "d")], "--dtype and --model-name-or-path"),
        (["--for-vllm", str(path), str(path)], "write the copy for vLLM to another folder than the model's own"),
    ]:
        with pytest.raises(SystemExit):
            export.main(argv)
        assert message in capsys.readouterr().err
    assert not (tmp_path / "plain").exists() and not (tmp_path / "d").exists()


def test_export_hf_for_vllm_writes_a_policys_weights_under_vllms_names(tiny_vlms, tmp_path):
    module = GRPOModule(model_name_or_path=str(tiny_vlms["llava"]))
    module.configure_model()
    out = load_tool("export_hf").export_module(module, tmp_path / "served", for_vllm=True)
    tower = [name for name in _saved(out) if "vision_tower" in name]
    assert tower and all(name.startswith("vision_tower.vision_model.") for name in tower)
    assert (out / "processor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    _same_weights(module.policy, out)
    plain = load_tool("export_hf").export_module(module, tmp_path / "plain")  # without it: transformers 5's names
    assert any(name.startswith("vision_tower.embeddings.") for name in _saved(plain))
