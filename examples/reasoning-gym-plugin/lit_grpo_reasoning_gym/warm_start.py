"""A tiny model that has seen some reasoning-gym answers, for a CPU demo where GRPO's reward visibly rises.

    python -m lit_grpo_reasoning_gym.warm_start tiny-rg-model [--steps 80]

A random tiny model writes random characters; on its own, a quickstart-sized run barely moves it. As
models are fine-tuned before RL, this writes the tiny model of ``lit-grpo init-tiny`` and trains it
briefly with plain supervised learning on the answers (not the questions) of problems reasoning-gym
generates for the tasks of ``configs/reasoning-gym-quickstart.yaml``, from another seed than the run's
(``--seed``), so no training prompt is seen. It stops early on purpose: the model answers part of the
problems, and GRPO has something to improve.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from lit_grpo_reasoning_gym import generate

TASKS = [
    {"name": "spell_backward", "weight": 3.0, "config": {"min_word_len": 3, "max_word_len": 3}},
    {"name": "letter_counting", "weight": 1.0, "config": {}},
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_grpo_reasoning_gym.warm_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=7, help="the problems' seed (the quickstart trains on seed 42)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.tiny import build_tiny_model

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    build_tiny_model(args.out, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    problems = list(generate({"datasets": TASKS, "size": args.steps * args.batch_size, "seed": args.seed}))
    rng.shuffle(problems)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    for step in range(args.steps):
        batch = problems[step * args.batch_size : (step + 1) * args.batch_size]
        encoded = []
        for problem in batch:
            prompt = tokenizer(problem["question"], add_special_tokens=False)["input_ids"]
            answer = tokenizer(problem["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            encoded.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
        width = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
        labels = torch.full((len(encoded), width), -100)
        attention = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(encoded):  # left-padded, as lit-grpo samples
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
            labels[row, width - len(ids) :] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), torch.tensor(-100))
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # each row's own positions, from its first token
        loss = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(args.out)
    print(f"wrote a warm-started tiny model to {args.out}")


if __name__ == "__main__":
    main()
