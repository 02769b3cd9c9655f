"""Multi-turn rollouts with tools (lit_grpo.tools, lit_grpo.multi_turn, lit_grpo.agent, lit_grpo.environments).

Most tests drive a *scripted policy* (tests/scripted_policy.py): deterministic turns that call tools,
written by the tiny Qwen2 model's tokenizer and chat template, so that the conversation, the loss
mask and every limit can be checked token by token. The environment plugin of
``examples/environment-plugin`` is installed as a real distribution (the README's test block) and
discovered through its entry point.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import lit_grpo.module
import scripted_policy
from lit_grpo import plugins
from lit_grpo.agent import ToolUse
from lit_grpo.cli import main
from lit_grpo.data import GRPODataModule
from lit_grpo.errors import ConfigError, DataError
from lit_grpo.module import GRPOModule
from lit_grpo.multi_turn import Conversation, TurnOutput, render, run_conversations
from lit_grpo.tools import ToolCall, make_tool, parse_hermes, parse_tool_calls, run_tool_calls

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
ADD = "scripted_policy:add"
SLEEP = "scripted_policy:sleep"


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


def test_a_configured_parser_replaces_hermes_and_its_errors_become_failed_calls():
    calls = parse_tool_calls("CALL add 1 2", parser=lambda text: [{"name": "add", "arguments": {"a": 1, "b": 2}}])
    assert [(c.name, c.arguments) for c in calls.tool_calls] == [("add", {"a": 1, "b": 2})]

    def broken(text):
        raise ValueError("cannot read this")

    (call,) = parse_tool_calls("whatever", parser=broken).tool_calls
    assert "cannot read this" in call.error


def test_the_tokenizers_own_response_parser_is_used_where_it_has_one():
    class TokenizerWithParser:
        response_template = {"some": "schema"}

        def parse_response(self, text, tools=None):
            self.seen = (text, tools)
            return {"content": "thinking", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 5}}}]}

    tokenizer = TokenizerWithParser()
    parsed = parse_tool_calls("raw", tokenizer, tools=[{"name": "add"}])
    assert tokenizer.seen == ("raw", [{"name": "add"}])
    assert parsed.content == "thinking" and [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", {"a": 5})]


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


def test_the_conversation_is_the_chat_template_rendering_and_only_policy_tokens_are_masked_in(tokenizer):
    c = conversation(tokenizer, "once 41")
    budgets = []
    run_conversations([c], scripted_turns(tokenizer, budgets), tokenizer, max_completion_length=200)

    assert c.messages == [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 41, "b": 1}}}]},
        {"role": "tool", "name": "add", "content": "42"},
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


def test_a_chat_template_that_rewrites_history_is_an_error_naming_it(tokenizer):
    c = conversation(tokenizer, "once 1")
    c.prompt = [{"role": "user", "content": "once 1"}]
    original = tokenizer.chat_template
    try:  # a template that drops earlier assistant turns once tool messages follow
        tokenizer.chat_template = original.replace("{%- for message in messages %}", "{%- for message in messages[-2:] %}", 1)
        if tokenizer.chat_template == original:
            pytest.skip("the tiny template's loop is written differently")
        with pytest.raises(DataError, match="renders the conversation differently"):
            run_conversations([c], scripted_turns(tokenizer), tokenizer, max_completion_length=200)
    finally:
        tokenizer.chat_template = original


# ----------------------------------------------------------------------------------------------
# In the trainer: rewards' inputs, the loss mask, metrics, environments
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch, tiny_qwen2_dir):
    """The module samples with the scripted policy (inside the FSDP2 gathering, as real sampling)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    monkeypatch.setattr(lit_grpo.module, "generate_from_ids",
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
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 5, "b": 1}}}]},
        {"role": "tool", "name": "add", "content": "6"},
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
    assert tool_use.environment_rewards(conversations).tolist() == [[1.0], [0.0]]
    assert '"name": "lookup"' in tokenizer.decode(first.prompt_ids)  # the tool is shown to the model
    with pytest.raises(DataError, match="sample 0, column 'environment': 'chess' is not one of"):
        tool_use.start(["q"], {"store": [store], "key": ["a"], "environment": ["chess"]}, 1, tokenizer, None, None)
    with pytest.raises(plugins.UnknownEnvironmentError, match="Did you mean 'kv_lookup'"):
        ToolUse(None, {"name": "kv_lookpu"}, None, None, None)


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

