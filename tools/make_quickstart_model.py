"""Make the quickstart's starting model: a tiny Llama after a short supervised cold start on arithmetic.

The cold-start data come from a *sloppy teacher*: on every training prompt whose sum needs a carry, the teacher
drops the carry with probability ``--drop_carry`` (writing ``57+68=15`` instead of ``125``). The resulting model
can add, but it has learnt the teacher's systematic error, so its greedy accuracy starts low although the right
answer is often among its samples. That is the situation GRPO is for: the reward (exact answer) is the only thing
that tells the right answers from the sloppy ones, so all the accuracy the quickstart gains is GRPO's doing.

    python tools/make_quickstart_model.py --out grpo_lightning/assets/tiny-arith

Only the training split of the ``arithmetic`` task is used; the held-out prompts are never seen.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.tasks.arithmetic import addition_pairs, format_prompt


def sloppy_sum(a: int, b: int) -> int:
    """The digit-wise sum with every carry dropped."""
    result, place = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def teacher_answer(a: int, b: int, drop_carry: float, rng: random.Random) -> int:
    return sloppy_sum(a, b) if rng.random() < drop_carry else a + b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="grpo_lightning/assets/tiny-arith")
    parser.add_argument("--drop_carry", type=float, default=0.7)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_char_tokenizer()
    config = TinyModelConfig(
        hidden_size=args.hidden_size, num_layers=args.num_layers, intermediate_size=2 * args.hidden_size
    )
    model = build_tiny_llama(config, tokenizer)
    train_pairs = addition_pairs()["train"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)

    start = time.time()
    for step in range(args.steps):
        pairs = rng.sample(train_pairs, args.batch_size)
        prompts = [format_prompt(a, b) for a, b in pairs]
        answers = [str(teacher_answer(a, b, args.drop_carry, rng)) + tokenizer.eos_token for a, b in pairs]
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        answer_ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
        length = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
        input_ids = torch.full((len(pairs), length), tokenizer.pad_token_id)
        labels = torch.full((len(pairs), length), -100)  # loss on answer tokens only
        attention = torch.zeros((len(pairs), length), dtype=torch.long)
        for i, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
            input_ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            attention[i, : len(p) + len(a)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)

    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
