"""Train a tiny reward model for the ``arithmetic`` task: right sums against the sloppy teacher's carry-less ones.

    python tools/train_reward_model.py --init runs/pipeline/1_cold_start_sft/hf --out runs/pipeline/reward_model

The model is an ``AutoModelForSequenceClassification`` with one output (a logit: "this answer is right"), its
backbone and tokenizer taken from ``--init`` (a causal LM folder, e.g. the cold-start SFT model, as reward models
usually start from the SFT model) or, without it, a random built-in tiny Llama. Each training example is a
training-split prompt with its right sum (label 1) or a wrong one (label 0): the carry-less sum of
``tools/make_quickstart_model.py``'s sloppy teacher where it differs, else the right sum with one digit changed.
Texts are rendered as the ``reward_model`` reward renders them at scoring time. The folder it writes is what
``model.rewards: [{name: reward_model, kwargs: {model_name_or_path: ...}}]`` takes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaForSequenceClassification

from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.rewards.model import _chat  # the rendering reward_model scores: train on the same text
from grpo_lightning.tasks.arithmetic import addition_pairs, format_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_quickstart_model import sloppy_sum  # noqa: E402  (the quickstart's teacher, not a copy of it)


def wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A wrong sum of ``a + b``: the teacher's carry-less one where it differs, else one digit changed."""
    sloppy = sloppy_sum(a, b)
    if sloppy != a + b:
        return sloppy
    digits = list(str(a + b))
    position = rng.randrange(len(digits))
    digits[position] = rng.choice([d for d in "0123456789" if d != digits[position]])
    return int("".join(digits))


def render(tokenizer: object, prompt: str, completion: str) -> str:
    """The text ``reward_model`` scores for this pair (chat template when the tokenizer has one)."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return _chat(tokenizer, messages, prompt + completion, False)


def make_batch(pairs: list[tuple[int, int]], rng: random.Random) -> tuple[list[str], list[str], torch.Tensor]:
    """Half right, half wrong answers for ``pairs``: prompts, completions and 1/0 labels."""
    prompts, completions, labels = [], [], []
    for a, b in pairs:
        right = rng.random() < 0.5
        prompts.append(format_prompt(a, b))
        completions.append(str(a + b if right else wrong_answer(a, b, rng)))
        labels.append(float(right))
    return prompts, completions, torch.tensor(labels)


def load(init: str | None, seed: int) -> tuple[torch.nn.Module, object]:
    """The classifier and its tokenizer: from a causal LM folder (new score head), or a random tiny Llama."""
    torch.manual_seed(seed)
    if init is None:
        tokenizer = build_char_tokenizer()
        config = build_tiny_llama(TinyModelConfig(), tokenizer).config
        config.num_labels = 1
        model = LlamaForSequenceClassification(config)
    else:
        tokenizer = AutoTokenizer.from_pretrained(init)
        model = AutoModelForSequenceClassification.from_pretrained(init, num_labels=1)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


@torch.no_grad()
def accuracy(model: torch.nn.Module, tokenizer: object, pairs: list[tuple[int, int]], seed: int) -> float:
    """Share of held-out (right or wrong) answers the model classifies correctly (logit > 0 = right)."""
    model.eval()
    prompts, completions, labels = make_batch(pairs, random.Random(seed))
    texts = [render(tokenizer, p, c) for p, c in zip(prompts, completions)]
    inputs = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    logits = model(**inputs).logits[:, 0]
    model.train()
    return ((logits > 0).float() == labels).float().mean().item()


def main(argv: list[str] | None = None) -> float:
    """Command line; returns the held-out classification accuracy."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", help="causal LM folder whose backbone and tokenizer start the reward model")
    parser.add_argument("--out", required=True, help="folder to write the reward model to")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    rng = random.Random(args.seed)
    model, tokenizer = load(args.init, args.seed)
    splits = addition_pairs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model.train()
    for step in range(args.steps):
        prompts, completions, labels = make_batch(rng.sample(splits["train"], args.batch_size), rng)
        texts = [render(tokenizer, p, c) for p, c in zip(prompts, completions)]
        inputs = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        loss = F.binary_cross_entropy_with_logits(model(**inputs).logits[:, 0], labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"reward model step {step:4d}  loss {loss.item():.4f}", flush=True)
    held_out = accuracy(model, tokenizer, splits["test"], args.seed)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(
        f"reward model: held-out accuracy (right vs wrong sums) {held_out:.3f}; saved to {args.out} "
        f"({time.perf_counter() - start:.0f} s)"
    )
    return held_out


if __name__ == "__main__":
    main()
