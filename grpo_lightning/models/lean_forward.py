"""A lean forward pass for Llama-family decoders (Llama, Qwen2, Qwen3, Mistral), reading the model's own weights.

Why: for the small matrices of a decoding step (and of small models generally) the generic ``transformers``
forward spends about as long in Python as in arithmetic: mask construction, cache objects, output capturing and
one module call per projection. This file does the same arithmetic with plain tensor ops, so that

- sampling prefills each prompt once and decodes into preallocated key/value buffers (``LeanDecoder``, in
  ``models/lean_decoder.py``);
- log-prob passes run each distinct prompt once and let the G completions of its group attend to its keys and
  values (``shared_prompt_hidden``): a group's prompt is computed once instead of G times, forward and backward.

Only plain, unsharded models of the architectures above take this path (``lean_unsupported`` says why not):
LoRA-wrapped layers, FSDP2 or DeepSpeed shards, sliding-window attention, attention dropout in training,
gradient checkpointing and any other architecture use the model's own forward. ``tests/models/test_lean.py`` checks
logits and log-probs against the ``transformers`` forward for every architecture listed, with padded prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_lightning.modality import mask_positions  # re-exported: the decoder and the engines read it here
from grpo_lightning.models.cpu_packing import PackPlan, packed_linear, product_groups, stackable, stacked_weight
from grpo_lightning.models.cpu_packing_rule import pass_plan
from grpo_lightning.models.swiglu import swiglu_down

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support has no shards
    DTensor = None

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

# (layer index, new keys, new values) -> all keys and values the new positions attend to
KeyValueFn = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]

# ``mask`` value for plain causal attention over the positions being computed (no padding, no past keys).
CAUSAL = "causal"


def lean_unsupported(model: nn.Module) -> str | None:
    """None when ``model`` can run on the lean forward, else the reason it cannot (it then uses its own)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"architecture {model_type!r} (lean forward: {', '.join(ARCHITECTURES)})"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "not a plain *ForCausalLM (wrapped, e.g. by PEFT)"
    if type(getattr(model, "lm_head", None)) is not nn.Linear:
        return "output layer is not a plain Linear"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return "sliding-window attention"
    if layer_types is None and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5 name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing and torch.is_grad_enabled():
        return "gradient checkpointing"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(linear) is not nn.Linear for linear in linears):
            return "projections are not plain Linear layers (LoRA, quantization)"
    for param in model.parameters():
        # FSDP2 shards are DTensors and DeepSpeed ZeRO-3 partitions carry ds_id: their full weights exist only
        # inside the wrappers' own forward hooks.
        if hasattr(param, "ds_id") or (DTensor is not None and isinstance(param, DTensor)):
            return "sharded parameters (FSDP2, DeepSpeed)"
    return None


class Projection(NamedTuple):
    """A linear layer's tensors; ``packed``: its weight pre-packed for oneDNN (``models/cpu_packing.py``), else
    None."""

    weight: Tensor
    bias: Tensor | None
    packed: Tensor | None = None


class Norm(NamedTuple):
    """An RMSNorm's scale and epsilon."""

    weight: Tensor
    eps: float


class LayerWeights(NamedTuple):
    """One decoder layer's tensors and constants.

    Why: read from the modules once per pass (or once per rollout, for the decoding steps) instead of through
    ``nn.Module`` attribute lookups at every step, which cost about a microsecond each, some 35 per layer.
    """

    layer_idx: int
    input_norm: Norm
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    q_norm: Norm | None  # Qwen3: RMSNorm of each head of q and k before the rotation
    k_norm: Norm | None
    post_attention_norm: Norm
    gate: Projection
    up: Projection
    down: Projection
    act: Callable[[Tensor], Tensor]
    head_dim: int
    scaling: float
    silu: bool = False  # ``act`` is SiLU: the block runs as ``swiglu_down`` (half the saved activations)
    qkv: Projection | None = None  # q, k and v stacked into one packed product (``PackPlan``)
    gate_up: Projection | None = None  # gate and up stacked into one packed product


def norm_weights(module: nn.Module) -> Norm:
    return Norm(module.weight, module.variance_epsilon)


def decoder_weights(model: nn.Module, plan: PackPlan | None = None) -> list[LayerWeights]:
    """Every decoder layer's ``LayerWeights`` (``layer_weights``)."""
    return [layer_weights(layer, plan) for layer in model.model.layers]


def layer_weights(layer: nn.Module, plan: PackPlan | None = None) -> LayerWeights:
    """A decoder layer's ``LayerWeights``. The product groups ``plan`` names (``models/cpu_packing.py``) multiply
    by packed copies of their weights, q, k, v stacked into one product and gate, up into another (one call each
    instead of three and two); the others by the parameters themselves."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = product_groups(layer)

    def plain(linear: nn.Linear) -> Projection:
        return Projection(linear.weight, linear.bias)

    def packed(name: str) -> Projection | None:
        # The rule packs a group of several parts only where they stack (``cpu_packing_rule.measure``).
        linears = groups[name]
        if plan is None or name not in plan.groups or (len(linears) > 1 and not stackable(linears)):
            return None
        weight, bias = stacked_weight(linears) if len(linears) > 1 else (linears[0].weight, linears[0].bias)
        return Projection(weight, bias, plan.packer(weight))

    qkv, gate_up = packed("qkv"), packed("gate_up")
    qk_norm = hasattr(attn, "q_norm")
    return LayerWeights(
        layer_idx=attn.layer_idx,
        input_norm=norm_weights(layer.input_layernorm),
        q=plain(attn.q_proj),  # with ``qkv``, a stacked product's part is never multiplied alone
        k=plain(attn.k_proj),
        v=plain(attn.v_proj),
        o=packed("o") or plain(attn.o_proj),
        q_norm=norm_weights(attn.q_norm) if qk_norm else None,
        k_norm=norm_weights(attn.k_norm) if qk_norm else None,
        post_attention_norm=norm_weights(layer.post_attention_layernorm),
        gate=plain(mlp.gate_proj),
        up=plain(mlp.up_proj),
        down=packed("down") or plain(mlp.down_proj),
        act=mlp.act_fn,
        head_dim=attn.head_dim,
        scaling=attn.scaling,
        silu=type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation"),
        qkv=qkv,
        gate_up=gate_up,
    )


def rms_norm(x: Tensor, norm: Norm) -> Tensor:
    """``LlamaRMSNorm``: normalised in float32, scaled in the input's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.size(-1),), norm.weight, norm.eps)
    return norm.weight * F.rms_norm(x.float(), (x.size(-1),), None, norm.eps).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` ``[rows, heads, S, D]`` (``cos``/``sin`` ``[rows, 1, S, D]``)."""
    half = x.size(-1) // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def linear(x: Tensor, p: Projection) -> Tensor:
    if p.packed is not None:
        return packed_linear(x, p.packed, p.bias)
    return F.linear(x, p.weight, p.bias)


def _attention(
    w: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | str | None, keys_values: KeyValueFn
) -> Tensor:
    rows, length, _ = x.shape
    if w.qkv is not None:
        q, k, v = linear(x, w.qkv).split([w.q.weight.size(0), w.k.weight.size(0), w.v.weight.size(0)], dim=-1)
    else:
        q, k, v = linear(x, w.q), linear(x, w.k), linear(x, w.v)
    q = q.view(rows, length, -1, w.head_dim)
    k = k.view(rows, length, -1, w.head_dim)
    v = v.view(rows, length, -1, w.head_dim).transpose(1, 2)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm), rms_norm(k, w.k_norm)
    q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
    keys, values = keys_values(w.layer_idx, k, v)
    causal = isinstance(mask, str)  # CAUSAL: the fused kernels' own causal masking, no mask tensor to read
    out = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=None if causal else mask,
        is_causal=causal,
        scale=w.scaling,
        enable_gqa=keys.size(1) != q.size(1),
    )
    return linear(out.transpose(1, 2).reshape(rows, length, -1), w.o)


def _mlp(w: LayerWeights, h: Tensor) -> Tensor:
    if w.gate_up is not None:
        gate, up = linear(h, w.gate_up).split([w.gate.weight.size(0), w.up.weight.size(0)], dim=-1)
    else:
        gate, up = linear(h, w.gate), linear(h, w.up)
    if w.silu and w.down.packed is None:
        return swiglu_down(gate, up, w.down.weight, w.down.bias)
    return linear(w.act(gate) * up, w.down)


def decoder_hidden(
    model: nn.Module,
    input_ids: Tensor,
    positions: Tensor,
    mask: Tensor | str | None,
    keys_values: KeyValueFn,
    layers: list[LayerWeights] | None = None,
) -> Tensor:
    """Hidden states ``[rows, S, H]`` after the last decoder layer, before the final norm.

    ``mask`` ``[rows or 1, 1, S, K]`` (True = attend) covers the K keys that ``keys_values`` returns for each
    layer; None lets every position attend to every key; ``CAUSAL`` is causal attention among the S positions
    (which must be all the keys). ``layers``: the model's ``decoder_weights``, when the caller keeps them; else
    each layer's are read as it runs, the groups where it pays pre-packed for a large pass without gradients on
    CPU (``pass_plan``: one layer's packed weights alive at a time).
    """
    inner = model.model
    x = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(x, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if layers is None:
        plan = pass_plan(model, x, input_ids.numel())
        layers = (layer_weights(layer, plan) for layer in inner.layers)
    for w in layers:
        x = x + _attention(w, rms_norm(x, w.input_norm), cos, sin, mask, keys_values)
        x = x + _mlp(w, rms_norm(x, w.post_attention_norm))
    return x


def final_norm(model: nn.Module, hidden: Tensor) -> Tensor:
    """The model's last RMSNorm, which the output layer reads."""
    return rms_norm(hidden, norm_weights(model.model.norm))


def _prompt_mask_4d(prompt_mask: Tensor) -> Tensor:
    """``[rows, 1, P, P]``: causal attention over real prompt tokens; a padding position attends to itself only
    (a query with no key would give NaN, which its zero-weight value would still spread through the matmul)."""
    length = prompt_mask.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=prompt_mask.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=prompt_mask.device)
    return ((causal & prompt_mask.bool()[:, None, :]) | diagonal)[:, None]


class PromptGroups(NamedTuple):
    """The distinct prompts among a batch's rows (the G rows of a group share one).

    Finding them reads the tensors on the host (a device sync), so the update takes them precomputed with its
    micro-batch (``RolloutBatch.tensors``), and its forward pass runs without a sync.
    """

    first: Tensor  # [K] one row of each distinct prompt
    inverse: Tensor  # [N] each row's prompt, an index into ``first``
    padded: bool  # whether any prompt has padding


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> PromptGroups:
    """Group the rows of left-padded prompts ``[N, P]`` by prompt (tokens and padding alike)."""
    unique, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask.long()], dim=1), dim=0, return_inverse=True)
    rows = torch.arange(inverse.numel(), device=inverse.device)
    first = inverse.new_empty(unique.size(0)).scatter_(0, inverse, rows)  # any row of a group will do: all equal
    return PromptGroups(first, inverse, not bool(prompt_mask.all()))


def run_prompts(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, padded: bool | None = None
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Prefill: hidden states ``[rows, P, H]`` of the prompts and each layer's keys and values.

    ``padded``: whether any prompt has padding, when the caller knows (else read from ``prompt_mask``).
    """
    keys: list[Tensor] = []
    values: list[Tensor] = []

    def collect(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys.append(k)
        values.append(v)
        return k, v

    if padded is None:
        padded = not bool(prompt_mask.all())
    mask = _prompt_mask_4d(prompt_mask) if padded else CAUSAL
    hidden = decoder_hidden(model, prompt_ids, mask_positions(prompt_mask), mask, collect)
    return hidden, keys, values


def _repeat_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[index]`` along dim 0, with a backward that sums repeated rows in the same order at every run.

    Why: a row of ``x`` repeated in ``index`` gets the sum of its copies' gradients, and the two ways to index
    sum them differently on each device. On CPU, the backward of ``x[index]`` (``index_put_`` with accumulate)
    adds large float tensors with parallel atomic adds when there are several threads, in an order that varies
    from run to run (unless ``torch.use_deterministic_algorithms``), so two identical runs drift apart in the
    last bits from the first optimizer step on; the backward of ``index_select`` (``index_add_``) adds in index
    order. On CUDA it is the other way round: ``x[index]``'s backward sorts the indices and sums each row's
    copies in order, while ``index_add_`` uses atomics.
    """
    return x.index_select(0, index) if x.device.type == "cpu" else x[index]


def shared_prompt_hidden(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    groups: PromptGroups | None = None,
) -> Tensor:
    """``[N, T, H]``: final-normed hidden states that predict each completion token, each distinct prompt run once.

    Rows with the same prompt (the G completions of a group) share one prompt pass: its keys and values are
    indexed out to every row of the group, whose completion tokens attend to them and, causally, to each other.
    Under autograd the gradient of every row flows back into the one shared prompt pass. ``groups``: the rows'
    ``prompt_groups``, when the caller has them (else found here, with a device sync).
    """
    rows, length = completion_ids.shape
    first, inverse, padded = groups if groups is not None else prompt_groups(prompt_ids, prompt_mask)
    prompt_hidden, keys, values = run_prompts(model, prompt_ids[first], prompt_mask[first], padded)
    # Left padding: the last position is every prompt's last token. ``_repeat_rows``, not ``[inverse]``: a
    # deterministic backward (the same below for the keys and values).
    last = _repeat_rows(prompt_hidden[:, -1:], inverse)
    if length == 1:
        return final_norm(model, last)
    # The last completion token predicts nothing: the completion pass runs the first T - 1 tokens.
    inputs = completion_ids[:, :-1]
    steps = torch.arange(length - 1, device=inputs.device)
    positions = prompt_mask.long().sum(-1, keepdim=True) + steps  # continue after the real prompt tokens
    causal = torch.ones(length - 1, length - 1, dtype=torch.bool, device=inputs.device).tril()
    prompt_part = prompt_mask.bool()[:, None, :].expand(rows, length - 1, -1)
    mask = torch.cat([prompt_part, causal.expand(rows, -1, -1)], dim=-1)[:, None]

    def attend_to_prompt(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return (
            torch.cat([_repeat_rows(keys[layer], inverse), k], dim=2),
            torch.cat([_repeat_rows(values[layer], inverse), v], dim=2),
        )

    hidden = decoder_hidden(model, inputs, positions, mask, attend_to_prompt)
    return final_norm(model, torch.cat([last, hidden], dim=1))
