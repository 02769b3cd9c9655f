"""A scripted policy for multi-turn tests: deterministic turns that call tools, in place of sampling.

:func:`scripted_generate_from_ids` stands in for ``lit_grpo.rollout.engines.policy.generate_from_ids`` (patched
into ``lit_grpo.train.module``, so under FSDP2 the weights are still gathered around every call). For
each context it finds the question (the last user message of the prompt) and the number of tool
results so far, and writes that turn of :data:`SCRIPTS` (``{n}`` is replaced by the question's
number), followed by ``<|im_end|>``; the turn is cut at ``max_new_tokens`` like a real sampler.
"""

from __future__ import annotations

import re

import torch

# question pattern -> turns; a question "Add 3 twice" -> the script "twice" with n = 3
SCRIPTS = {
    "once": [
        '<tool_call>\n{{"name": "add", "arguments": {{"a": {n}, "b": 1}}}}\n</tool_call>',
        "The answer is {n}+1.",
    ],
    "twice": [
        '<tool_call>\n{{"name": "add", "arguments": {{"a": {n}, "b": 1}}}}\n</tool_call>',
        '<tool_call>\n{{"name": "add", "arguments": {{"a": {n}, "b": 2}}}}\n</tool_call>',
        "Done.",
    ],
    "never": ["No tools needed: {n}."],
    "broken": [
        '<tool_call>\n{{"name": "add", "arguments": {{"a": {n}}}}}\n</tool_call>',  # b is missing
        '<tool_call>\n{{"name": "subtract", "arguments": {{}}}}\n</tool_call>',  # no such tool
        "<tool_call>\nnot json\n</tool_call>",
        "Gave up.",
    ],
    "slow": ['<tool_call>\n{{"name": "sleep", "arguments": {{"seconds": 5}}}}\n</tool_call>', "Woke up."],
    "forever": ['<tool_call>\n{{"name": "add", "arguments": {{"a": {n}, "b": 0}}}}\n</tool_call>'] * 20,
    "long": ['<tool_call>\n{{"name": "long_result", "arguments": {{"characters": {n}}}}}\n</tool_call>', "Read it."],
}
QUESTION = re.compile(r"<\|im_start\|>user\n(\w+) (\d+)")


def scripted_turn(context_text: str) -> str:
    """The next turn for a rendered context (prompt and conversation so far)."""
    questions = QUESTION.findall(context_text.split("<|im_start|>assistant")[0])
    if not questions:
        raise ValueError(f"no scripted question in {context_text[-300:]!r}")
    script, number = questions[-1]
    turns = SCRIPTS[script]
    index = min(context_text.count("<tool_response>"), len(turns) - 1)
    return turns[index].format(n=number) + "<|im_end|>"


def scripted_generate_from_ids(model, prompt_ids, prompt_mask, prompt_truncated, num_generations, generation_config,
                               pad_token_id, backend=None, *, tokenizer):
    from lit_grpo.algorithm import completion_mask_from_ids
    from lit_grpo.rollout.records import Rollout

    rows = []
    for ids, mask in zip(prompt_ids, prompt_mask):
        text = scripted_turn(tokenizer.decode(ids[mask.bool()].tolist()))
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"][: generation_config.max_new_tokens]
        rows += [tokens] * num_generations
    width = max(len(tokens) for tokens in rows)
    completion_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    for row, tokens in enumerate(rows):
        completion_ids[row, : len(tokens)] = torch.tensor(tokens)
    completion_mask, is_truncated = completion_mask_from_ids(completion_ids, generation_config.eos_token_id)
    repeat = lambda tensor: tensor.repeat_interleave(num_generations, 0)  # noqa: E731
    return Rollout(repeat(prompt_ids), repeat(prompt_mask), completion_ids.to(prompt_ids.device),
                   completion_mask.to(prompt_ids.device), is_truncated.to(prompt_ids.device), repeat(prompt_truncated))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def sleep(seconds: float) -> str:
    """Sleep for a while.

    Args:
        seconds: how long
    """
    import time

    time.sleep(seconds)
    return "slept"


def long_text(characters: int) -> str:
    """``characters`` characters that say where they are: "0123456789" repeated, every tenth a letter."""
    return "".join("abcdefghijklmnopqrstuvwxyz"[(i // 10) % 26] if i % 10 == 9 else str(i % 10) for i in range(characters))


def long_result(characters: int) -> str:
    """Return a long text.

    Args:
        characters: how many characters
    """
    return long_text(characters)
