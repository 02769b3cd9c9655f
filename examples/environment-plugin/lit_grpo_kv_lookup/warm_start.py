"""A tiny Qwen2-style model that already calls the lookup tool, some of the time correctly.

    python -m lit_grpo_kv_lookup.warm_start tiny-kv-model [--steps 300]

A random tiny model never writes a ``<tool_call>`` block, so a quickstart-sized run would show no
tool use at all. As agents are fine-tuned on tool-call transcripts before RL, this writes the tiny
model of ``lit-grpo init-tiny --architecture qwen2`` and trains it briefly, with plain supervised
learning on the assistant tokens, on scripted conversations in the real chat template: look a key
up, read the value, answer. In ``--wrong-key-frac`` of them (default 0.25) the script looks up a
random key instead of the asked one, so the warm-started policy is right only part of the time and
GRPO has something to improve (``rewards/kv_lookup/mean``, ``rewards/kv_answer/mean``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from lit_grpo_kv_lookup import KeyValueLookup

KEYS = "abcd"


def sample_row(rng: random.Random) -> dict:
    """One data row: a store of digits under the keys a-d, and the asked key."""
    store = {key: str(rng.randrange(10)) for key in KEYS}
    key = rng.choice(KEYS)
    return {"prompt": f"Which digit is stored under {key}?", "store": json.dumps(store), "key": key}


def transcript(row: dict, rng: random.Random, wrong_key_frac: float) -> list[dict]:
    store = json.loads(row["store"])
    key = rng.choice(KEYS) if rng.random() < wrong_key_frac else row["key"]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
    return [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "lookup", "content": store[key]},
        {"role": "assistant", "content": f"The answer is {store[key]}."},
    ]


def assistant_token_mask(tokenizer, messages: list[dict], tools: list) -> tuple[list[int], list[int]]:
    """The rendered conversation's tokens and 1 on the assistant's own (what the policy writes)."""
    ids, mask = [], []
    for end in range(1, len(messages) + 1):
        is_assistant = messages[end - 1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(messages[:end], tools=tools, tokenize=False)
        if is_assistant:  # the header "<|im_start|>assistant\n" is the prompt's, not the policy's
            header = tokenizer.apply_chat_template(messages[: end - 1], tools=tools, tokenize=False, add_generation_prompt=True)
            prefix = tokenizer(header, add_special_tokens=False)["input_ids"]
            new = tokenizer(text, add_special_tokens=False)["input_ids"]
            own = new[len(prefix) :]  # the turn, up to its <|im_end|>; the template's newline after it is not the policy's
            end_of_turn = len(own) - own[::-1].index(tokenizer.eos_token_id) if tokenizer.eos_token_id in own else len(own)
            mask += [0] * (len(prefix) - len(ids)) + [1] * end_of_turn + [0] * (len(own) - end_of_turn)
        else:
            new = tokenizer(text, add_special_tokens=False)["input_ids"]
            mask += [0] * (len(new) - len(ids))
        ids = new
    return ids, mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_grpo_kv_lookup.warm_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--wrong-key-frac", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64, help="a multiple of 32 (vLLM's CPU attention: head size 32)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.tiny import build_tiny_model

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    build_tiny_model(args.out, architecture="qwen2", hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                     num_hidden_layers=2, num_attention_heads=args.hidden_size // 32, num_key_value_heads=1,
                     max_position_embeddings=2048, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    tools = [KeyValueLookup.lookup]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    for step in range(args.steps):
        batch = [assistant_token_mask(tokenizer, transcript(sample_row(rng), rng, args.wrong_key_frac), tools)
                 for _ in range(args.batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), torch.tensor(-100))
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(args.out)
    print(f"wrote a warm-started tiny tool-calling model to {args.out}")


if __name__ == "__main__":
    main()
