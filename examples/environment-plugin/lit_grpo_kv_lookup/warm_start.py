"""A tiny Qwen2-style model that knows how to use the lookup tool, but seldom does.

    python -m lit_grpo_kv_lookup.warm_start tiny-kv-model [--call-frac 0.05] [--steps 450]

A random tiny model never writes a ``<tool_call>`` block, so GRPO would have nothing to reinforce.
As agents are fine-tuned on transcripts before RL, this writes the tiny model of ``lit-grpo init-tiny
--architecture qwen2`` and trains it with plain supervised learning, on the assistant's tokens only,
on scripted conversations in the real chat template (the rows of :func:`sample_row`: four different
digits under the keys a-d, drawn for each row, and a question naming one key). Three in four of
them use the tool:

    user: Which digit is stored under c?
    assistant: <tool_call>{"name": "lookup", "arguments": {"key": "c"}}</tool_call>
    tool: 5
    assistant: The answer is 5.

and the others answer at once without looking (``I do not know.``). The first token of a reply
decides which of the two the model writes; its loss is weighted so that the model learns to open a
tool call in ``--call-frac`` of its replies (default 0.05), while every tool transcript still teaches
the mechanics: the call with the asked key, and copying the value the tool returned into the answer.
The warm-started model therefore scores about 0.05 on the task (``kv_answer``) but calls the tool
correctly when it does call it, and GRPO learns to call it every time
(``configs/tools-quickstart.yaml``). ``--call-frac 1`` gives a model that always calls (the tests').
At the end it prints the three probabilities it was trained for (:func:`tool_use_probabilities`);
with the defaults, for seeds 0, 1 and 2: a call 0.07, 0.04, 0.05, the asked key 0.99, the copy 0.99.

Three things make a 2-layer model learn the copy within a few hundred steps (the previous version of
this warm start, 400 steps with Hugging Face's initialisation on whole transcripts, left it at chance):

* weights drawn with standard deviation 0.1 instead of Hugging Face's 0.02, which at width 64 leaves
  every attention score near zero, so no head starts out looking at the digit;
* for the first ``--short-steps`` steps (default 250), then every other step, the transcripts start
  at the user's turn, without the 800-token system prompt that describes the tool: the digit is then
  one of 80 tokens, not 900 (with fewer such steps one seed in three had not learned the copy by 450);
* every transcript begins with the same system prompt, which is run once per batch and shared
  (a key-value cache): forward and backward over 16 transcripts took 0.12-0.15 s against 0.73-0.96 s
  for a plain padded pass (one thread, measured under load).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from lit_grpo.models import cache_argument
from lit_grpo_kv_lookup import KeyValueLookup

KEYS = "abcd"
DIGITS = "0123456789"
TOOLS = [KeyValueLookup.lookup]
TOOL_TRANSCRIPT_FRAC = 0.75  # of the training transcripts; the others answer "I do not know."


def sample_row(rng: random.Random) -> dict:
    """One data row: four different digits under the keys a-d, and the asked key.

    The values are drawn for each row and are not in the prompt, so without the tool the best
    answer is a guess, right one time in ten (configs/data/kv_lookup.jsonl holds 512 such rows)."""
    store = dict(zip(KEYS, rng.sample(DIGITS, len(KEYS))))
    key = rng.choice(KEYS)
    return {"prompt": f"Which digit is stored under {key}?", "store": json.dumps(store), "key": key}


def tool_transcript(row: dict) -> list[dict]:
    """Look the asked key up, read the value, answer with it."""
    value = json.loads(row["store"])[row["key"]]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": row["key"]}}}
    return [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "lookup", "content": value},
        {"role": "assistant", "content": f"The answer is {value}."},
    ]


def give_up_transcript(row: dict) -> list[dict]:
    """Answer at once, without looking the value up (no digit: ``kv_answer`` scores it 0)."""
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": "I do not know."}]


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


def training_example(tokenizer, row: dict, rng: random.Random, call_frac: float) -> tuple[list[int], list[float]]:
    """A tool transcript (three in four) or an answer without the tool, as token ids and per-token loss weights.

    The weights are 1 on the assistant's tokens, except on the first token of the first reply,
    where the model decides whether to call: there a tool transcript weighs ``call_frac`` and an
    answer without it ``1 - call_frac`` (each divided by how often it is drawn, then scaled so that
    the larger is 1), so that the model learns to open a call with probability ``call_frac``."""
    uses_tool = rng.random() < TOOL_TRANSCRIPT_FRAC
    messages = tool_transcript(row) if uses_tool else give_up_transcript(row)
    ids, mask = assistant_token_mask(tokenizer, messages, TOOLS)
    weights = [float(own) for own in mask]
    # the decision's expected weight is call_frac for a call, 1 - call_frac for an answer
    tool_weight, answer_weight = call_frac / TOOL_TRANSCRIPT_FRAC, (1.0 - call_frac) / (1.0 - TOOL_TRANSCRIPT_FRAC)
    weights[mask.index(1)] = (tool_weight if uses_tool else answer_weight) / max(tool_weight, answer_weight)
    return ids, weights


def from_user_turn(tokenizer, ids: list[int], weights: list[float]) -> tuple[list[int], list[float]]:
    """The example without its system prompt: from the second ``<|im_start|>`` (the user's turn) on."""
    start = ids.index(tokenizer.convert_tokens_to_ids("<|im_start|>"), 1)
    return ids[start:], weights[start:]


def shared_prefix_logits(model, sequences: list[list[int]], pad_token_id: int, shared: int) -> torch.Tensor:
    """The logits at positions ``shared - 1 ..`` of right-padded ``sequences``, whose first ``shared``
    tokens are the same: those are run once, and their keys and values are shared by every row.
    Row r's ``logits[r, t]`` predicts ``sequences[r][shared + t]``."""
    cache = DynamicCache()
    last_shared = None
    if shared:
        prefix = torch.tensor([sequences[0][:shared]])
        last_shared = model(input_ids=prefix, use_cache=True, **cache_argument(model, cache)).logits[:, -1:]
        cache.batch_repeat_interleave(len(sequences))  # one copy per row; gradients flow back into the prefix
    width = max(len(ids) for ids in sequences) - shared
    input_ids = torch.full((len(sequences), width), pad_token_id)
    attention_mask = torch.zeros((len(sequences), shared + width), dtype=torch.long)
    attention_mask[:, :shared] = 1
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids) - shared] = torch.tensor(ids[shared:])
        attention_mask[row, shared : len(ids)] = 1
    position_ids = torch.arange(shared, shared + width).expand(len(sequences), -1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                   **cache_argument(model, cache)).logits
    if last_shared is None:  # nothing shared: the first token has no prediction
        return torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=1)
    return torch.cat([last_shared.expand(len(sequences), -1, -1), logits], dim=1)


def common_prefix_length(sequences: list[list[int]]) -> int:
    """How many tokens all sequences begin with."""
    length = 0
    while all(len(ids) > length for ids in sequences) and len({ids[length] for ids in sequences}) == 1:
        length += 1
    return length


def shared_prefix_loss(model, examples: list[tuple[list[int], list[float]]], pad_token_id: int) -> torch.Tensor:
    """The weighted next-token loss of a batch, ``sum(weight * -log p(token)) / sum(weight)``,
    with the tokens every example begins with (the system prompt) run once (:func:`shared_prefix_logits`).
    It equals the loss of a plain forward pass over the padded batch (tests/test_kv_lookup.py)."""
    sequences = [ids for ids, _ in examples]
    first_trained = min(next(i for i, weight in enumerate(weights) if weight > 0) for _, weights in examples)
    shared = min(common_prefix_length(sequences), first_trained)  # every trained token gets its logits
    logits = shared_prefix_logits(model, sequences, pad_token_id, shared)[:, :-1]  # logits[:, t] predicts token shared + t
    targets = torch.full(logits.shape[:2], pad_token_id)
    weights = torch.zeros(logits.shape[:2])
    for row, (ids, token_weights) in enumerate(examples):
        targets[row, : len(ids) - shared] = torch.tensor(ids[shared:])
        weights[row, : len(ids) - shared] = torch.tensor(token_weights[shared:])
    token_losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (token_losses * weights.flatten()).sum() / weights.sum()


@torch.no_grad()
def tool_use_probabilities(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """What the model does at the three choices of a tool transcript, averaged over ``rows``: the
    probability that its reply opens a tool call (``call``), that the call names the asked key
    (``asked_key``), and that the answer after the tool's result is the value read (``copy``)."""
    was_training = model.training
    model.eval()
    key_offset = len(tokenizer('<tool_call>\n{"name": "lookup", "arguments": {"key": "', add_special_tokens=False)["input_ids"])
    answer_offset = len(tokenizer("The answer is ", add_special_tokens=False)["input_ids"])
    sequences, positions = [], []
    for row in rows:
        ids, mask = assistant_token_mask(tokenizer, tool_transcript(row), TOOLS)
        call_start = mask.index(1)
        answer_start = mask.index(1, mask.index(0, call_start))  # the second reply
        sequences.append(ids)
        positions.append({"call": call_start, "asked_key": call_start + key_offset, "copy": answer_start + answer_offset})
    shared = min(common_prefix_length(sequences), min(choices["call"] for choices in positions))
    probabilities = shared_prefix_logits(model, sequences, tokenizer.pad_token_id, shared).softmax(-1)
    model.train(was_training)
    totals = dict.fromkeys(positions[0], 0.0)
    for row, choices in enumerate(positions):
        for choice, position in choices.items():
            totals[choice] += probabilities[row, position - shared, sequences[row][position]].item()
    return {choice: total / len(rows) for choice, total in totals.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_grpo_kv_lookup.warm_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--call-frac", type=float, default=0.05, help="how often the model opens a tool call (1: always)")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--short-steps", type=int, default=250,
                        help="steps on transcripts without the system prompt before every other step has it")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--init-std", type=float, default=0.1, help="standard deviation of the initial weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64, help="a multiple of 32 (vLLM's CPU attention: head size 32)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.call_frac <= 1.0:
        parser.error(f"--call-frac must be between 0 and 1, got {args.call_frac}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.tiny import build_tiny_model

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    build_tiny_model(args.out, architecture="qwen2", hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                     num_hidden_layers=2, num_attention_heads=args.hidden_size // 32, num_key_value_heads=1,
                     max_position_embeddings=2048, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    with torch.no_grad():  # redraw the matrices (embeddings, projections) wider; biases stay 0 and norms 1
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, args.init_std)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    for step in range(args.steps):
        examples = [training_example(tokenizer, sample_row(rng), rng, args.call_frac) for _ in range(args.batch_size)]
        if step < args.short_steps or step % 2 == 0:  # without the system prompt: at first, then every other step
            examples = [from_user_turn(tokenizer, ids, weights) for ids, weights in examples]
        loss = shared_prefix_loss(model, examples, tokenizer.pad_token_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(args.out)
    evaluation_rng = random.Random(f"evaluation {args.seed}")
    measured = tool_use_probabilities(model, tokenizer, [sample_row(evaluation_rng) for _ in range(64)])
    print(f"wrote a warm-started tiny tool-calling model to {args.out}: it opens a tool call with probability "
          f"{measured['call']:.2f}; in a call it names the asked key with {measured['asked_key']:.2f}, and after the "
          f"tool's result it answers the value read with {measured['copy']:.2f}")


if __name__ == "__main__":
    main()
