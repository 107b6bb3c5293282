"""A user's modality, registered as a plug-in, reaches every pass: the invariant of
``grpo_lightning/modality.py``.

``ShiftModality`` adds one per-row forward input (``row_shift``: a vector added to every token's embedding) to a tiny
Llama whose forward accepts it. Registered by name (``register_modality``), it is chosen when the model loads (its
``for_model`` reads the model's config), and its input must reach the policy's passes, the reference pass and the
transformers engine, as the plain forward with the input gives them; an engine that cannot take it (lean) is refused
in one line before training.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from grpo_lightning.config import ConfigError, ObjectiveConfig
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.engines.hf import TransformersEngine
from grpo_lightning.engines.lean import LeanEngine
from grpo_lightning.modality import MODALITY_PLUGINS, TEXT, Modality, register_modality
from grpo_lightning.models.lean_forward import mask_positions
from grpo_lightning.module import GRPOModule
from grpo_lightning.rollout.prompts import PromptEncoder, prompt_encoder

_MARKER = "row_shift_model"


class ShiftedLlama(LlamaForCausalLM):
    """A Llama whose forward takes ``row_shift`` ``[B, H]``, added to every token's input embedding."""

    def forward(self, input_ids=None, row_shift=None, inputs_embeds=None, **kwargs):
        if row_shift is not None:
            embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            inputs_embeds, input_ids = embeds + row_shift[:, None, :].to(embeds.dtype), None
        return super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)


class ShiftEncoder(PromptEncoder):
    """Text prompts; each row's ``shift`` column becomes its ``row_shift`` input."""

    def __init__(self, tokenizer, modality, use_chat_template, **settings):
        super().__init__(tokenizer, use_chat_template, modality=modality, **settings)

    def encode_rows(self, rows, device="cpu"):
        prompt_ids, prompt_mask = self.encode(rows["prompt"], device)
        width = self.modality.hidden_size
        return prompt_ids, prompt_mask, [{"row_shift": torch.full((width,), float(s))} for s in rows["shift"]]


class ShiftModality(Modality):
    """The user's modality: one per-row input, ``row_shift``."""

    name = "shift"
    has_row_inputs = True

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size

    @classmethod
    def for_model(cls, name):
        config = json.loads((Path(name) / "config.json").read_text()) if (Path(name) / "config.json").is_file() else {}
        return cls(config["hidden_size"]) if config.get(_MARKER) else None

    def load_model(self, name, dtype):
        return ShiftedLlama.from_pretrained(name, dtype=dtype)

    def prompt_encoder(self, tokenizer, use_chat_template, **settings):
        return ShiftEncoder(tokenizer, self, use_chat_template, **settings)

    def forward_inputs(self, model, rows, input_ids, attention_mask, *, prompt_width):
        shift = torch.stack([row["row_shift"] for row in rows]).to(input_ids.device)
        return {"position_ids": mask_positions(attention_mask), "row_shift": shift}

    def generation_inputs(self, model, rows, input_ids):
        return {"row_shift": torch.stack([row["row_shift"] for row in rows]).to(input_ids.device)}


@pytest.fixture
def shift_model_dir(tiny_model_dir):
    """The tiny model's folder, its config marked as the user modality's."""
    config_path = Path(tiny_model_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config[_MARKER] = True
    config_path.write_text(json.dumps(config))
    register_modality("shift", f"{__name__}:ShiftModality")
    yield tiny_model_dir
    MODALITY_PLUGINS.pop("shift")


def _plain_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, shift):
    """The completion tokens' log-probs from the model's own forward, ``row_shift`` given directly."""
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=mask_positions(mask), row_shift=shift).logits
    logprobs = logits[:, prompt_ids.size(1) - 1 : -1].float().log_softmax(-1)
    return logprobs.gather(-1, completion_ids[..., None]).squeeze(-1) * completion_mask


def test_a_registered_modality_input_reaches_every_pass_and_the_transformers_engine(shift_model_dir):
    module = GRPOModule(model_name_or_path=shift_model_dir, objective=ObjectiveConfig(beta=0.1))
    assert isinstance(module.modality, ShiftModality)  # chosen when the model loads, from its config
    module.configure_model()
    assert isinstance(module.policy, ShiftedLlama) and module.ref is not None
    encoder = prompt_encoder(module.modality, module.tokenizer, False)
    assert encoder.modality is module.modality
    group = 3
    prompt_ids, prompt_mask, rows = encoder.encode_rows({"prompt": ["ab", "cde", "f"], "shift": [0.7, -0.4, 0.2]})
    engine = TransformersEngine()
    engine.setup(module.policy, module.tokenizer, module.modality)
    params = SamplingParams(group_size=group, max_new_tokens=6, batch_size=4)  # chunks of one prompt: past G
    out = engine.generate(
        prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(0), return_logprobs=True, vision=rows
    )
    repeated = module.modality.repeat_rows(rows, group)
    shift = torch.stack([row["row_shift"] for row in repeated])
    args = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    module.policy.eval()
    with torch.no_grad():
        expected = _plain_logprobs(module.policy, *args, shift)
        unshifted = _plain_logprobs(module.policy, *args, torch.zeros_like(shift))
    assert (expected - unshifted).abs().max() > 1e-3  # the input changes the model's log-probs
    # The engine sampled with the input (its own log-probs are the forward's with it).
    torch.testing.assert_close(out.policy_logprobs * out.completion_mask, expected, atol=1e-5, rtol=0)
    batch = SimpleNamespace(
        prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
        completion_mask=out.completion_mask, temperature=1.0, pack_tokens=None, vision=repeated,
    )  # fmt: skip
    old, ref = module.rollout_logprobs(batch, old=True, ref=True)
    torch.testing.assert_close(old * out.completion_mask, expected, atol=1e-5, rtol=0)  # π_old: the policy's pass
    torch.testing.assert_close(ref * out.completion_mask, expected, atol=1e-5, rtol=0)  # π_ref: the reference's


def test_an_engine_that_cannot_take_the_rows_inputs_is_refused_in_one_line(shift_model_dir):
    module = GRPOModule(model_name_or_path=shift_model_dir)
    with pytest.raises(ConfigError, match=r"^data.engine: lean does not give the model its shift inputs"):
        module.modality.check_run(LeanEngine(), None)
    module.modality.check_run(TransformersEngine(), None)
    TEXT.check_run(LeanEngine(), None)  # text rows carry nothing: every engine takes them


def test_rows_with_inputs_are_refused_by_a_pass_or_engine_given_the_text_modality(tiny_llama, tokenizer):
    from grpo_lightning.models.logprobs import completion_logprobs

    ids, mask = torch.ones(2, 3, dtype=torch.long) * 5, torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="need the modality that gives them"):
        completion_logprobs(tiny_llama, ids, mask, ids, mask, vision=[{}, {}])
    engine = TransformersEngine()
    engine.setup(tiny_llama, tokenizer)
    with pytest.raises(ValueError, match="set up with the text modality"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=2), vision=[{}, {}])
