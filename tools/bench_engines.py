"""Generation time of each rollout engine on the same prompts, model and sampling settings (CPU, float32).

    python tools/bench_engines.py                      # lean, lean on the model's forward, transformers (+ vllm)
    python tools/bench_engines.py --prompts 64 --group 8 --tokens 32 --runs 5

Each engine samples ``prompts × group`` completions of exactly ``tokens`` new tokens (EOS held back by
``min_new_tokens``, so every engine generates the same number of tokens) from a tiny Llama (the lean forward's
architecture) and a tiny GPT-2 (any other causal LM: the lean engine then decodes on the model's own forward).
One warm-up call, then the median of ``--runs`` calls. vLLM is measured where it is installed (its start-up is
not counted). This is what ``data.engine: auto`` = ``lean`` rests on (docs/benchmarks.md, "Engines").
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from grpo_lightning.engines import LeanEngine, RolloutEngine, SamplingParams, TransformersEngine
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.rollout.prompts import PromptEncoder


def models(tokenizer) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    size = TinyModelConfig(
        hidden_size=128, num_layers=4, num_heads=4, intermediate_size=256, max_position_embeddings=128
    )
    gpt2 = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=128, n_layer=4, n_head=4,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return {"llama": build_tiny_llama(size, tokenizer).eval(), "gpt2": GPT2LMHeadModel(gpt2).eval()}


def engines(arch: str) -> dict[str, RolloutEngine]:
    out: dict[str, RolloutEngine] = {"lean": LeanEngine()}
    if arch == "llama":  # on GPT-2 the lean engine already runs the model's own forward
        out["lean (model forward)"] = LeanEngine(lean_forward=False)
    out["transformers"] = TransformersEngine()
    if importlib.util.find_spec("vllm") is not None and arch == "llama":
        from grpo_lightning.integrations.vllm.engine import VLLMEngine

        out["vllm"] = VLLMEngine(max_model_len=128, kv_cache_memory_bytes=128 << 20)
    return out


def seconds(engine: RolloutEngine, prompt_ids, prompt_mask, params: SamplingParams, runs: int) -> float:
    generator = torch.Generator().manual_seed(0)
    engine.generate(prompt_ids, prompt_mask, params, generator=generator)  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = engine.generate(prompt_ids, prompt_mask, params, generator=generator)
        times.append(time.perf_counter() - start)
        assert int(out.completion_mask.sum()) == out.completion_ids.size(0) * params.max_new_tokens
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tokenizer = build_char_tokenizer()
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 10 + args.prompts), range(50, 50 + args.prompts))]
    prompt_ids, prompt_mask = PromptEncoder(tokenizer).encode(prompts)
    params = SamplingParams(
        group_size=args.group, max_new_tokens=args.tokens, min_new_tokens=args.tokens, temperature=1.0,
        batch_size=args.prompts * args.group,
    )  # fmt: skip
    tokens = args.prompts * args.group * args.tokens
    print(f"torch threads {torch.get_num_threads()}; {args.prompts} prompts × G {args.group} × {args.tokens} tokens")
    print("\n| model | engine | s per call | tokens/s |\n|---|---|---|---|")
    for arch, model in models(tokenizer).items():
        for name, engine in engines(arch).items():
            engine.setup(model, tokenizer)
            engine.load_weights(model, 0)
            s = seconds(engine, prompt_ids, prompt_mask, params, args.runs)
            engine.close()
            print(f"| {arch} | {name} | {s:.2f} | {tokens / s:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
