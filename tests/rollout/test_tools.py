"""Multi-turn rollouts with tools (lit_grpo.rollout.tools.calls, lit_grpo.rollout.tools.multi_turn, lit_grpo.rollout.tools.tool_use, lit_grpo.rollout.tools.environments).

Most tests drive a *scripted policy* (tests/scripted_policy.py): deterministic turns that call tools,
written by the tiny Qwen2 model's tokenizer and chat template, so that the conversation, the loss
mask and every limit can be checked token by token. The environment plugin of
``examples/environment-plugin`` is installed as a real distribution (the README's test block) and
discovered through its entry point.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import scripted_policy
import torch
from transformers import AutoTokenizer

import lit_grpo.rollout.engines.policy
import lit_grpo.train.module
from lit_grpo import plugins
from lit_grpo.cli import main
from lit_grpo.data import GRPODataModule
from lit_grpo.errors import ConfigError, DataError
from lit_grpo.rollout.tools.calls import ToolCall, make_tool, parse_hermes, parse_tool_calls, run_tool_calls
from lit_grpo.rollout.tools.multi_turn import Conversation, TurnOutput, render, run_conversations, to_rollout
from lit_grpo.rollout.tools.tool_use import ToolUse
from lit_grpo.train.module import GRPOModule

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
ADD = "scripted_policy:add"
SLEEP = "scripted_policy:sleep"
LONG = "scripted_policy:long_result"


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


# ----------------------------------------------------------------------------------------------
# Reading tool calls
# ----------------------------------------------------------------------------------------------


def test_hermes_calls_are_read_with_their_arguments_and_the_content_around_them():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    parsed = parse_hermes(text)
    assert parsed.content == "Let me add."
    assert [(call.name, call.arguments, call.error) for call in parsed.tool_calls] == [
        ("add", {"a": 1, "b": 2}, None), ("add", {"a": 3, "b": 4}, None),  # arguments as a JSON string too
    ]
    assert parse_hermes("No call here.").tool_calls == []


@pytest.mark.parametrize("text, error", [
    ("<tool_call>\nnot json\n</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "'name' string"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "are not JSON"),
    ('<tool_call>{"name": "add", "arguments": {}}', "without its closing"),
])
def test_a_call_that_cannot_be_read_comes_back_with_the_reason(text, error):
    (call,) = parse_hermes(text).tool_calls
    assert call.error is not None and error in call.error


def turn_ids(tokenizer, text: str) -> list[int]:
    """The tokens of an assistant turn that ends with <|im_end|>, as the policy would sample them."""
    return tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]


def test_a_configured_parser_replaces_hermes_and_its_errors_become_failed_calls(tokenizer):
    im_end = [tokenizer.eos_token_id]
    seen = []

    def parser(text):
        seen.append(text)
        return [{"name": "add", "arguments": {"a": 1, "b": 2}}]

    calls = parse_tool_calls(turn_ids(tokenizer, "CALL add 1 2"), tokenizer, parser, stop_token_ids=im_end)
    assert [(c.name, c.arguments) for c in calls.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert seen == ["CALL add 1 2"]  # the turn's text, its stop token left out

    def broken(text):
        raise ValueError("cannot read this")

    (call,) = parse_tool_calls(turn_ids(tokenizer, "whatever"), tokenizer, broken, stop_token_ids=im_end).tool_calls
    assert "cannot read this" in call.error


# A response template (transformers >= 5.13) for the hermes format: what a hub tokenizer may carry.
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def test_the_tokenizers_own_response_parser_reads_the_turn_after_its_context(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.response_template = HERMES_RESPONSE_TEMPLATE
    schemas = [make_tool(scripted_policy.add, "t").schema]
    context = tokenizer(render(tokenizer, [{"role": "user", "content": "once 5"}], schemas, True, {}),
                        add_special_tokens=False)["input_ids"]
    ids = turn_ids(tokenizer, 'Adding.<tool_call>\n{"name": "add", "arguments": {"a": "5", "b": 1}}\n</tool_call>')
    parsed = parse_tool_calls(ids, tokenizer, None, schemas, context, [tokenizer.eos_token_id])
    # the schema of `add` (a: int) turned "5" into 5: the tools reached the parser, the context too
    assert [(c.name, c.arguments, c.error) for c in parsed.tool_calls] == [("add", {"a": 5, "b": 1}, None)]
    assert parsed.content == "Adding."


# ----------------------------------------------------------------------------------------------
# Running them
# ----------------------------------------------------------------------------------------------


def test_tool_results_and_every_kind_of_failure_are_messages_for_the_model():
    tools = {tool.name: tool for tool in (make_tool(scripted_policy.add, "t"), make_tool(scripted_policy.sleep, "t"))}

    def raises(x: int) -> int:
        """Fail.

        Args:
            x: anything
        """
        raise ZeroDivisionError("division by zero")

    async def async_double(x: int) -> dict:
        """Double asynchronously.

        Args:
            x: a number
        """
        return {"double": 2 * x}

    tools["raises"] = make_tool(raises, "t")
    tools["async_double"] = make_tool(async_double, "t")
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("add", {"a": 2}),
        ToolCall("add", {"a": 2, "b": 3, "c": 4}),
        ToolCall("nope", {}),
        ToolCall(None, error="the tool call is not JSON"),
        ToolCall("raises", {"x": 1}),
        ToolCall("async_double", {"x": 4}),
    ]
    results = run_tool_calls([(call, tools) for call in calls], timeout=5.0)
    assert [(r.content, r.failed) for r in results] == [
        ("5", False),
        ("error: add: missing a required argument: 'b'", True),
        ("error: add: got an unexpected keyword argument 'c'", True),
        ("error: no tool named 'nope'; the tools are: add, async_double, raises, sleep", True),
        ("error: the tool call is not JSON", True),
        ("error: ZeroDivisionError: division by zero", True),
        ('{"double": 8}', False),
    ]


def test_a_tool_past_its_timeout_is_reported_and_does_not_hold_up_the_others():
    tools = {tool.name: tool for tool in (make_tool(scripted_policy.add, "t"), make_tool(scripted_policy.sleep, "t"))}
    start = time.perf_counter()
    results = run_tool_calls([(ToolCall("sleep", {"seconds": 3}), tools), (ToolCall("sleep", {"seconds": 3}), tools),
                              (ToolCall("add", {"a": 1, "b": 1}), tools)], timeout=0.3)
    assert time.perf_counter() - start < 1.5  # the two sleeps wait concurrently, not 2 x 3 s
    assert [(r.content, r.failed) for r in results] == [
        ("error: sleep timed out after 0.3 s", True), ("error: sleep timed out after 0.3 s", True), ("2", False),
    ]


HUNG_TOOLS = """
import sys, time
sys.path.insert(0, {tests!r})
import scripted_policy
from lit_grpo.rollout.tools.calls import ToolCall, make_tool, run_tool_calls

tools = {{tool.name: tool for tool in (make_tool(scripted_policy.add, "t"), make_tool(scripted_policy.sleep, "t"))}}
start = time.perf_counter()
hung = run_tool_calls([(ToolCall("sleep", {{"seconds": 3600}}), tools)] * 16, timeout=0.5)
assert all(r.content == "error: sleep timed out after 0.5 s" for r in hung), hung
(healthy,) = run_tool_calls([(ToolCall("add", {{"a": 2, "b": 3}}), tools)], timeout=0.5)
print(healthy.content, healthy.failed, round(time.perf_counter() - start, 1))
"""


def test_hung_tools_neither_starve_the_next_calls_nor_keep_the_process_alive():
    """16 calls that never return (as many as the old shared pool had workers), each abandoned after
    its 0.5 s timeout; then a healthy call still runs, and the interpreter exits at once."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", HUNG_TOOLS.format(tests=str(TESTS))], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    content, failed, seconds = done.stdout.split()
    assert (content, failed) == ("5", "False")
    assert float(seconds) < 5  # the 16 waits overlap: about 0.5 s, not 16 x 0.5 s
    assert time.perf_counter() - start < 30  # the process did not wait for the sleeping threads


def test_a_tool_that_calls_sys_exit_is_a_failed_call_not_the_end_of_training():
    def quits(code: int) -> str:
        """Exit the process.

        Args:
            code: the exit status
        """
        raise SystemExit(code)

    (result,) = run_tool_calls([(ToolCall("quits", {"code": 3}), {"quits": make_tool(quits, "t")})], timeout=5.0)
    assert (result.content, result.failed) == ("error: SystemExit: 3", True)


def test_a_tool_without_type_hints_or_docstring_is_refused_naming_it():
    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match="model.tools\\[0\\].*'undocumented'.*type hint"):
        make_tool(undocumented, "model.tools[0] 'm:undocumented'")


# ----------------------------------------------------------------------------------------------
# The conversation and its tokens, with the scripted policy
# ----------------------------------------------------------------------------------------------


def conversation(tokenizer, question: str, tools=(ADD,), max_prompt_length=None) -> Conversation:
    tool_use = ToolUse(list(tools), None, None, None, None)
    (started,) = tool_use.start([[{"role": "user", "content": question}]], {}, 1, tokenizer, max_prompt_length, None)
    return started


def scripted_turns(tokenizer, budgets: list | None = None):
    """generate_turn for run_conversations from the scripted policy (records each call's budget)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate_turn(contexts, max_new_tokens):
        if budgets is not None:
            budgets.append(max_new_tokens)
        outputs = []
        for context in contexts:
            tokens = tokenizer(scripted_policy.scripted_turn(tokenizer.decode(context)), add_special_tokens=False)["input_ids"]
            tokens = tokens[:max_new_tokens]
            outputs.append(TurnOutput(tokens, None, tokens[-1] == eos))
        return outputs

    return generate_turn


def test_a_rollout_row_carries_the_oldest_weights_that_sampled_one_of_its_turns(tokenizer):
    """Each turn comes with the weight version of the engine that sampled it (lit_grpo.rollout.engines); the
    rollout row keeps the oldest, the one its staleness is counted from."""
    scripted, versions = scripted_turns(tokenizer), iter([7, 5])

    def generate_turn(contexts, max_new_tokens):
        version = next(versions)
        return [TurnOutput(out.token_ids, out.logps, out.stopped, version) for out in scripted(contexts, max_new_tokens)]

    calls, none = conversation(tokenizer, "once 41"), conversation(tokenizer, "never 2")
    run_conversations([calls, none], generate_turn, tokenizer, max_completion_length=200)
    assert calls.turns == 2 and calls.weight_version == 5 and none.turns == 1 and none.weight_version == 7
    rollout = to_rollout([calls, none], tokenizer.pad_token_id, torch.device("cpu"), with_sampling_logps=False)
    assert rollout.weight_versions.tolist() == [5, 7]
    assert rollout.select(torch.tensor([1])).weight_versions.tolist() == [7]


def test_the_conversation_is_the_chat_template_rendering_and_only_policy_tokens_are_masked_in(tokenizer):
    c = conversation(tokenizer, "once 41")
    budgets = []
    run_conversations([c], scripted_turns(tokenizer, budgets), tokenizer, max_completion_length=200)

    assert c.messages == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call00000", "function": {"name": "add", "arguments": {"a": 41, "b": 1}}}]},
        {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "42"},
        {"role": "assistant", "content": "The answer is 41+1."},
    ]
    # prompt + completion tokens are exactly the chat template's rendering of the whole conversation
    schemas = [make_tool(scripted_policy.add, "t").schema]
    full = render(tokenizer, c.prompt + c.messages, schemas, False, {})
    assert tokenizer.decode(c.prompt_ids + c.token_ids) + "\n" == full
    # token by token: 1 exactly on the two turns the policy wrote, 0 on the tool message between them
    first = tokenizer(scripted_policy.scripted_turn("<|im_start|>user\nonce 41"), add_special_tokens=False)["input_ids"]
    second = tokenizer("The answer is 41+1.<|im_end|>", add_special_tokens=False)["input_ids"]
    between = tokenizer("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"]
    assert c.token_ids == first + between + second
    assert c.tool_mask == [1] * len(first) + [0] * len(between) + [1] * len(second)
    assert c.generated == len(first) + len(second)  # the budget counts the policy's tokens only
    assert budgets == [200, 200 - len(first)]
    assert (c.turns, c.tool_calls, c.tool_failures, c.truncated) == (2, 1, 0, False)


def test_max_tool_calling_iterations_stops_a_policy_that_keeps_calling(tokenizer):
    limited, unlimited = conversation(tokenizer, "forever 1"), conversation(tokenizer, "forever 1")
    run_conversations([limited], scripted_turns(tokenizer), tokenizer, max_completion_length=10_000, max_tool_calling_iterations=2)
    assert (limited.tool_rounds, limited.turns, limited.tool_calls) == (2, 3, 2)  # the third turn's call is not run
    assert [m["role"] for m in limited.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert not limited.truncated
    run_conversations([unlimited], scripted_turns(tokenizer), tokenizer, max_completion_length=1000)
    turn = len(tokenizer(scripted_policy.scripted_turn("<|im_start|>user\nforever 1"), add_special_tokens=False)["input_ids"])
    assert unlimited.tool_rounds == 1000 // turn  # without a limit: until the completion budget runs out
    assert unlimited.generated == 1000 and unlimited.truncated


def test_the_completion_budget_counts_every_policy_token_and_cuts_the_last_turn(tokenizer):
    c = conversation(tokenizer, "twice 7")
    first = len(tokenizer(scripted_policy.SCRIPTS["twice"][0].format(n=7) + "<|im_end|>", add_special_tokens=False)["input_ids"])
    run_conversations([c], scripted_turns(tokenizer), tokenizer, max_completion_length=first + 10)
    assert c.generated == first + 10 and c.truncated and c.done
    assert sum(c.tool_mask) == first + 10 and len(c.token_ids) > first + 10  # tool tokens do not count
    assert c.tool_calls == 1  # the cut second turn's call is not read
    assert c.messages[-1]["role"] == "assistant" and "tool_calls" not in c.messages[-1]


def test_a_long_tool_result_keeps_its_first_and_last_tokens_within_max_tool_result_length(tokenizer):
    c = conversation(tokenizer, "long 500", tools=(ADD, LONG))
    run_conversations([c], scripted_turns(tokenizer), tokenizer, max_completion_length=300, max_tool_result_length=100)
    result = c.messages[1]["content"]
    text = scripted_policy.long_text(500)  # 500 characters, one token each
    assert result == text[:50] + "\n[... 400 tokens cut ...]\n" + text[-50:]
    assert (c.tool_results_truncated, c.tool_results_dropped, c.tool_calls) == (1, 0, 1)
    assert c.messages[-1]["content"] == "Read it."  # the rollout went on after the cut result
    short = conversation(tokenizer, "long 500", tools=(ADD, LONG))
    run_conversations([short], scripted_turns(tokenizer), tokenizer, max_completion_length=300, max_tool_result_length=500)
    assert short.messages[1]["content"] == text and short.tool_results_truncated == 0


def test_a_tool_result_that_would_overflow_the_context_is_dropped_and_the_rollout_ends(tokenizer):
    """The model (or the vllm engine) takes at most max_sequence_length tokens: a round of results
    that leaves no room for one more token is not appended (TRL drops it the same way)."""
    c = conversation(tokenizer, "long 500", tools=(ADD, LONG))
    call = len(tokenizer(scripted_policy.SCRIPTS["long"][0].format(n=500) + "<|im_end|>", add_special_tokens=False)["input_ids"])
    ceiling = len(c.prompt_ids) + call + 200  # room for the call and 200 more tokens, not for 500 characters
    budgets = []
    run_conversations([c], scripted_turns(tokenizer, budgets), tokenizer, max_completion_length=300, max_sequence_length=ceiling)
    assert (c.tool_calls, c.tool_results_dropped, c.truncated, c.done) == (1, 1, True, True)
    assert [m["role"] for m in c.messages] == ["assistant"] and len(c.token_ids) == call
    assert len(c.prompt_ids) + len(c.token_ids) <= ceiling and budgets == [200 + call]
    # with the result cut to 100 tokens it fits, and the next turn is cut at the ceiling
    cut = conversation(tokenizer, "long 500", tools=(ADD, LONG))
    run_conversations([cut], scripted_turns(tokenizer), tokenizer, max_completion_length=300, max_sequence_length=ceiling,
                      max_tool_result_length=100)
    assert (cut.tool_results_truncated, cut.tool_results_dropped) == (1, 0)
    assert len(cut.prompt_ids) + len(cut.token_ids) <= ceiling


def test_a_prompt_that_fills_the_context_is_an_error_naming_the_rollout(tokenizer):
    c = conversation(tokenizer, "once 1")
    with pytest.raises(DataError, match=f"rollout 0: the prompt is {len(c.prompt_ids)} tokens .* at most 100"):
        run_conversations([c], scripted_turns(tokenizer), tokenizer, max_completion_length=300, max_sequence_length=100)


def test_failed_calls_and_timeouts_reach_the_model_and_are_counted(tokenizer):
    broken = conversation(tokenizer, "broken 3")
    slow = conversation(tokenizer, "slow 3", tools=(ADD, SLEEP))
    start = time.perf_counter()
    run_conversations([broken, slow], scripted_turns(tokenizer), tokenizer, max_completion_length=500, tool_timeout=0.5)
    assert time.perf_counter() - start < 4  # the 5 s sleep was abandoned
    tool_messages = [m["content"] for m in broken.messages if m["role"] == "tool"]
    assert tool_messages == [
        "error: add: missing a required argument: 'b'",
        "error: no tool named 'subtract'; the tools are: add",
        "error: the tool call is not JSON (Expecting value: line 1 column 1 (char 0)): not json",
    ]
    assert (broken.tool_calls, broken.tool_failures, broken.messages[-1]["content"]) == (3, 3, "Gave up.")
    assert [m["content"] for m in slow.messages if m["role"] == "tool"] == ["error: sleep timed out after 0.5 s"]
    assert slow.messages[-1]["content"] == "Woke up."


def test_a_chat_template_that_rewrites_history_does_not_change_the_tool_tokens(tokenizer):
    """The tool messages are rendered after a stand-in history, so a template that drops earlier turns
    once tool messages follow (re-rendering is not prefix-preserving) gives the same tokens."""
    expected = conversation(tokenizer, "once 1")
    run_conversations([expected], scripted_turns(tokenizer), tokenizer, max_completion_length=200)
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = tokenizer.chat_template.replace("{%- for message in messages %}",
                                                              "{%- for message in messages[-2:] %}", 1)
    assert rewriting.chat_template != tokenizer.chat_template
    c = conversation(rewriting, "once 1")
    run_conversations([c], scripted_turns(rewriting), rewriting, max_completion_length=200)
    assert c.token_ids == expected.token_ids and c.tool_mask == expected.tool_mask and c.tool_calls == 1


# ----------------------------------------------------------------------------------------------
# In the trainer: rewards' inputs, the loss mask, metrics, environments
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch, tiny_qwen2_dir):
    """The module samples with the scripted policy (inside the FSDP2 gathering, as real sampling)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    monkeypatch.setattr(lit_grpo.rollout.engines.policy, "generate_from_ids",
                        lambda *args, **kwargs: scripted_policy.scripted_generate_from_ids(*args, **kwargs, tokenizer=tokenizer))


def questions_file(write_jsonl, questions, **columns):
    return write_jsonl([{"prompt": q, **{k: v[i] for k, v in columns.items()}} for i, q in enumerate(questions)])


def test_rewards_receive_the_whole_conversation_and_the_loss_counts_policy_tokens_only(
        tiny_qwen2_dir, scripted, reward_plugin, write_jsonl, fast_trainer):
    seen = {}

    def record(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer)
        return [1.0 if "tool_calls" in c[0] else 0.0 for c in completions]

    reward_plugin(record=record)
    module = GRPOModule(str(tiny_qwen2_dir), [{"name": "record"}], num_generations=2, max_completion_length=128,
                        tools=[ADD], log_completions_every_n_steps=0, model_init_kwargs={"dtype": "float32"})
    data = GRPODataModule(path="json", data_files=str(questions_file(write_jsonl, ["once 5", "never 6"], answer=["6", "6"])),
                          batch_size=2, conversational=True, shuffle=False)
    trainer = fast_trainer(max_steps=1)
    trainer.fit(module, data)

    assert seen["prompts"][0] == [{"role": "user", "content": "once 5"}]
    assert seen["completions"][0] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call00000", "function": {"name": "add", "arguments": {"a": 5, "b": 1}}}]},
        {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "6"},
        {"role": "assistant", "content": "The answer is 5+1."},
    ]
    assert seen["completions"][2] == [{"role": "assistant", "content": "No tools needed: 6."}]
    assert seen["answer"] == ["6", "6", "6", "6"]
    metrics = trainer.callback_metrics
    assert float(metrics["tools/calls_per_rollout"]) == 0.5  # 2 of 4 rollouts called once
    assert float(metrics["tools/failure_frac"]) == 0.0
    assert float(metrics["turns/mean"]) == 1.5

    # the loss mask of a multi-turn rollout: the policy's tokens, not the tool message
    batch = next(iter(data.train_dataloader()))
    scored, _ = module.generate_and_score(batch, training=False)
    rollout = scored.rollout
    assert torch.equal(scored.loss_mask, rollout.completion_mask * rollout.tool_mask)
    row = rollout.conversations[0]
    assert scored.loss_mask[0, : len(row.tool_mask)].tolist() == row.tool_mask
    assert 0 < int(scored.loss_mask[0].sum()) < int(rollout.completion_mask[0].sum())
    assert float(metrics["completions/mean_length"]) == float(rollout.policy_token_mask.sum(1).float().mean())


def test_the_loss_and_its_gradient_ignore_the_tool_tokens(tiny_qwen2_dir, scripted, reward_plugin, write_jsonl, fast_trainer):
    """Changing what a tool returned changes the context of the later tokens, but the tool's own
    tokens never enter the loss: their log-probs are multiplied by a zero mask."""
    reward_plugin(constant=lambda prompts, completions, **kw: [float(i % 2) for i in range(len(completions))])
    module = GRPOModule(str(tiny_qwen2_dir), [{"name": "constant"}], num_generations=2, max_completion_length=128,
                        tools=[ADD], log_completions_every_n_steps=0, model_init_kwargs={"dtype": "float32"})
    module.configure_model()
    data = GRPODataModule(path="json", data_files=str(questions_file(write_jsonl, ["once 5"])), batch_size=1,
                          conversational=True)
    fast_trainer(max_steps=0).fit(module, data)  # attaches the trainer
    batch = next(iter(data.train_dataloader()))
    scored, _ = module.generate_and_score(batch, training=False)
    logps, _ = module.logprobs.completion_logps(module.policy, scored.rollout)
    tool_positions = (scored.rollout.completion_mask == 1) & (scored.rollout.tool_mask == 0)
    assert tool_positions.any()
    assert (scored.loss_mask[tool_positions] == 0).all() and (logps[tool_positions[:, : logps.size(1)]] != 0).any()


def test_tools_need_a_chat_template_and_a_valid_name(tiny_model_dir, tiny_qwen2_dir):
    with pytest.raises(ConfigError, match="model.tools\\[0\\].*no function 'addd'; did you mean 'add'"):
        GRPOModule(str(tiny_qwen2_dir), [{"name": "char_fraction"}], tools=["scripted_policy:addd"])
    with pytest.raises(ConfigError, match="'package.module:function'"):
        GRPOModule(str(tiny_qwen2_dir), [{"name": "char_fraction"}], tools=["add"])
    module = GRPOModule(str(tiny_model_dir), [{"name": "char_fraction"}], tools=[ADD])
    if module.tokenizer.chat_template is None:
        with pytest.raises(ConfigError, match="need a chat template"):
            module.tool_use.start(["hi"], {}, 1, module.tokenizer, None, None)
    with pytest.raises(ConfigError, match="max_tool_calling_iterations must be at least 0"):
        GRPOModule(str(tiny_qwen2_dir), [{"name": "char_fraction"}], tools=[ADD], max_tool_calling_iterations=-1)


# ----------------------------------------------------------------------------------------------
# Environments: the installed example plugin, discovered through its entry point
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def kv_lookup():
    return pytest.importorskip("lit_grpo_kv_lookup", reason="pip install -e examples/environment-plugin (README: Tests)")


def test_the_installed_environment_plugin_is_listed_with_its_package(kv_lookup, capsys):
    plugins.reset_plugins()
    environments = plugins.get_environments()
    assert environments["kv_lookup"].package == "lit-grpo-kv-lookup"
    assert environments["kv_lookup"].obj is kv_lookup.KeyValueLookup
    main(["environments"])
    assert any(line.split()[:2] == ["kv_lookup", "lit-grpo-kv-lookup"] for line in capsys.readouterr().out.splitlines())
    main(["environments", "--json"])
    listed = json.loads(capsys.readouterr().out)
    assert {"name": "kv_lookup", "package": "lit-grpo-kv-lookup", "kind": "class"}.items() <= listed[0].items()


def test_each_rollout_gets_its_own_environment_built_from_its_columns(kv_lookup, tokenizer):
    tool_use = ToolUse(None, {"name": "kv_lookup"}, None, None, None)
    store = json.dumps({"a": "1", "b": "2"})
    conversations = tool_use.start(["Which digit is stored under b?"], {"store": [store], "key": ["b"]}, 2, tokenizer, None, None)
    first, second = conversations
    assert first.environment_instance is not second.environment_instance
    assert first.tools["lookup"].function("b") == "2" and first.environment_instance.looked_up == ["b"]
    assert second.environment_instance.looked_up == []
    tool_use.read_environment_rewards(conversations)
    assert tool_use.environment_rewards(conversations).tolist() == [[1.0], [0.0]]
    assert '"name": "lookup"' in tokenizer.decode(first.prompt_ids)  # the tool is shown to the model
    with pytest.raises(DataError, match="sample 0, column 'environment': 'chess' is not one of"):
        tool_use.start(["q"], {"store": [store], "key": ["a"], "environment": ["chess"]}, 1, tokenizer, None, None)
    with pytest.raises(plugins.UnknownEnvironmentError, match="Did you mean 'kv_lookup'"):
        ToolUse(None, {"name": "kv_lookpu"}, None, None, None)


class Counted:
    """An environment that counts its live instances (it would hold a process or a sandbox)."""

    live = 0
    closed = 0

    def __init__(self, reward: object = 1.0, broken: bool = False):
        if broken:
            raise TypeError("cannot build this one")
        self.reward = reward
        Counted.live += 1

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    def get_reward(self):
        return self.reward

    def close(self) -> None:
        Counted.live -= 1
        Counted.closed += 1


@pytest.fixture
def counted_environment():
    Counted.live = Counted.closed = 0
    plugin = plugins.register_functions("test-environments", environments={"counted": Counted})
    yield Counted
    plugins.unregister_plugin(plugin)


def scripted_rollout(tool_use, conversations, tokenizer):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=100, eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    generate_ids = lambda ids, mask, config: scripted_policy.scripted_generate_from_ids(  # noqa: E731
        None, ids, mask, torch.zeros(len(ids), dtype=torch.bool), 1, config, tokenizer.pad_token_id, tokenizer=tokenizer)
    return tool_use.rollout(conversations, generate_ids, tokenizer, config, 100, None, None, torch.device("cpu"))


def test_every_environment_is_closed_after_its_rollout_and_its_reward_read(counted_environment, tokenizer):
    tool_use = ToolUse(None, {"name": "counted"}, None, None, None)
    conversations = tool_use.start(["once 1", "once 2"], {}, 2, tokenizer, None, None)
    assert counted_environment.live == 4
    rollout = scripted_rollout(tool_use, conversations, tokenizer)
    assert (counted_environment.live, counted_environment.closed) == (0, 4)
    assert all(c.tool_calls == 1 and c.environment_instance is None for c in rollout.conversations)
    assert tool_use.environment_rewards(rollout.conversations).tolist() == [[1.0]] * 4  # read before the close


def test_environments_are_closed_when_the_rollout_fails(counted_environment, tokenizer):
    tool_use = ToolUse(None, {"name": "counted", "args": {"reward": "not a number"}}, None, None, None)
    conversations = tool_use.start(["once 1"], {}, 3, tokenizer, None, None)
    with pytest.raises(DataError, match="get_reward\\(\\) returned 'not a number'"):
        scripted_rollout(tool_use, conversations, tokenizer)
    assert (counted_environment.live, counted_environment.closed) == (0, 3)
    # and when building one of them fails: the ones built before are closed
    with pytest.raises(ConfigError, match="cannot build this one"):
        tool_use.start(["once 1", "once 2"], {"broken": [False, True]}, 2, tokenizer, None, None)
    assert (counted_environment.live, counted_environment.closed) == (0, 5)


def test_the_completions_table_shows_the_environments_reward_also_at_weight_0(
        tmp_path, tiny_qwen2_dir, scripted, reward_plugin, counted_environment, write_jsonl, fast_trainer):
    """Every reward column a run logs is in completions.jsonl and `lit-grpo completions`: the
    environment's get_reward() beside the rewards', also when its weight adds nothing to `reward`."""
    from lightning.pytorch.loggers import CSVLogger

    from lit_grpo.run.completions import show_step

    reward_plugin(half=lambda prompts, completions, **kw: [0.5] * len(completions))
    module = GRPOModule(str(tiny_qwen2_dir), [{"name": "half"}], num_generations=2, max_completion_length=128,
                        environment={"name": "counted", "args": {"reward": 0.25}, "weight": 0.0},
                        model_init_kwargs={"dtype": "float32"})
    data = GRPODataModule(path="json", data_files=str(questions_file(write_jsonl, ["once 5"])), batch_size=1,
                          conversational=True)
    fast_trainer(max_steps=1, logger=CSVLogger(tmp_path)).fit(module, data)
    records = [json.loads(line) for line in next(tmp_path.rglob("completions.jsonl")).read_text().splitlines()]
    assert [(r["rewards"], r["reward"]) for r in records] == [({"half": 0.5, "counted": 0.25}, 0.5)] * 2
    header = show_step(tmp_path).splitlines()[1]
    assert header == "| prompt | completion | half | counted | reward | advantage |"


def test_tools_quickstart_config_runs_through_the_cli_with_the_environment(tmp_path, warm_tool_model):
    """configs/tools-quickstart.yaml as shipped (the model replaced by the warm-started one, 3 steps)."""
    command = [str(Path(sys.executable).with_name("lit-grpo")), "fit", "--config", str(REPO / "configs/tools-quickstart.yaml"),
               "--model.model_name_or_path", str(warm_tool_model), "--trainer.max_steps", "3",
               "--data.data_files", str(REPO / "configs/data/kv_lookup.jsonl"), "--model.log_completions_every_n_steps", "1"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs/tools-quickstart/version_0"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert len(logged["reward"]) == 3 and all(math.isfinite(v) for v in logged["loss"])
    assert min(logged["tools/calls_per_rollout"]) > 0.3  # the warm-started model calls the tool
    assert max(logged["turns/mean"]) > 1.3
    assert "rewards/kv_lookup/mean" in logged and "rewards/kv_answer/mean" in logged
    records = [json.loads(line) for line in (tmp_path / "runs/tools-quickstart/version_0/completions.jsonl").read_text().splitlines()]
    assert any(any(m["role"] == "tool" for m in r["completion"]) for r in records)  # whole conversations saved
    shown = subprocess.run([command[0], "completions", str(tmp_path / "runs/tools-quickstart/version_0"), "--limit", "32"],
                           capture_output=True, text=True, timeout=120)
    assert "[calls lookup(" in shown.stdout and "tool: " in shown.stdout
    assert "| kv_answer | kv_lookup | reward |" in shown.stdout  # the environment's reward, at weight 0 too


@pytest.mark.parametrize("backend", ["lit", "transformers"])
def test_long_tool_results_are_cut_to_max_tool_result_length_in_a_real_run(tmp_path, warm_tool_model, backend):
    """A tool returning 500 characters with max_prompt_length: 64 (tests/long_tool_run.py): each
    result is cut to max_tool_result_length (100 tokens), the run says how often, and goes on."""
    import long_tool_run

    logged, records = long_tool_run.fit_with_long_tool_results(tmp_path, warm_tool_model, backend,
                                                               "--model.max_tool_result_length", "100")
    assert min(logged["tools/calls_per_rollout"]) > 0 and logged["tools/truncated_frac"] == [1.0, 1.0]
    assert logged["tools/dropped_frac"] == [0.0, 0.0]
    results = long_tool_run.tool_messages(records)
    assert results and all("[... 400 tokens cut ...]" in result for result in results)


def test_tool_results_that_would_pass_the_models_context_are_dropped_in_a_real_run(tmp_path, warm_tool_model):
    """The warm-started model takes 2048 positions; made to take 900 (its config), the 500-character
    results no longer fit after an 800-token prompt with the tool's schema: dropped, the run goes on."""
    import shutil

    model = Path(shutil.copytree(warm_tool_model, tmp_path / "short-context"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 900}))
    import long_tool_run

    logged, records = long_tool_run.fit_with_long_tool_results(tmp_path, model, "lit", "--model.max_prompt_length", "null")
    assert logged["tools/dropped_frac"] == [1.0, 1.0] and long_tool_run.tool_messages(records) == []
    for record in records:  # every rollout ended at its call, within the context
        assert [m["role"] for m in record["completion"]] == ["assistant"]


def test_validation_scores_multi_turn_rollouts(tiny_qwen2_dir, scripted, reward_plugin, write_jsonl, fast_trainer):
    reward_plugin(called=lambda prompts, completions, **kw: [1.0 if len(c) > 1 else 0.0 for c in completions])
    module = GRPOModule(str(tiny_qwen2_dir), [{"name": "called"}], num_generations=2, num_generations_eval=2,
                        max_completion_length=128, tools=[ADD], temperature_eval=0.0, log_completions_every_n_steps=0)
    data = GRPODataModule(path="json", data_files=str(questions_file(write_jsonl, ["once 1", "never 2"] * 2)),
                          batch_size=2, conversational=True, val_split="train[:4]", shuffle=False)
    results = fast_trainer().validate(module, data)
    assert results[0]["val/pass@2"] == pytest.approx(0.5)  # the "once" prompts called a tool, the "never" ones did not
    assert results[0]["val/reward"] == pytest.approx(0.5)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_with_different_numbers_of_turns(tmp_path, tiny_qwen2_dir, strategy):
    """Rank 0's prompts need two tool rounds, rank 1's none: every generation call (a collective
    under FSDP2) is still made on both ranks, and the metrics cover both."""
    import yaml

    rows = [{"prompt": "twice 1"}, {"prompt": "never 2"}, {"prompt": "twice 3"}, {"prompt": "never 4"}]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fsdp2 = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
             "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}
    config = {
        "trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 2, "strategy": "ddp" if strategy == "ddp" else fsdp2,
                    "logger": False, "enable_checkpointing": False, "enable_progress_bar": False},
        "model": {"model_name_or_path": str(tiny_qwen2_dir), "num_generations": 2, "max_completion_length": 200,
                  "tools": [ADD], "rewards": [{"name": "char_fraction", "args": {"chars": "D"}}],
                  "log_completions_every_n_steps": 0, "model_init_kwargs": {"dtype": "float32"}},
        "data": {"path": "json", "data_files": str(tmp_path / "q.jsonl"), "batch_size": 1, "conversational": True,
                 "shuffle": False},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    worker = TESTS / "distributed_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(worker),
               "--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "out.pt"), "--scripted-tools"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    steps = torch.load(tmp_path / "out.pt", weights_only=False)["steps"]
    assert len(steps) == 2
    # each step: rank 0 "twice" (2 calls, 3 turns) x 2 completions, rank 1 "never" (0 calls, 1 turn) x 2
    assert [step["tools/calls_per_rollout"] for step in steps] == [1.0, 1.0]
    assert [step["turns/mean"] for step in steps] == [2.0, 2.0]
    assert all(math.isfinite(step["loss"]) for step in steps)

