import json

import pytest

from lit_grpo import plugins
from lit_grpo_kv_lookup import KeyValueLookup, kv_answer
from lit_grpo_kv_lookup.warm_start import assistant_token_mask, sample_row, transcript

STORE = json.dumps({"a": "3", "b": "8"})


def test_lookup_returns_the_value_and_unknown_keys_raise_for_the_model_to_read():
    environment = KeyValueLookup(STORE, key="b")
    assert environment.lookup("b") == "8"
    with pytest.raises(KeyError, match="no key 'z'; the keys are a, b"):
        environment.lookup("z")
    assert environment.looked_up == ["b", "z"]
    assert environment.get_reward() == 1.0
    assert KeyValueLookup(STORE, key="b").get_reward() == 0.0  # never looked up


def test_kv_answer_wants_exactly_the_asked_value():
    answer = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    completions = [answer("The answer is 8."), answer("The answer is 3."), answer("8 3 8 1 9"), answer("")]
    assert kv_answer(["q"] * 4, completions, store=[STORE] * 4, key=["b"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_registered_through_the_entry_point():
    plugins.reset_plugins()
    assert plugins.get_environments()["kv_lookup"].package == "lit-grpo-kv-lookup"
    assert plugins.get_reward("kv_answer").package == "lit-grpo-kv-lookup"


def test_warm_start_trains_only_on_the_assistants_tokens(tmp_path):
    from lit_grpo.tiny import build_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path, architecture="qwen2"))
    import random

    row = sample_row(random.Random(0))
    messages = transcript(row, random.Random(0), wrong_key_frac=0.0)
    ids, mask = assistant_token_mask(tokenizer, messages, [KeyValueLookup.lookup])
    trained = tokenizer.decode([token for token, own in zip(ids, mask) if own])
    store = json.loads(row["store"])
    assert trained == (f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{row["key"]}"}}}}\n</tool_call><|im_end|>'
                       f"The answer is {store[row['key']]}.<|im_end|>")
