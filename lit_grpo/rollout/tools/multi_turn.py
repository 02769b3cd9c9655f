"""Multi-turn rollouts: the policy answers, calls tools, reads their results and goes on.

One :class:`Conversation` per completion row. :func:`run_conversations` repeats, for every row
still going:

1. generate the next assistant turn from the prompt and the conversation so far (all rows at
   once, through whichever backend samples: ``generate_turn``);
2. parse its tool calls from its tokens (:func:`lit_grpo.rollout.tools.calls.parse_tool_calls`). A turn without a
   call ends the rollout; so does a turn that ran out of the completion budget
   (``max_completion_length`` counts every token the policy generated in the rollout, over all its
   turns) or of the context (``max_sequence_length``: prompt and every completion token, the
   model's or the engine's longest sequence), and a turn that calls tools after
   ``max_tool_calling_iterations`` rounds of tool results;
3. run the calls (:func:`lit_grpo.rollout.tools.calls.run_tool_calls`: concurrently, with a timeout, errors
   returned as the tool's message) and append the tool messages, in the tokens the chat template
   gives them, followed by the next assistant header (:func:`tool_turn_ids`).

Tool results have a budget: a result longer than ``max_tool_result_length`` tokens keeps its first
and last halves with a note of what was cut (``Conversation.tool_results_truncated``), and a round of
results that would leave no room for another token in ``max_sequence_length`` is dropped: the
rollout ends there, truncated (``tool_results_dropped``; TRL drops them the same way).

The completion of a row is every token after the prompt: the policy's own tokens (``tool_mask``
1: they count in the loss, the log-probs, the KL and the entropy) and the tool messages and template
tokens between its turns (``tool_mask`` 0: context the policy reads but did not write). Rewards
receive the conversation after the prompt as a list of messages, as TRL passes it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from lit_grpo.errors import DataError
from lit_grpo.rollout.records import Rollout
from lit_grpo.rollout.tools.calls import Tool, ToolCall, ToolResult, parse_tool_calls, run_tool_calls

__all__ = [
    "Conversation",
    "TurnOutput",
    "conversation_from_record",
    "conversation_record",
    "conversation_statistics",
    "fit_tool_result",
    "render",
    "run_conversations",
    "to_rollout",
    "tool_turn_ids",
]


@dataclass
class TurnOutput:
    """What the sampler returns for one row of one turn."""

    token_ids: list[int]  # the new tokens, up to and including the EOS id when it stopped
    logps: list[float] | None  # the sampler's log-probs of them (vLLM), or None
    stopped: bool  # ended with an EOS id (False: it reached max_new_tokens)
    weight_version: int | None = None  # the policy version whose weights sampled them


# generate_turn(contexts, max_new_tokens) -> one TurnOutput per context; contexts are token ids
GenerateTurn = Callable[[list[list[int]], int], list[TurnOutput]]


@dataclass
class Conversation:
    """One rollout row: a prompt, the tools it may call, and what happened after the prompt."""

    prompt: list[dict]  # chat messages
    prompt_ids: list[int]  # the rendered prompt (tools and generation prompt included), truncated
    prompt_truncated: bool
    tools: dict[str, Tool]  # by name
    environment: str | None = None  # the environment's name (lit_grpo.rollout.tools.environments), if any
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
    tool_results_truncated: int = 0  # results cut to max_tool_result_length tokens
    tool_results_dropped: int = 0  # results dropped: they would have overflowed max_sequence_length
    done: bool = False
    truncated: bool = False  # the budget or the context ran out before the policy finished
    pending: list[ToolCall] = field(default_factory=list)  # calls of the last turn, not yet run
    environment_reward: float | None = None  # the environment's get_reward(), read when the rollout ended
    weight_version: int | None = None  # the oldest policy version that sampled one of its turns

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools.values()]

    @property
    def context(self) -> list[int]:
        """Every token the policy sees next: the prompt and the completion so far."""
        return self.prompt_ids + self.token_ids

    def room(self, max_completion_length: int, max_sequence_length: int | None) -> int:
        """How many tokens the policy may still write: the completion budget, and the context's."""
        room = max_completion_length - self.generated
        if max_sequence_length is not None:
            room = min(room, max_sequence_length - len(self.prompt_ids) - len(self.token_ids))
        return room


# What a checkpoint keeps of an ended conversation: its live parts (the tools' functions, the
# environment's instance, calls not yet run) are gone once its rollout ended and its reward was read.
# Not in a checkpoint's record: the live objects, and the token lists the Rollout's tensors already hold
# (as Python lists they would cost ~15 bytes a token in the pickle gathered to rank 0).
NOT_RECORDED = frozenset({"tools", "environment_instance", "pending", "prompt_ids", "token_ids", "tool_mask", "sampling_logps"})


def conversation_record(conversation: Conversation) -> dict[str, Any]:
    """An ended conversation as plain lists, strings and numbers (a ``weights_only`` checkpoint: the
    asynchronous pipeline saves the multi-turn batches in flight), all that scoring it and its
    ``tools/*`` metrics read: the prompt, the messages, the environment's name and reward, the counts."""
    return {f.name: copy.deepcopy(getattr(conversation, f.name)) for f in fields(Conversation) if f.name not in NOT_RECORDED}


def conversation_from_record(record: dict[str, Any]) -> Conversation:
    """The conversation of :func:`conversation_record`, ended, with no tools and no environment instance
    (its tokens are its Rollout's)."""
    return Conversation(tools={}, prompt_ids=[], **{name: value for name, value in record.items() if name not in NOT_RECORDED})


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
    max_tool_result_length: int | None = None,
    max_sequence_length: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
) -> None:
    """Run every conversation to its end (in place). ``any_rank_active(local)`` (several processes)
    keeps every rank turning as long as one has a row going, so that each generation call, a
    collective under FSDP2, is made by all of them. ``stop_token_ids``: the ids that end a turn
    (the generation config's EOS ids; default the tokenizer's EOS)."""
    any_rank_active = any_rank_active or (lambda local: local)
    stop_token_ids = list(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
    limits = TurnLimits(max_completion_length, max_sequence_length, max_tool_calling_iterations, max_tool_result_length)
    for row, conversation in enumerate(conversations):
        if max_sequence_length is not None and len(conversation.prompt_ids) >= max_sequence_length:
            raise DataError(
                f"rollout {row}: the prompt is {len(conversation.prompt_ids)} tokens with the tools' schemas, and the "
                f"model takes at most {max_sequence_length} (its max_position_embeddings, or the vllm engine's "
                "max_model_len), leaving no room for an answer: set model.max_prompt_length lower, or shorten the "
                f"prompt; its start: {conversation.prompt!r:.200}"
            )
    while any_rank_active(any(not c.done for c in conversations)):
        for conversation in conversations:
            if not conversation.done and conversation.room(max_completion_length, max_sequence_length) <= 0:
                conversation.done = conversation.truncated = True  # the context is full: no turn fits
        active = [c for c in conversations if not c.done]
        budget = max((c.room(max_completion_length, max_sequence_length) for c in active), default=0)
        outputs = generate_turn([c.context for c in active], budget)
        for conversation, output in zip(active, outputs):
            _take_turn(conversation, output, limits, tokenizer, tool_call_parser, stop_token_ids)
        calling = [c for c in active if c.pending]
        results = run_tool_calls([(call, c.tools) for c in calling for call in c.pending], tool_timeout)
        for conversation in calling:
            mine, results = results[: len(conversation.pending)], results[len(conversation.pending) :]
            _append_tool_messages(conversation, mine, tokenizer, chat_template_kwargs or {}, limits, stop_token_ids)


@dataclass
class TurnLimits:
    max_completion_length: int  # policy tokens over all turns
    max_sequence_length: int | None  # prompt + every completion token
    max_tool_calling_iterations: int | None  # rounds of tool results
    max_tool_result_length: int | None  # tokens of one tool result


def _take_turn(conversation: Conversation, output: TurnOutput, limits: TurnLimits, tokenizer, parser: Callable | None,
               stop_token_ids: Sequence[int]) -> None:
    room = conversation.room(limits.max_completion_length, limits.max_sequence_length)
    context = conversation.context
    ids, stopped = list(output.token_ids), output.stopped
    logps = list(output.logps) if output.logps is not None else [0.0] * len(ids)
    if len(ids) > room:  # another row's room was larger: this one ends here
        ids, logps, stopped = ids[:room], logps[:room], False
    conversation.token_ids += ids
    conversation.tool_mask += [1] * len(ids)
    conversation.sampling_logps += logps
    conversation.generated += len(ids)
    conversation.turns += 1
    if output.weight_version is not None:
        earlier = conversation.weight_version
        conversation.weight_version = output.weight_version if earlier is None else min(earlier, output.weight_version)
    if not stopped:  # cut off mid-turn: no tool call is read from an unfinished turn
        conversation.messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        conversation.done = conversation.truncated = True
        return
    parsed = parse_tool_calls(ids, tokenizer, parser, conversation.schemas, context, stop_token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    for call in parsed.tool_calls:
        call.id = f"call{conversation.tool_calls + len(conversation.pending):05d}"  # unique within the rollout
        conversation.pending.append(call)
    if parsed.tool_calls:
        message["tool_calls"] = [call.as_message_call() for call in parsed.tool_calls]
    conversation.messages.append(message)
    iterations = limits.max_tool_calling_iterations
    if not parsed.tool_calls or (iterations is not None and conversation.tool_rounds >= iterations):
        conversation.done = True  # an answer, or calls past the limit (not run)
        conversation.pending = []
    elif conversation.room(limits.max_completion_length, limits.max_sequence_length) <= 0:
        conversation.done = conversation.truncated = True  # no room left to read the results
        conversation.pending = []


def render(tokenizer, messages: list[dict], tools: list[dict], add_generation_prompt: bool,
           chat_template_kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt, **chat_template_kwargs
    )


def fit_tool_result(tokenizer, content: str, max_tokens: int | None) -> tuple[str, bool]:
    """``content`` within ``max_tokens`` tokens: a longer one keeps its first and last halves, with a
    note of how many tokens were cut between them (the end of a long result, such as a traceback's
    last line, is often what matters). Returns the text and whether it was cut."""
    if max_tokens is None:
        return content, False
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return content, False
    head, tail = (max_tokens + 1) // 2, max_tokens // 2
    note = f"\n[... {len(ids) - head - tail} tokens cut ...]\n"
    return tokenizer.decode(ids[:head]) + note + (tokenizer.decode(ids[-tail:]) if tail else ""), True


# Stands in for the arguments (and content) of the calls in the rendering of tool_turn_ids; the
# assistant turn that made the calls ends at the first end-of-turn token after its last occurrence.
CALL_MARKER = "lit-grpo-tool-call-marker"


def tool_turn_ids(tokenizer, calls: Sequence[ToolCall], tool_messages: list[dict], tools: list[dict],
                  chat_template_kwargs: dict[str, Any], stop_token_ids: Sequence[int]) -> list[int]:
    """The tokens the chat template puts between the end of an assistant turn that made ``calls``
    (its end-of-turn token, which the policy generated) and the next assistant turn: the tool
    messages and the generation prompt (and whatever else the template writes there, such as
    Qwen's newline after ``<|im_end|>`` or Qwen3's empty think block with ``enable_thinking: false``).

    They are rendered after a fixed stand-in history (a user message and an assistant turn with the
    same calls, by name and id), never after the real one, so they do not depend on how a template
    re-renders earlier turns once a tool message follows (Qwen3 drops the empty think block of an
    earlier assistant turn, for example): only on the tool messages themselves.
    """
    stand_in_calls = [
        {"type": "function", "id": call.id, "function": {"name": call.name or "unknown", "arguments": {"value": CALL_MARKER}}}
        for call in calls
    ]
    stand_in = [{"role": "user", "content": "Call the tools."},
                {"role": "assistant", "content": CALL_MARKER, "tool_calls": stand_in_calls}]
    text = render(tokenizer, stand_in + tool_messages, tools, True, chat_template_kwargs)
    name = getattr(tokenizer, "name_or_path", None) or "the tokenizer"
    marker = text.rfind(CALL_MARKER)
    if marker < 0:
        raise DataError(f"the chat template of {name!r} renders neither the content nor the arguments of an assistant "
                        "turn's tool calls, so the tokens after a tool call cannot be found")
    ends = []
    for stop_id in dict.fromkeys(stop_token_ids):
        stop_text = tokenizer.decode([stop_id])
        at = text.find(stop_text, marker) if stop_text else -1
        if at >= 0:
            ends.append((at, at + len(stop_text)))
    if not ends:
        stop_texts = [tokenizer.decode([stop_id]) for stop_id in stop_token_ids]
        raise DataError(f"the chat template of {name!r} does not end an assistant turn that calls tools with any of the "
                        f"end-of-turn tokens {stop_texts} (the generation config's EOS ids), so the tool messages "
                        f"cannot follow the policy's turn; rendered: {text[marker:][:300]!r}")
    return tokenizer(text[min(ends)[1]:], add_special_tokens=False)["input_ids"]


def _append_tool_messages(conversation: Conversation, results: Sequence[ToolResult], tokenizer,
                          chat_template_kwargs: dict, limits: TurnLimits, stop_token_ids: Sequence[int]) -> None:
    """Append the tool messages of the last turn's calls, as the chat template renders them after it
    (:func:`tool_turn_ids`): the policy's own tokens stay exactly as sampled. A round that would
    leave no room for the next turn in ``max_sequence_length`` is dropped and the rollout ends."""
    calls, conversation.pending = conversation.pending, []
    conversation.tool_calls += len(calls)
    conversation.tool_failures += sum(result.failed for result in results)
    conversation.tool_rounds += 1
    tool_messages = []
    for call, result in zip(calls, results):
        content, cut = fit_tool_result(tokenizer, result.content, limits.max_tool_result_length)
        conversation.tool_results_truncated += cut
        tool_messages.append({"role": "tool", "name": result.name, "tool_call_id": call.id, "content": content})
    try:
        ids = tool_turn_ids(tokenizer, calls, tool_messages, conversation.schemas, chat_template_kwargs, stop_token_ids)
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - the template refused these calls (e.g. Llama 3.1: one call per turn)
        _warn_once(f"the chat template cannot render this turn's tool calls, so the rollout ends there (counted as failed "
                   f"calls): {type(error).__name__}: {error}")
        conversation.tool_failures += len(calls) - sum(result.failed for result in results)
        conversation.done = True
        return
    room = None if limits.max_sequence_length is None else limits.max_sequence_length - len(conversation.context)
    if room is not None and len(ids) + 1 > room:  # no room for the results and one more token
        conversation.tool_results_dropped += len(results)
        conversation.done = conversation.truncated = True
        return
    conversation.messages += tool_messages
    conversation.token_ids += ids
    conversation.tool_mask += [0] * len(ids)
    conversation.sampling_logps += [0.0] * len(ids)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


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
        weight_versions=(torch.tensor([c.weight_version for c in conversations], device=device)
                         if all(c.weight_version is not None for c in conversations) else None),
    )


def conversation_statistics(conversations: Sequence[Conversation]) -> dict[str, torch.Tensor]:
    """Per-rank sums behind ``tools/calls_per_rollout``, ``tools/failure_frac``,
    ``tools/truncated_frac``, ``tools/dropped_frac`` and ``turns/mean`` (divided after summing over ranks)."""
    return {
        "rollouts": torch.tensor(float(len(conversations))),
        "tool_calls": torch.tensor(float(sum(c.tool_calls for c in conversations))),
        "tool_failures": torch.tensor(float(sum(c.tool_failures for c in conversations))),
        "tool_results_truncated": torch.tensor(float(sum(c.tool_results_truncated for c in conversations))),
        "tool_results_dropped": torch.tensor(float(sum(c.tool_results_dropped for c in conversations))),
        "turns": torch.tensor(float(sum(c.turns for c in conversations))),
    }
