"""Make the tool-calling demo's starting model: a tiny Llama after a short cold start on calculator traces.

The traces come from an *unreliable teacher* on the ``multiplication`` task's training prompts (3–4 digit
products, which a 0.13M-parameter model cannot compute in its head):

- with probability ``--p_head`` it answers in its head: a number of the right size whose first two digits are
  right and the rest made up (almost always wrong);
- otherwise it calls the calculator, ``<tool>calculator: a*b</tool>``, and copies the result after
  ``<result>...</result>``; with probability ``--p_typo`` it miscopies one digit of the expression first.

The model learns both habits. Greedy decoding follows the more frequent one (answering in its head), so held-out
accuracy starts low, while a good share of its samples call the calculator correctly. Only the exact-answer reward
of a multi-turn GRPO run (``configs/tools_calculator.yaml``) can tell it which habit pays. The observation tokens
(the calculator's results) are left out of the loss here as they are in GRPO: the model never learns to predict
them, only to use them.

    python tools/make_calculator_model.py --out grpo_lightning/assets/tiny-calc
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from grpo_lightning.integrations.environments.tools import calculator
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.tasks.multiplication import format_prompt, multiplication_pairs


def head_guess(product: int, rng: random.Random) -> str:
    """What answering in one's head gives: the leading two digits right, the rest made up."""
    digits = str(product)
    return digits[:2] + "".join(rng.choice("0123456789") for _ in digits[2:])


def miscopy(text: str, rng: random.Random) -> str:
    """``text`` with one of its digits replaced by another."""
    places = [i for i, c in enumerate(text) if c.isdigit()]
    i = rng.choice(places)
    return text[:i] + rng.choice([d for d in "0123456789" if d != text[i]]) + text[i + 1 :]


def teacher_trace(a: int, b: int, p_head: float, p_typo: float, rng: random.Random) -> list[tuple[str, bool]]:
    """The teacher's trajectory after the prompt, as ``(text, is_policy)`` segments."""
    if rng.random() < p_head:
        return [(head_guess(a * b, rng), True)]
    expression = f"{a}*{b}"
    if rng.random() < p_typo:
        expression = miscopy(expression, rng)
    result = calculator(expression)
    return [(f"<tool>calculator: {expression}</tool>", True), (f"<result>{result}</result>", False), (result, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="grpo_lightning/assets/tiny-calc")
    parser.add_argument("--p_head", type=float, default=0.65)
    parser.add_argument("--p_typo", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch_size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_char_tokenizer()
    config = TinyModelConfig(
        hidden_size=args.hidden_size, num_layers=args.num_layers, intermediate_size=2 * args.hidden_size
    )
    model = build_tiny_llama(config, tokenizer)
    train_pairs = multiplication_pairs()["train"]  # the held-out pairs are never seen
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    start = time.time()
    for step in range(args.steps):
        rows = []
        for a, b in rng.sample(train_pairs, args.batch_size):
            ids, labels = encode(format_prompt(a, b)), []
            labels = [-100] * len(ids)
            for text, policy in [*teacher_trace(a, b, args.p_head, args.p_typo, rng), (tokenizer.eos_token, True)]:
                piece = encode(text)
                ids += piece
                labels += piece if policy else [-100] * len(piece)  # observations: context, not targets
            rows.append((ids, labels))
        length = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), length), tokenizer.pad_token_id)
        targets = torch.full((len(rows), length), -100)
        attention = torch.zeros((len(rows), length), dtype=torch.long)
        for i, (ids, labels) in enumerate(rows):
            input_ids[i, : len(ids)], targets[i, : len(ids)] = torch.tensor(ids), torch.tensor(labels)
            attention[i, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)

    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
