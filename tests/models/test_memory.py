"""Bounded memory: chunked log-probs (values, gradients, peak), bf16 precisions, gradient checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import checksum_reward
from lightning import Callback
from memory_probe import peak_bytes
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import EvalConfig, UpdateConfig
from grpo_lightning.engines.lean import sample_completions
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register

register("memory_checksum")(checksum_reward)


def rollout(vocab: int, rows: int, prompt: int, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random prompts and completions; completions right-padded to random lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (rows, prompt), generator=generator)
    completion_ids = torch.randint(3, vocab, (rows, length), generator=generator)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids.masked_fill(mask == 0, 0), mask


def naive(model: nn.Module, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float):
    """Full logits and a full log_softmax: the reference values."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    log_p = (logits[:, prompt_ids.size(1) - 1 : -1].float() / temperature).log_softmax(-1)
    return log_p.gather(-1, completion_ids[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


class Head(nn.Linear):
    """An output layer that is not a plain ``nn.Linear``: log-probs take the generic chunked path."""


@pytest.mark.parametrize("head", ["linear", "other"])
def test_chunked_logprobs_match_naive_values_and_gradients(tiny_llama: nn.Module, head: str) -> None:
    model = tiny_llama.train()
    if head == "other":
        linear = model.lm_head
        model.lm_head = Head(linear.in_features, linear.out_features, bias=False)
        model.lm_head.weight = linear.weight  # still tied to the input embedding
    inputs = rollout(model.config.vocab_size, rows=5, prompt=4, length=9)
    mask = inputs[3].bool()
    weights = torch.randn(2, *mask.shape)  # an arbitrary loss of log-probs and entropies

    def loss_and_grads(lp: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss = ((weights[0] * lp + weights[1] * ent) * mask).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        return torch.stack([lp[mask], ent[mask]]), grads

    expected, expected_grads = loss_and_grads(*naive(model, *inputs, temperature=0.7))
    lp, ent = completion_logprobs(model, *inputs, temperature=0.7, with_entropy=True, chunk_size=7, micro_batch_size=3)
    assert (lp[~mask] == 0).all()  # padding costs nothing and gets 0
    got, grads = loss_and_grads(lp, ent)
    # float32, the chunked log-softmax against the full one: log-probs and entropies of size ~4-5 (ulp ≈ 5e-7)
    # summed in another order, then gradients summing hundreds of such terms. Bounds of ~40 ulps of the values;
    # measured ≤ 3% of them with AVX-512 and AVX2 kernels, at 1 and 2 threads.
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-4)


def test_chunked_logprobs_peak_memory_at_most_half_of_naive() -> None:
    """The bench_memory.py measurement at a small size: vocabulary 8k, 8 × 128 completion tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    inputs = rollout(config.vocab_size, rows=8, prompt=4, length=128)

    def plain(grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            lp, _ = naive(model, *inputs, temperature=1.0)
            if grad:
                lp.sum().backward()

    def chunked(grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            lp, _ = completion_logprobs(model, *inputs, chunk_size=128)
            if grad:
                lp.sum().backward()

    for grad in (False, True):
        naive_peak, _ = peak_bytes(plain, grad)
        chunked_peak, _ = peak_bytes(chunked, grad)
        assert chunked_peak <= 0.5 * naive_peak, (grad, chunked_peak, naive_peak)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bf16_rounds_on_cpu(tmp_path, precision: str) -> None:
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.04), lr=1e-3, gradient_checkpointing=True)
    data = RolloutDataModule(
        rewards=[RewardSpec("memory_checksum")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6),
        update=UpdateConfig(
            num_iterations=2, mini_batch_size=8
        ),  # with β > 0: old and reference log-probs at rollout time
        prompts_per_round=2,
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    losses = Losses()
    trainer = quiet_trainer(tmp_path, max_epochs=2, precision=precision, callbacks=[losses])
    trainer.fit(module, datamodule=data)
    weights_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert next(module.policy.parameters()).dtype == weights_dtype
    rollout_ = data.last_rollout
    assert torch.isfinite(rollout_.old_logprobs).all() and torch.isfinite(rollout_.ref_logprobs).all()
    assert len(losses.losses) == 4 and all(math.isfinite(loss) for loss in losses.losses)


def test_gradient_checkpointing_same_gradients_and_generation_still_caches() -> None:
    """Checkpointing recomputes each decoder layer in the backward pass and leaves the gradients as they are; and
    the model's own decoder (``lean_forward: false``, or an architecture the lean forward does not cover) still
    samples with its KV cache although ``config.use_cache`` is now off: one new token per forward after the prefill.
    """
    tokenizer = build_char_tokenizer()
    modules = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), gradient_checkpointing=checkpointing)
        module.configure_model()
        modules.append(module)
    plain, checkpointed = modules
    assert not checkpointed.policy.config.use_cache
    layers = checkpointed.policy.model.layers
    layer_calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        # On the attention: transformers checkpoints the layer's ``forward``, inside its hooks, so only the hooks of
        # what the layer calls see the recomputation; and torch stops recomputing once it has every tensor the
        # backward needs (the MLP's may not be), but the attention at the start of the layer is always rerun.
        layer.self_attn.register_forward_hook(lambda *_, i=i: layer_calls.__setitem__(i, layer_calls[i] + 1))
    inputs = rollout(len(tokenizer), rows=4, prompt=5, length=6)
    grads = []
    for module in modules:
        lp, _ = completion_logprobs(module.policy, *inputs)
        grads.append(torch.autograd.grad(lp.sum(), list(module.policy.parameters())))
    assert layer_calls == [2] * len(layers)  # forward, then recomputed in the backward pass
    for a, b in zip(*grads):
        # Two float32 orderings of the same sums (lean forward vs the model's, recomputed): the dtype's defaults
        # (atol 1e-5, rtol 1.3e-6); measured below 3% of them with AVX-512 and AVX2, 1 and 2 threads.
        torch.testing.assert_close(a, b)

    # Sampling: the plain model on the lean forward, the checkpointed one on its own forward (``lean=False``).
    lengths: list[int] = []
    checkpointed.policy.register_forward_pre_hook(
        lambda _module, _args, kwargs: lengths.append(kwargs["input_ids"].size(1)), with_kwargs=True
    )
    outs = []
    for module, lean in ((plain, True), (checkpointed, False)):
        module.policy.eval()
        out = sample_completions(
            module.policy,
            inputs[0],
            inputs[1],
            group_size=2,
            max_new_tokens=5,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            min_new_tokens=5,  # no early end: five tokens, so a prefill and four decoding steps
            greedy=True,
            lean=lean,
        )
        outs.append(out.completion_ids)
    assert lengths == [5, 1, 1, 1, 1]  # the prompt once, then one token per step: the cache holds the rest
    assert torch.equal(*outs)
