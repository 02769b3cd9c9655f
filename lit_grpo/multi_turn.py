"""Multi-turn rollouts: the policy answers, calls tools, reads their results and goes on.

One :class:`Conversation` per completion row. :func:`run_conversations` repeats, for every row
still going:

1. generate the next assistant turn from the prompt and the conversation so far (all rows at
   once, through whichever backend samples: ``generate_turn``);
2. parse its tool calls (:func:`lit_grpo.tools.parse_tool_calls`). A turn without a call ends
   the rollout; so does a turn that ran out of the completion budget (``max_completion_length``
   counts every token the policy generated in the rollout, over all its turns), and a turn that
   calls tools after ``max_tool_calling_iterations`` rounds of tool results;
3. run the calls (:func:`lit_grpo.tools.run_tool_calls`: concurrently, with a timeout, errors
   returned as the tool's message) and append the tool messages, in the tokens the chat template
   gives them, followed by the next assistant header.

The completion of a row is every token after the prompt: the policy's own tokens (``tool_mask``
1: they count in the loss, the log-probs, the KL and the entropy) and the tool messages and template
tokens between its turns (``tool_mask`` 0: context the policy reads but did not write). Rewards
receive the conversation after the prompt as a list of messages, as TRL passes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_grpo.errors import DataError
from lit_grpo.rollout import Rollout
from lit_grpo.tools import Tool, ToolCall, parse_tool_calls, run_tool_calls

__all__ = ["Conversation", "TurnOutput", "conversation_statistics", "run_conversations", "to_rollout"]


@dataclass
class TurnOutput:
    """What the sampler returns for one row of one turn."""

    token_ids: list[int]  # the new tokens, up to and including the EOS id when it stopped
    logps: list[float] | None  # the sampler's log-probs of them (vLLM), or None
    stopped: bool  # ended with an EOS id (False: it reached max_new_tokens)


# generate_turn(contexts, max_new_tokens) -> one TurnOutput per context; contexts are token ids
GenerateTurn = Callable[[list[list[int]], int], list[TurnOutput]]


@dataclass
class Conversation:
    """One rollout row: a prompt, the tools it may call, and what happened after the prompt."""

    prompt: list[dict]  # chat messages
    prompt_ids: list[int]  # the rendered prompt (tools and generation prompt included), truncated
    prompt_truncated: bool
    tools: dict[str, Tool]  # by name
    environment: str | None = None  # the environment's name (lit_grpo.environments), if any
    environment_instance: Any = None
    messages: list[dict] = field(default_factory=list)  # assistant and tool messages after the prompt
    token_ids: list[int] = field(default_factory=list)  # every completion token
    tool_mask: list[int] = field(default_factory=list)  # 1 where the policy generated the token
    sampling_logps: list[float] = field(default_factory=list)  # the sampler's, 0 on tool tokens
    generated: int = 0  # policy tokens so far (the budget counts these)
    turns: int = 0  # assistant turns
    tool_rounds: int = 0  # rounds of tool results appended
    tool_calls: int = 0
    tool_failures: int = 0
    done: bool = False
    truncated: bool = False  # the budget ran out before the policy finished a turn
    pending: list[ToolCall] = field(default_factory=list)  # calls of the last turn, not yet run

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools.values()]


def run_conversations(
    conversations: Sequence[Conversation],
    generate_turn: GenerateTurn,
    tokenizer,
    max_completion_length: int,
    max_tool_calling_iterations: int | None = None,
    tool_timeout: float | None = None,
    tool_call_parser: Callable | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    any_rank_active: Callable[[bool], bool] | None = None,
) -> None:
    """Run every conversation to its end (in place). ``any_rank_active(local)`` (several processes)
    keeps every rank turning as long as one has a row going, so that each generation call, a
    collective under FSDP2, is made by all of them."""
    any_rank_active = any_rank_active or (lambda local: local)
    while any_rank_active(any(not c.done for c in conversations)):
        active = [c for c in conversations if not c.done]
        budget = max((max_completion_length - c.generated for c in active), default=0)
        outputs = generate_turn([c.prompt_ids + c.token_ids for c in active], budget)
        for conversation, output in zip(active, outputs):
            _take_turn(conversation, output, max_completion_length, max_tool_calling_iterations, tokenizer,
                       tool_call_parser)
        calling = [c for c in active if c.pending]
        results = run_tool_calls([(call, c.tools) for c in calling for call in c.pending], tool_timeout)
        for conversation in calling:
            mine, results = results[: len(conversation.pending)], results[len(conversation.pending) :]
            _append_tool_messages(conversation, mine, tokenizer, chat_template_kwargs or {})


def _take_turn(conversation: Conversation, output: TurnOutput, max_completion_length: int,
               max_iterations: int | None, tokenizer, parser: Callable | None) -> None:
    budget = max_completion_length - conversation.generated
    ids, stopped = list(output.token_ids), output.stopped
    logps = list(output.logps) if output.logps is not None else [0.0] * len(ids)
    if len(ids) > budget:  # another row's budget was larger: this one ends here
        ids, logps, stopped = ids[:budget], logps[:budget], False
    conversation.token_ids += ids
    conversation.tool_mask += [1] * len(ids)
    conversation.sampling_logps += logps
    conversation.generated += len(ids)
    conversation.turns += 1
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not stopped:  # cut off mid-turn: no tool call is read from an unfinished turn
        conversation.messages.append({"role": "assistant", "content": text})
        conversation.done = conversation.truncated = True
        return
    parsed = parse_tool_calls(text, tokenizer, parser, conversation.schemas)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [call.as_message_call() for call in parsed.tool_calls]
    conversation.messages.append(message)
    if not parsed.tool_calls or (max_iterations is not None and conversation.tool_rounds >= max_iterations):
        conversation.done = True  # an answer, or calls past the limit (not run)
    elif conversation.generated >= max_completion_length:
        conversation.done = conversation.truncated = True  # no budget left to read the results
    else:
        conversation.pending = parsed.tool_calls


def render(tokenizer, messages: list[dict], tools: list[dict], add_generation_prompt: bool,
           chat_template_kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt, **chat_template_kwargs
    )


def _append_tool_messages(conversation: Conversation, results, tokenizer, chat_template_kwargs: dict) -> None:
    """Append the tool messages, as the chat template renders them after the assistant turn.

    The tokens are the difference between the conversation rendered with and without them (plus
    whatever the template puts after the EOS the policy stopped at, such as a newline): the policy's
    own tokens stay exactly as sampled."""
    calls, conversation.pending = conversation.pending, []
    conversation.tool_calls += len(calls)
    conversation.tool_failures += sum(result.failed for result in results)
    conversation.tool_rounds += 1
    history = conversation.prompt + conversation.messages
    tool_messages = [{"role": "tool", "name": result.name, "content": result.content} for result in results]
    before = render(tokenizer, history, conversation.schemas, False, chat_template_kwargs)
    after = render(tokenizer, history + tool_messages, conversation.schemas, True, chat_template_kwargs)
    if not after.startswith(before):
        raise DataError(
            f"the chat template of {getattr(tokenizer, 'name_or_path', 'the tokenizer')!r} renders the conversation "
            "differently once tool messages follow it, so the tool messages cannot be appended to the tokens the "
            f"policy generated; conversation so far: {history!r}"
        )
    eos_text = tokenizer.decode(conversation.token_ids[-1:])  # the EOS id the policy stopped at
    cut = before.rfind(eos_text) if eos_text else -1
    tail = before[cut + len(eos_text) :] if cut >= 0 else ""
    if tail.strip():  # the template does not end the assistant turn with that EOS: nothing to add
        tail = ""
    ids = tokenizer(tail + after[len(before) :], add_special_tokens=False)["input_ids"]
    conversation.messages += tool_messages
    conversation.token_ids += ids
    conversation.tool_mask += [0] * len(ids)
    conversation.sampling_logps += [0.0] * len(ids)


def to_rollout(conversations: Sequence[Conversation], pad_token_id: int, device: torch.device,
               with_sampling_logps: bool) -> Rollout:
    """The conversations as a :class:`Rollout`: prompts left-padded, completions right-padded."""
    n = len(conversations)
    P = max(len(c.prompt_ids) for c in conversations)
    C = max(1, max(len(c.token_ids) for c in conversations))
    prompt_ids = torch.full((n, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, P), dtype=torch.long)
    completion_ids = torch.full((n, C), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((n, C), dtype=torch.long)
    tool_mask = torch.zeros((n, C), dtype=torch.long)
    sampling_logps = torch.zeros((n, C), dtype=torch.float32)
    for row, c in enumerate(conversations):
        length = len(c.token_ids)
        prompt_ids[row, P - len(c.prompt_ids) :] = torch.tensor(c.prompt_ids, dtype=torch.long)
        prompt_mask[row, P - len(c.prompt_ids) :] = 1
        completion_ids[row, :length] = torch.tensor(c.token_ids, dtype=torch.long)
        completion_mask[row, :length] = 1
        tool_mask[row, :length] = torch.tensor(c.tool_mask, dtype=torch.long)
        sampling_logps[row, :length] = torch.tensor(c.sampling_logps, dtype=torch.float32)
    return Rollout(
        prompt_ids.to(device),
        prompt_mask.to(device),
        completion_ids.to(device),
        completion_mask.to(device),
        torch.tensor([c.truncated for c in conversations], device=device),
        torch.tensor([c.prompt_truncated for c in conversations], device=device),
        sampling_logps=sampling_logps.to(device) if with_sampling_logps else None,
        tool_mask=tool_mask.to(device),
    )


def conversation_statistics(conversations: Sequence[Conversation]) -> dict[str, torch.Tensor]:
    """Per-rank sums behind ``tools/calls_per_rollout``, ``tools/failure_frac`` and ``turns/mean``
    (divided after summing over ranks)."""
    return {
        "rollouts": torch.tensor(float(len(conversations))),
        "tool_calls": torch.tensor(float(sum(c.tool_calls for c in conversations))),
        "tool_failures": torch.tensor(float(sum(c.tool_failures for c in conversations))),
        "turns": torch.tensor(float(sum(c.turns for c in conversations))),
    }
