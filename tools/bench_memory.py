"""Peak memory: chunked log-probs vs a naive full log-softmax, and a LoRA update vs a full fine-tune (β > 0).

    python tools/bench_memory.py                      # 32k vocabulary, 64 × 512 completion tokens (~1 min on CPU)
    python tools/bench_memory.py --rows 16 --backward # also forward + backward, at a size that fits a laptop

Method (``tools/memory_probe.py: PeakMemory``): a ``TorchDispatchMode`` records the bytes of every tensor storage
created inside the measured block, from the operation creating it until the storage is freed, and reports the
highest total. It counts what the code keeps alive (logits, their float32 copies, softmax outputs, saved
activations, gradients, optimizer state), on CPU as on GPU, without the noise of process RSS; kernel-internal
scratch buffers are not seen. Inputs and weights that exist before a block are not counted in it.

1. Log-probs of the completion tokens (no grad, as at rollout time), one model of a small hidden size with a 32k
   vocabulary: ``naive`` takes the model's full ``[B, T, V]`` logits and a full ``log_softmax``;
   ``chunked`` is ``completion_logprobs``: the output layer projects ``--chunk`` tokens at a time.
2. One GRPO update with β > 0 (module built inside the block: policy, reference, gradients, AdamW state,
   activations): full fine-tuning (a frozen copy as reference) vs LoRA (reference = adapter disabled), without
   and with gradient checkpointing.
"""

from __future__ import annotations

import argparse
import time

import torch
from memory_probe import peak_bytes, update_peak_bytes  # tools/memory_probe.py, beside this script
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lightning import GRPOModule, ObjectiveConfig
from grpo_lightning.lora import LoraConfig
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.tiny import TinyModelConfig

GB = 1024**3


def naive_logprobs(
    model: torch.nn.Module, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *, with_grad: bool
) -> torch.Tensor:
    """Full-vocabulary logits of every completion position, then a full ``log_softmax`` and a gather."""
    with torch.set_grad_enabled(with_grad):
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        logits = model(input_ids=ids, logits_to_keep=completion_ids.size(1) + 1, use_cache=False).logits[:, :-1]
        logprobs = logits.float().log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)
        if with_grad:
            logprobs.sum().backward()
    return logprobs.detach()


def chunked_logprobs(
    model: torch.nn.Module, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *, with_grad: bool, chunk: int
) -> torch.Tensor:
    """``completion_logprobs`` as the rollout (no grad) and the update (with grad) run it."""
    with torch.set_grad_enabled(with_grad):
        ones = torch.ones_like
        logprobs, _ = completion_logprobs(
            model, prompt_ids, ones(prompt_ids), completion_ids, ones(completion_ids), chunk_size=chunk
        )
        if with_grad:
            logprobs.sum().backward()
    return logprobs.detach()


def bench_logprobs(args: argparse.Namespace, rows: int, *, with_grad: bool) -> None:
    """Print both peaks, their ratio and the largest difference between the two results."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=args.prompt + args.length + 1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    prompt_ids = torch.randint(0, args.vocab, (rows, args.prompt))
    completion_ids = torch.randint(0, args.vocab, (rows, args.length))
    results = {}
    for name, fn, extra in (("naive", naive_logprobs, {}), ("chunked", chunked_logprobs, {"chunk": args.chunk})):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        peak, logprobs = peak_bytes(fn, model, prompt_ids, completion_ids, with_grad=with_grad, **extra)
        results[name] = (peak, logprobs, time.perf_counter() - start)
    mode = "forward + backward" if with_grad else "no grad (rollout)"
    print(f"log-probs, {mode}: vocabulary {args.vocab}, {rows} × {args.length} completion tokens, hidden {args.hidden}")
    for name, (peak, _, seconds) in results.items():
        print(f"  {name:8s} peak {peak / GB:7.3f} GiB   ({seconds:.1f} s)")
    (naive, naive_lp, _), (chunked, chunked_lp, _) = results["naive"], results["chunked"]
    diff = (naive_lp - chunked_lp).abs().max().item()
    print(f"  chunked / naive = {chunked / naive:.4f}   max |Δ log-prob| = {diff:.2e}")


def bench_lora(args: argparse.Namespace) -> None:
    """Print the peak of one GRPO update with β > 0: full fine-tuning vs LoRA, without and with checkpointing."""
    size = TinyModelConfig(hidden_size=512, num_layers=4, num_heads=8, intermediate_size=1408)
    print(
        "one GRPO update, beta = 0.04, 13M-parameter model, 16 × (32 + 64) tokens "
        "(policy, reference, gradients, AdamW state, activations):"
    )
    for checkpointing in (False, True):
        peaks = {}
        for name, lora in (("full fine-tune", None), (f"LoRA r={args.lora_rank}", LoraConfig(r=args.lora_rank))):

            def build(lora: LoraConfig | None = lora, checkpointing: bool = checkpointing) -> GRPOModule:
                return GRPOModule(
                    tiny_model=size,
                    objective=ObjectiveConfig(beta=0.04),
                    lora=lora,
                    gradient_checkpointing=checkpointing,
                )

            peaks[name] = update_peak_bytes(build, rows=16, prompt_len=32, completion_len=64)
        line = "   ".join(f"{name} {peak / 2**20:6.1f} MiB" for name, peak in peaks.items())
        full, lora = peaks.values()
        print(f"  gradient checkpointing {'on ' if checkpointing else 'off'}: {line}   LoRA / full = {lora / full:.3f}")


def main() -> None:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--rows", type=int, default=64, help="completions in the micro-batch")
    parser.add_argument("--length", type=int, default=512, help="completion tokens per row")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=1024, help="model.logprob_chunk_size")
    parser.add_argument("--backward", action="store_true", help="also measure forward + backward")
    parser.add_argument("--backward-rows", type=int, default=16, help="rows for the forward + backward run")
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    bench_logprobs(args, args.rows, with_grad=False)
    if args.backward:
        bench_logprobs(args, args.backward_rows, with_grad=True)
    bench_lora(args)


if __name__ == "__main__":
    main()
