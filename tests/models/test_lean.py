"""The lean forward (``grpo_lightning.models.lean_forward``) against the ``transformers`` forward it replaces.

Every supported architecture, with left-padded prompts and grouped-query attention: logits, log-probs, their
gradients, sampled tokens and the sampler's own log-probs (π_old when μ > 1) must agree.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHITECTURE_SIZE, F32, LEAN_ARCHITECTURES, build_architecture
from packing_timings import injected, needs_onednn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
)

from grpo_lightning.engines.lean import sample_completions
from grpo_lightning.models import cpu_packing, cpu_packing_rule
from grpo_lightning.models import lean as lean_forward
from grpo_lightning.models.lean_decoder import LeanDecoder
from grpo_lightning.models.lean_forward import lean_unsupported, prompt_groups, shared_prompt_hidden
from grpo_lightning.models.logprobs import completion_logprobs, token_positions


@pytest.fixture
def calibration(monkeypatch, tmp_path):
    """CPU packing on with injected timings (``packing_timings.injected``)."""
    yield from injected(monkeypatch, tmp_path)


def rollout(group_size: int = 2, prompt_len: int = 5, completion_len: int = 6, padded: bool = True):
    """Three left-padded prompts (0, 2 and 4 padding positions, or none), each repeated for its group."""
    torch.manual_seed(1)
    prompt_ids = torch.randint(1, ARCHITECTURE_SIZE["vocab_size"], (3, prompt_len))
    prompt_mask = torch.ones(3, prompt_len, dtype=torch.long)
    if padded:
        prompt_mask[1, :2] = 0
        prompt_mask[2, :4] = 0
    completion_ids = torch.randint(1, ARCHITECTURE_SIZE["vocab_size"], (3 * group_size, completion_len))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0  # a completion that ended early
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def reference_logits(model, prompt_ids, prompt_mask, completion_ids, group_size=2):
    """``transformers``' logits at the positions that predict each completion token."""
    ids = torch.cat([prompt_ids.repeat_interleave(group_size, 0), completion_ids], 1)
    attention = torch.cat([prompt_mask.repeat_interleave(group_size, 0), torch.ones_like(completion_ids)], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    return logits[:, prompt_ids.size(1) - 1 : -1]


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("name", LEAN_ARCHITECTURES)
def test_shared_prompt_pass_gives_the_model_logits(name, padded):
    model = build_architecture(name)
    assert lean_unsupported(model) is None
    prompt_ids, prompt_mask, completion_ids, _ = rollout(padded=padded)
    with torch.no_grad():
        expected = reference_logits(model, prompt_ids, prompt_mask, completion_ids)
        hidden = shared_prompt_hidden(
            model, prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0), completion_ids
        )
        torch.testing.assert_close(model.lm_head(hidden), expected, **F32)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("name", LEAN_ARCHITECTURES)
def test_decoding_steps_give_the_model_logits(name, pack, padded, calibration, monkeypatch):
    """Prefill + decoding steps; ``packed``: packing measured to pay for every decoder-layer product group (q, k,
    v and gate, up stacked, Qwen2's biases with them), so every one is pre-packed for oneDNN; ``plain``: none."""
    if pack and not cpu_packing.onednn_available():
        pytest.skip("this torch build cannot pre-pack CPU weights")
    if not pack:
        monkeypatch.setenv(cpu_packing_rule.SWITCH, "off")
    model = build_architecture(name)
    prompt_ids, prompt_mask, completion_ids, _ = rollout(padded=padded)
    with torch.no_grad():
        expected = reference_logits(model, prompt_ids, prompt_mask, completion_ids)
        decoder = LeanDecoder(model)
        logits = [decoder.prefill(prompt_ids, prompt_mask, 2, completion_ids.size(1)).repeat_interleave(2, 0)]
        for step in range(completion_ids.size(1) - 1):
            logits.append(decoder.decode(completion_ids[:, step]))
        torch.testing.assert_close(torch.stack(logits, 1), expected, **F32)
    # Where packing pays the decoder stacks q, k, v (gate, up) into one product each and packs them; else neither
    for layer in decoder.layers:
        assert (layer.qkv is not None) == (layer.gate_up is not None) == pack
        assert all((p.packed is not None) == pack for p in (layer.o, layer.down) + ((layer.qkv, layer.gate_up) * pack))


@needs_onednn
@pytest.mark.parametrize("name", LEAN_ARCHITECTURES)
def test_a_large_pass_without_gradients_packs_its_weights_and_gives_the_model_logits(name, monkeypatch, calibration):
    """A pass without gradients where packing pays (here: every group, measured at ``PASS_ROWS`` rows) multiplies
    by weights packed layer by layer (q, k, v and gate, up stacked, Qwen2's biases with them); with gradients, the
    same pass multiplies by the parameters themselves (the packed product has no backward). Here the completions'
    pass has 16 x 71 positions, the prompts' 8 x 8, fewer than ``PASS_ROWS``: not packed."""
    model = build_architecture(name)
    calls = []
    real = cpu_packing.packed_linear
    monkeypatch.setattr(lean_forward, "packed_linear", lambda *args: calls.append(args[1].shape) or real(*args))
    torch.manual_seed(2)
    prompt_ids = torch.randint(1, ARCHITECTURE_SIZE["vocab_size"], (8, 8))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[3, :5] = 0
    completion_ids = torch.randint(1, ARCHITECTURE_SIZE["vocab_size"], (16, 72))
    assert completion_ids[:, :-1].numel() >= cpu_packing_rule.PASS_ROWS > prompt_ids.numel()
    calibration.timings = cpu_packing_rule.Timing(plain=1e-3, packed=0.5e-3, reorder=0.0)  # pays from PASS_ROWS
    with torch.no_grad():
        expected = reference_logits(model, prompt_ids, prompt_mask, completion_ids)
        hidden = shared_prompt_hidden(
            model, prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0), completion_ids
        )
        torch.testing.assert_close(model.lm_head(hidden), expected, **F32)
    # The completion pass (not the 64-position prompt pass): 4 products per layer (qkv, o, gate_up, down)
    assert len(calls) == 4 * model.config.num_hidden_layers
    calls.clear()
    hidden = shared_prompt_hidden(
        model, prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0), completion_ids
    )
    hidden.sum().backward()
    assert calls == [] and all(p.grad is not None for p in model.model.layers[0].parameters())


@needs_onednn
def test_no_pass_packs_under_autocast_in_another_dtype_or_off_the_cpu(calibration):
    """``pass_plan``: packed products bypass autocast and have no backward: only float32 CPU passes without
    gradients, of at least ``PASS_ROWS`` positions, get one (``packing_applies``, shared with the decoder)."""
    model, hidden, many = build_architecture("llama"), torch.zeros(1, 4), 4 * cpu_packing_rule.PASS_ROWS
    with torch.no_grad():
        assert cpu_packing_rule.pass_plan(model, hidden, many) is not None
        assert cpu_packing_rule.pass_plan(model, hidden, cpu_packing_rule.PASS_ROWS - 1) is None
        assert cpu_packing_rule.pass_plan(model, hidden.bfloat16(), many) is None
        assert cpu_packing_rule.pass_plan(model, hidden.to("meta"), many) is None
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", dtype=dtype):
                assert cpu_packing_rule.pass_plan(model, hidden, many) is None
    assert cpu_packing_rule.pass_plan(model, hidden, many) is None  # gradients enabled


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_logprobs_entropies_and_gradients_match_the_model_forward(name):
    """The training path: shared prompt pass under autograd, gradients of every parameter as the plain forward."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout()
    # Rows out of group order: sharing must find equal prompts wherever they are.
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    args = (
        prompt_ids.repeat_interleave(2, 0)[order],
        prompt_mask.repeat_interleave(2, 0)[order],
        completion_ids[order],
        completion_mask[order],
    )
    results = {}
    for lean in (True, False):
        model = build_architecture(name).train()
        logprobs, entropy = completion_logprobs(model, *args, temperature=0.7, with_entropy=True, lean=lean)
        ((logprobs * torch.linspace(-1, 1, logprobs.size(1))).sum() + entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[lean] = (logprobs.detach(), entropy.detach(), grads)
    (lp_lean, ent_lean, g_lean), (lp_ref, ent_ref, g_ref) = results[True], results[False]
    torch.testing.assert_close(lp_lean, lp_ref, **F32)
    torch.testing.assert_close(ent_lean, ent_ref, **F32)
    assert (lp_lean[args[3] == 0] == 0).all()  # padding positions stay 0
    assert g_lean.keys() == g_ref.keys() and len(g_ref) == len(list(build_architecture(name).parameters()))
    for param_name in g_ref:
        # A parameter's gradient sums over every row and position (hundreds of terms, some cancelling): a wider
        # relative bound than F32's; measured ≤ 12% of it with AVX2, ≤ 10% with AVX-512, at 1 and 2 threads.
        torch.testing.assert_close(g_lean[param_name], g_ref[param_name], atol=1e-5, rtol=1e-4, msg=param_name)


@pytest.mark.parametrize("greedy", [True, False])
def test_sampling_draws_the_same_tokens_on_both_paths(greedy):
    model = build_architecture("qwen2")
    prompt_ids, prompt_mask, _, _ = rollout()
    runs = []
    for lean in (True, False):
        runs.append(
            sample_completions(
                model,
                prompt_ids,
                prompt_mask,
                group_size=3,
                max_new_tokens=8,
                eos_token_id=0,
                pad_token_id=0,
                greedy=greedy,
                generator=torch.Generator().manual_seed(7),
                return_logprobs=True,
                lean=lean,
            )
        )
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].completion_mask, runs[1].completion_mask)
    torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, **F32)


@pytest.mark.parametrize("lean", [True, False])
def test_sampler_logprobs_are_the_recomputed_old_policy_logprobs(lean):
    """With μ > 1 the sampler's log-probs stand in for an old-policy pass: they must be that pass's values."""
    model = build_architecture("llama")
    prompt_ids, prompt_mask, _, _ = rollout()

    def sample(eos_token_id: int):
        return sample_completions(
            model,
            prompt_ids,
            prompt_mask,
            group_size=4,
            max_new_tokens=10,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            temperature=0.8,  # unfiltered: then the sampler's log-probs are π_old's (engines/base.py)
            generator=torch.Generator().manual_seed(3),
            return_logprobs=True,
            lean=lean,
        )

    # The end token: the one this model draws most often, so that completions end at different lengths.
    eos_token_id = int(sample(eos_token_id=0).completion_ids[:, 3:].flatten().bincount().argmax())
    out = sample(eos_token_id)
    with torch.no_grad():
        recomputed, _ = completion_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, temperature=0.8
        )
    assert (out.completion_mask.sum(-1) < 10).any()  # some completions ended early (EOS): padding is covered
    torch.testing.assert_close(out.logprobs, recomputed, **F32)


def test_models_the_lean_forward_does_not_cover_use_their_own():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    assert "architecture 'gpt2'" in lean_unsupported(gpt2)
    windowed = MistralForCausalLM(MistralConfig(**ARCHITECTURE_SIZE, sliding_window=4))
    assert lean_unsupported(windowed) == "sliding-window attention"
    checkpointed = build_architecture("llama")
    enable = getattr(checkpointed, "activation_checkpointing_enable", None)
    enable() if enable is not None else checkpointed.gradient_checkpointing_enable()
    with torch.no_grad():
        assert lean_unsupported(checkpointed) is None  # no backward pass: nothing to recompute
    assert lean_unsupported(checkpointed) == "gradient checkpointing"

    # Unsupported models still get log-probs, from their own forward.
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout()
    rows = (prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0), completion_ids, completion_mask)
    logprobs, _ = completion_logprobs(gpt2.eval(), *rows)
    assert logprobs.shape == completion_ids.shape and torch.isfinite(logprobs).all()


def test_lora_wrapped_models_use_their_own_forward():
    pytest.importorskip("peft")
    from grpo_lightning.lora import LoraConfig, apply_lora

    model = apply_lora(build_architecture("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert lean_unsupported(model) is not None
    assert lean_unsupported(model.get_base_model()) is not None  # its q/v projections are LoRA layers


class _RecordOps(TorchDispatchMode):
    """Records the name of every aten operator that runs inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# Operators that read a tensor's values on the host: on a GPU each one waits for the device to catch up.
HOST_READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "_unique2", "unique_dim", "unique_consecutive"}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "model-forward"])
def test_the_update_forward_reads_nothing_on_the_host_with_its_precomputed_layout(lean):
    """With the positions and prompt groups of the rollout (``RolloutBatch.tensors``), the update's forward and
    backward run without a device sync, and give exactly what the pass that finds them itself gives."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout()
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # rows out of group order
    rows = (
        prompt_ids.repeat_interleave(2, 0)[order],
        prompt_mask.repeat_interleave(2, 0)[order],
        completion_ids[order],
        completion_mask[order],
    )
    layout = {"positions": token_positions(rows[3]), "groups": prompt_groups(rows[0], rows[1])}
    results = []
    for given in ({}, layout):
        model = build_architecture("llama").train()
        with _RecordOps() as recorder:
            logprobs, entropy = completion_logprobs(model, *rows, with_entropy=True, lean=lean, **given)
            (logprobs.sum() + entropy.sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
        if given and lean:
            assert not recorder.ops & HOST_READS, recorder.ops & HOST_READS
        if not given:
            assert recorder.ops & HOST_READS  # the recorder does see them when the layout is found here
    (lp, ent, grads), (lp_given, ent_given, grads_given) = results
    # Bit for bit: the same operations on the same tensors, only the layout found elsewhere, on any machine.
    torch.testing.assert_close(lp_given, lp, atol=0, rtol=0)
    torch.testing.assert_close(ent_given, ent, atol=0, rtol=0)
    for grad, grad_given in zip(grads, grads_given):
        torch.testing.assert_close(grad_given, grad, atol=0, rtol=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        completion_logprobs(model, *rows, micro_batch_size=2, **layout)


def test_prompt_groups_map_every_row_to_a_row_with_its_prompt():
    prompt_ids, prompt_mask, _, _ = rollout()
    ids = prompt_ids.repeat_interleave(3, 0)[torch.randperm(9)]
    mask = prompt_mask.repeat_interleave(3, 0)[torch.randperm(9, generator=torch.Generator().manual_seed(0))]
    groups = prompt_groups(ids, mask)
    assert groups.first.numel() == len({(tuple(i), tuple(m)) for i, m in zip(ids.tolist(), mask.tolist())})
    assert torch.equal(ids[groups.first][groups.inverse], ids) and torch.equal(mask[groups.first][groups.inverse], mask)
    assert groups.padded and not prompt_groups(ids, torch.ones_like(mask)).padded


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "model-forward"])
def test_chunked_logprobs_of_ragged_completions_match_the_full_logits(lean):
    """Several completion lengths (one empty): the chunked paths, which pick the real tokens by flat index (the
    model-forward one among T + 1 strided positions per row), against log-softmax of the model's full logits."""
    prompt_ids, prompt_mask, completion_ids, _ = rollout()
    rows = (prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0), completion_ids)
    lengths = torch.tensor([6, 1, 0, 4, 5, 2])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    model = build_architecture("qwen2")
    with torch.no_grad():
        full, _ = completion_logprobs(model, *rows, mask, chunk_size=None, lean=False, temperature=0.8)
        full = full * mask
        for given in ({}, {"positions": token_positions(mask), "groups": prompt_groups(rows[0], rows[1])}):
            chunked, _ = completion_logprobs(model, *rows, mask, chunk_size=3, lean=lean, temperature=0.8, **given)
            torch.testing.assert_close(chunked, full, **F32)
            assert (chunked[mask == 0] == 0).all()


@pytest.mark.parametrize("precision", ["bf16-weights", "bf16-autocast"])
@pytest.mark.parametrize("name", LEAN_ARCHITECTURES)
def test_bf16_logits_equal_the_model_forward(name, precision):
    """In bfloat16 (weights, or float32 weights under autocast) the lean forward rounds as the model's does."""
    model = build_architecture(name)
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    prompt_ids, prompt_mask, completion_ids, _ = rollout()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        expected = reference_logits(model, prompt_ids, prompt_mask, completion_ids)
        hidden = shared_prompt_hidden(
            model, prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0), completion_ids
        )
        logits = model.lm_head(hidden)
    assert logits.dtype == expected.dtype == torch.bfloat16
    # Both sides round every intermediate tensor to bfloat16 (unit roundoff u = 2**-8), but the CPU kernels that
    # feed them (AVX-512 or AVX2 matmuls, attention, thread count) sum in different orders: an intermediate that
    # lands on the other side of a rounding boundary moves a logit by about one bfloat16 step of the logits'
    # size. Measured: 0 with AVX-512, up to 1.2 u·max|logit| with AVX2 (1 and 2 threads); allowed: 4 u·max|logit|,
    # relative to the logits' magnitude only (rtol=0: a near-zero logit has no meaningful relative error). A
    # missing bias or q/k norm moves them by ~100 u or more; smaller slips (a rounding done in another dtype,
    # measured 1-2 u) cannot be told from other kernels in bfloat16: the float32 tests above catch those.
    tolerance = 4 * 2**-8 * expected.float().abs().max().item()
    torch.testing.assert_close(logits.float(), expected.float(), atol=tolerance, rtol=0)
