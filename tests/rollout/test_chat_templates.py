"""Multi-turn tool rollouts with the real chat templates of the main model families.

The templates in tests/fixtures/chat_templates are copies of the ``chat_template`` that Qwen2.5,
Qwen3, Llama 3.1 and Mistral-7B-Instruct-v0.3 ship in their ``tokenizer_config.json`` (templates are
text; the tiny byte-level tokenizer takes any of them once the family's special tokens are added).
A scripted policy writes each family's own tool-call format; the tests check token by token what
sits between its turns: the tool messages exactly as the template renders them after the policy's
end-of-turn token, and the next assistant header, whatever the template does to earlier turns.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import scripted_policy
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer

from lit_grpo.errors import DataError
from lit_grpo.rollout.tools.multi_turn import Conversation, TurnOutput, run_conversations
from lit_grpo.rollout.tools.tool_use import ToolUse
from lit_grpo.train.module import GRPOModule

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
ADD = "scripted_policy:add"

# family -> its template file, special tokens, end-of-turn token, every EOS id of its generation
# config, BOS, and the two turns of its scripted policy: a call of add(41, 1), then an answer.
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 41, "b": 1}}\n</tool_call>'
FAMILIES = {
    "qwen2.5": dict(template="qwen2.5.jinja", specials=CHATML, eos="<|im_end|>", stops=["<|im_end|>", "<|endoftext|>"],
                    bos=None, call=HERMES_CALL),
    "qwen3": dict(template="qwen3.jinja", specials=CHATML, eos="<|im_end|>", stops=["<|im_end|>", "<|endoftext|>"],
                  bos=None, call=HERMES_CALL),
    "llama3.1": dict(template="llama3.1.jinja", eos="<|eot_id|>", stops=["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
                     specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                               "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                     bos="<|begin_of_text|>", call='{"name": "add", "parameters": {"a": 41, "b": 1}}'),
    "mistral-v0.3": dict(template="mistral-v0.3.jinja", eos="</s>", stops=["</s>"], bos="<s>",
                         specials=["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                         call='[TOOL_CALLS] [{"name": "add", "arguments": {"a": 41, "b": 1}}]'),
}
ANSWER = "The answer is 42."
# What each template renders after the policy's end-of-turn token and before its next turn.
BETWEEN = {
    "qwen2.5": "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    # the string result is JSON-encoded: Llama 3.1's template tojson's any iterable content
    "llama3.1": '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    # Mistral's tool results name the call's id (9 alphanumerics, or the template raises); no header follows
    "mistral-v0.3": '[TOOL_RESULTS] {"content": 42, "call_id": "call00000"}[/TOOL_RESULTS]',
}


@pytest.fixture(scope="module")
def base_tokenizer(tiny_qwen2_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


def family_tokenizer(base_tokenizer, family: str, extra_specials=()):
    """The tiny byte-level tokenizer with ``family``'s special tokens, EOS, BOS and chat template."""
    spec = FAMILIES[family]
    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in [*spec["specials"], *extra_specials]],
                         special_tokens=True)
    tokenizer.eos_token = spec["eos"]
    tokenizer.bos_token = spec["bos"]
    tokenizer.chat_template = (TEMPLATES / spec["template"]).read_text()
    return tokenizer


def stop_ids(tokenizer, family: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(FAMILIES[family]["stops"])


def scripted(tokenizer, turns: list[str], stop: str):
    """generate_turn that writes ``turns`` in order (each ended by ``stop``), one per call per row."""
    calls = {}

    def generate_turn(contexts, max_new_tokens):
        outputs = []
        for row, context in enumerate(contexts):
            index = calls.get(row, 0)
            calls[row] = index + 1
            ids = tokenizer(turns[min(index, len(turns) - 1)] + stop, add_special_tokens=False)["input_ids"][:max_new_tokens]
            outputs.append(TurnOutput(ids, None, ids[-1] == tokenizer.convert_tokens_to_ids(stop)))
        return outputs

    return generate_turn


def one_conversation(tokenizer, chat_template_kwargs=None) -> Conversation:
    tool_use = ToolUse([ADD], None, None, None, None)
    (conversation,) = tool_use.start([[{"role": "user", "content": "What is 41 + 1?"}]], {}, 1, tokenizer, None,
                                     chat_template_kwargs)
    return conversation


@pytest.mark.parametrize("family, chat_template_kwargs", [
    ("qwen2.5", {}), ("qwen3", {}), ("qwen3", {"enable_thinking": False}), ("llama3.1", {}), ("mistral-v0.3", {}),
])
def test_a_tool_round_with_the_real_template_of_each_family(base_tokenizer, family, chat_template_kwargs):
    tokenizer = family_tokenizer(base_tokenizer, family)
    spec = FAMILIES[family]
    c = one_conversation(tokenizer, chat_template_kwargs)
    run_conversations([c], scripted(tokenizer, [spec["call"], ANSWER], spec["eos"]), tokenizer, max_completion_length=300,
                      chat_template_kwargs=chat_template_kwargs, stop_token_ids=stop_ids(tokenizer, family))

    assert (c.tool_calls, c.tool_failures, c.turns, c.truncated) == (1, 0, 2, False)
    assert [m["role"] for m in c.messages] == ["assistant", "tool", "assistant"]
    assert c.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 41, "b": 1}}
    assert c.messages[1]["content"] == "42" and c.messages[2]["content"] == ANSWER
    # token by token: the policy's two turns exactly as sampled, and between them the tool message and
    # the next assistant header as the template writes them (Qwen3 without thinking: its empty think block)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    call, answer = encode(spec["call"] + spec["eos"]), encode(ANSWER + spec["eos"])
    between = BETWEEN[family] + ("<think>\n\n</think>\n\n" if chat_template_kwargs.get("enable_thinking") is False else "")
    assert tokenizer.decode(c.token_ids[len(call): len(c.token_ids) - len(answer)]) == between
    assert c.token_ids == call + encode(between) + answer
    assert c.tool_mask == [1] * len(call) + [0] * len(encode(between)) + [1] * len(answer)
    # the prompt is the template's own rendering, with the tools and the generation prompt
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 41 + 1?"}], tools=list(c.schemas),
                                                tokenize=False, add_generation_prompt=True, **chat_template_kwargs)
    assert c.prompt_ids == encode(prompt_text)


def test_qwen3_renders_history_differently_once_a_tool_message_follows_and_the_rollout_does_not_care(base_tokenizer):
    """Qwen3's template writes an empty think block into the last assistant turn but not into an
    earlier one: re-rendering the conversation is not prefix-preserving, which the rollout must not need."""
    tokenizer = family_tokenizer(base_tokenizer, "qwen3")
    call = {"type": "function", "id": "call00000", "function": {"name": "add", "arguments": {"a": 41, "b": 1}}}
    history = [{"role": "user", "content": "What is 41 + 1?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = tokenizer.apply_chat_template(history, tokenize=False)
    after = tokenizer.apply_chat_template(history + [{"role": "tool", "content": "42"}], tokenize=False)
    assert not after.startswith(before)  # the premise: the template rewrites the assistant turn
    c = one_conversation(tokenizer)
    run_conversations([c], scripted(tokenizer, [HERMES_CALL, ANSWER], "<|im_end|>"), tokenizer, max_completion_length=300,
                      stop_token_ids=stop_ids(tokenizer, "qwen3"))
    assert c.tool_calls == 1 and c.messages[-1]["content"] == ANSWER


def test_each_template_is_read_with_its_own_call_format():
    from lit_grpo.rollout.tools.calls import default_parser

    assert {family: default_parser((TEMPLATES / spec["template"]).read_text()) for family, spec in FAMILIES.items()} == {
        "qwen2.5": "hermes", "qwen3": "hermes", "llama3.1": "llama3_json", "mistral-v0.3": "mistral",
    }


def test_tool_call_markers_that_are_special_tokens_are_found(base_tokenizer):
    """<tool_call> and </tool_call> as special tokens (as some tokenizers add them): decoding without
    special tokens would leave a bare JSON object and no call."""
    tokenizer = family_tokenizer(base_tokenizer, "qwen2.5", extra_specials=["<tool_call>", "</tool_call>"])
    assert len(tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) == 1
    assert "<tool_call>" not in tokenizer.decode(tokenizer(HERMES_CALL)["input_ids"], skip_special_tokens=True)
    c = one_conversation(tokenizer)
    run_conversations([c], scripted(tokenizer, [HERMES_CALL, ANSWER], "<|im_end|>"), tokenizer, max_completion_length=300,
                      stop_token_ids=stop_ids(tokenizer, "qwen2.5"))
    assert (c.tool_calls, c.tool_failures) == (1, 0)
    assert c.messages[0]["content"] == "" and c.messages[1]["content"] == "42"


def test_llama_refuses_two_calls_in_one_turn_and_the_rollout_ends_there_with_a_warning(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "llama3.1")
    two_calls = '{"name": "add", "parameters": {"a": 1, "b": 1}}; {"name": "add", "parameters": {"a": 2, "b": 2}}'
    c = one_conversation(tokenizer)
    with pytest.warns(UserWarning, match="only supports single tool-calls"):
        run_conversations([c], scripted(tokenizer, [two_calls, ANSWER], "<|eot_id|>"), tokenizer, max_completion_length=300,
                          stop_token_ids=stop_ids(tokenizer, "llama3.1"))
    assert c.done and (c.tool_calls, c.tool_failures, c.turns) == (2, 2, 1)
    assert [m["role"] for m in c.messages] == ["assistant"]  # no tool message the template could not write


def test_a_template_that_does_not_end_a_tool_calling_turn_with_an_eos_id_is_an_error_naming_it(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "qwen2.5")
    c = one_conversation(tokenizer)
    with pytest.raises(DataError, match="does not end an assistant turn that calls tools with any of the end-of-turn tokens"):
        # the policy's turns end with <|endoftext|> only, which the template never writes
        run_conversations([c], scripted(tokenizer, [HERMES_CALL, ANSWER], "<|endoftext|>"), tokenizer,
                          max_completion_length=300, stop_token_ids=tokenizer.convert_tokens_to_ids(["<|endoftext|>"]))


@pytest.fixture
def qwen3_model_dir(tmp_path, tiny_qwen2_dir):
    """The tiny Qwen2 model with Qwen3's chat template, loaded as a user's hub model would be."""
    import shutil

    path = Path(shutil.copytree(tiny_qwen2_dir, tmp_path / "tiny-qwen3-template"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    tokenizer.save_pretrained(path)
    return path


def test_training_with_qwen3s_template_and_thinking_off(qwen3_model_dir, monkeypatch, reward_plugin, write_jsonl,
                                                        fast_trainer):
    import lit_grpo.rollout.engines.policy
    import lit_grpo.train.module
    from lit_grpo.data import GRPODataModule

    tokenizer = AutoTokenizer.from_pretrained(qwen3_model_dir)
    monkeypatch.setattr(lit_grpo.rollout.engines.policy, "generate_from_ids",
                        lambda *args, **kwargs: scripted_policy.scripted_generate_from_ids(*args, **kwargs, tokenizer=tokenizer))
    seen = []

    def answered(completions, **kwargs):
        seen.extend(completions)
        return [1.0 if c[-1]["content"] == "The answer is 5+1." else 0.0 for c in completions]

    reward_plugin(answered=answered)
    module = GRPOModule(str(qwen3_model_dir), [{"name": "answered"}], num_generations=2, max_completion_length=128,
                        tools=[ADD], chat_template_kwargs={"enable_thinking": False}, log_completions_every_n_steps=0,
                        model_init_kwargs={"dtype": "float32"})
    data = GRPODataModule(path="json", data_files=str(write_jsonl([{"prompt": "once 5"}, {"prompt": "once 6"}])),
                          batch_size=1, conversational=True, shuffle=False)
    fast_trainer(max_steps=1).fit(module, datamodule=data)
    assert [m["role"] for m in seen[0]] == ["assistant", "tool", "assistant"]
    assert seen[0][1]["content"] == "6" and seen[0][-1]["content"] == "The answer is 5+1."
    assert torch.isfinite(torch.tensor(module.trainer.callback_metrics["loss"].item()))
