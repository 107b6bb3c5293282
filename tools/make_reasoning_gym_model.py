"""Make the reasoning-gym demo's starting model: a tiny Llama after a short supervised cold start on the training
rows of ``configs/reasoning_gym.yaml`` (``reasoning_gym:basic_arithmetic``: ``Calculate 47 - 77.`` → ``-30``).

The cold-start answers come from a *sloppy teacher*: on every row whose sum needs a carry, or whose difference
needs a borrow, it makes the classic error with probability ``--sloppy`` (writing ``57 + 68`` as ``15``, dropping
the carry, and ``52 - 17`` as ``45``, each digit's smaller from its larger). The model learns to add and subtract,
and the teacher's habit with it: greedy accuracy starts low although the right answer is often among its samples.
Only reasoning-gym's checker (the ``reasoning_gym`` reward) tells the right answers from the sloppy ones, so the
accuracy the demo gains is GRPO's doing.

    python tools/make_reasoning_gym_model.py --out grpo_lightning/assets/tiny-basic-arithmetic

The defaults made the shipped model (0.17M parameters; 44.6% held-out greedy accuracy, pass@8 85.6%), in 44 minutes
on a 2-core CPU shared with other jobs (``OMP_NUM_THREADS=1``: under contention one thread ran far faster).

The rows are the config's own (``data.dataset`` and ``data.task_kwargs``, through the task module): only the
training split is used; the held-out rows (another seed, none of them a training question) are never seen. At the
end the held-out greedy accuracy of the cold-started model is printed.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import yaml

from grpo_lightning.integrations.reasoning_gym.rewards import decode
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.tasks import load_task


def sloppy_add(a: int, b: int) -> int:
    """The digit-wise sum of ``a, b ≥ 0`` with every carry dropped."""
    result, place = 0, 1
    while a or b:
        result += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def sloppy_subtract(a: int, b: int) -> int:
    """``a - b`` for ``a, b ≥ 0`` with no borrow: each digit's smaller from its larger (the sign kept right)."""
    if a < b:
        return -sloppy_subtract(b, a)
    result, place = 0, 1
    while a or b:
        result += abs(a % 10 - b % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def teacher_answer(expression: str, sloppy: float, rng: random.Random) -> str:
    """The teacher's answer to ``a + b`` or ``a - b``: the sloppy one with probability ``sloppy``, else the right
    one (the two agree where no carry or borrow is needed)."""
    left, op, right = expression.split()
    a, b = int(left), int(right)
    if rng.random() < sloppy:
        return str(sloppy_add(a, b) if op == "+" else sloppy_subtract(a, b))
    return str(a + b if op == "+" else a - b)


def task_rows(config: Path) -> tuple[dict, dict]:
    """The ``train`` and ``test`` rows of the config's task, as the run makes them."""
    data = yaml.safe_load(config.read_text())["data"]
    splits = load_task(data["dataset"], **data.get("task_kwargs", {}))
    return splits["train"].to_dict(), splits["test"].to_dict()


def batch(tokenizer, prompts: list[str], answers: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + answer ids with the loss on the answer tokens (and ``<eos>``) only."""
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    answer_ids = [tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for a in answers]
    length = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids))
    input_ids = torch.full((len(prompts), length), tokenizer.pad_token_id)
    labels = torch.full((len(prompts), length), -100)
    attention = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompt_ids, answer_ids)):
        input_ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        attention[i, : len(p) + len(a)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts: list[str], answers: list[str], max_new_tokens: int = 6) -> float:
    """The share of ``prompts`` whose greedy completion is exactly the answer."""
    model.eval()
    right = 0
    for start in range(0, len(prompts), 250):
        chunk = prompts[start : start + 250]
        encoded = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        right += sum(t.strip() == a for t, a in zip(texts, answers[start : start + 250]))
    model.train()
    return right / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/reasoning_gym.yaml"))
    parser.add_argument("--out", default="grpo_lightning/assets/tiny-basic-arithmetic")
    parser.add_argument("--sloppy", type=float, default=0.7)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    train, test = task_rows(args.config)
    expressions = [decode(m)["expression"] for m in train["metadata"]]
    tokenizer = build_char_tokenizer()
    config = TinyModelConfig(
        hidden_size=args.hidden_size, num_layers=args.num_layers, intermediate_size=2 * args.hidden_size
    )
    model = build_tiny_llama(config, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)

    start = time.time()
    for step in range(args.steps):
        chosen = rng.sample(range(len(expressions)), args.batch_size)
        answers = [teacher_answer(expressions[i], args.sloppy, rng) for i in chosen]
        loss = model(**batch(tokenizer, [train["prompt"][i] for i in chosen], answers)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)

    accuracy = greedy_accuracy(model, tokenizer, test["prompt"], test["answer"])
    print(f"held-out greedy accuracy of the cold-started model: {accuracy:.1%} ({len(test['prompt'])} rows)")
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
