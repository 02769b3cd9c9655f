import itertools
import json
import random

import pytest
import torch
import torch.nn.functional as F
from lit_grpo_kv_lookup import KeyValueLookup, kv_answer
from lit_grpo_kv_lookup.warm_start import (
    TOOLS,
    assistant_token_mask,
    from_user_turn,
    give_up_transcript,
    sample_row,
    shared_prefix_loss,
    tool_transcript,
    tool_use_probabilities,
    training_example,
)

from lit_grpo import plugins

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
    answer = lambda text: [{"role": "assistant", "content": text}]
    completions = [answer("The answer is 8."), answer("The answer is 3."), answer("8 3 8 1 9"), answer("")]
    assert kv_answer(["q"] * 4, completions, store=[STORE] * 4, key=["b"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_registered_through_the_entry_point():
    plugins.reset_plugins()
    assert plugins.get_environments()["kv_lookup"].package == "lit-grpo-kv-lookup"
    assert plugins.get_reward("kv_answer").package == "lit-grpo-kv-lookup"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The warm start's tiny Qwen2 model before training (weights drawn with std 0.1, as it does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("kv"), architecture="qwen2", num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.1)
    return model, AutoTokenizer.from_pretrained(path)


def test_the_data_has_no_answer_in_the_prompt():
    """Four different digits drawn for each row: the question names only the key."""
    rows = [sample_row(random.Random(seed)) for seed in range(50)]
    for row in rows:
        store = json.loads(row["store"])
        assert sorted(store) == ["a", "b", "c", "d"] and len(set(store.values())) == 4
        assert row["prompt"] == f"Which digit is stored under {row['key']}?"
    assert len({row["store"] for row in rows}) == 50


def test_warm_start_trains_only_on_the_assistants_tokens(tiny):
    _, tokenizer = tiny
    row = sample_row(random.Random(0))
    ids, mask = assistant_token_mask(tokenizer, tool_transcript(row), TOOLS)
    trained = tokenizer.decode([token for token, own in zip(ids, mask) if own])
    store = json.loads(row["store"])
    assert trained == (f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{row["key"]}"}}}}\n</tool_call><|im_end|>'
                       f"The answer is {store[row['key']]}.<|im_end|>")


@pytest.mark.parametrize(("call_frac", "tool_weight", "answer_weight"), [(0.05, 1 / 57, 1.0), (1.0, 1.0, 0.0), (0.75, 1.0, 1.0)])
def test_the_first_token_is_weighted_so_that_the_model_calls_with_call_frac(tiny, call_frac, tool_weight, answer_weight):
    """Three transcripts in four use the tool. For call_frac 0.05 a call's first token weighs
    (0.05 / 0.75) / (0.95 / 0.25) = 1/57 and an answer's 1: 0.75 * 1/57 / (0.75 * 1/57 + 0.25) = 0.05."""
    _, tokenizer = tiny
    rng, seen = random.Random(0), {}
    for _ in range(40):
        row = sample_row(rng)
        ids, weights = training_example(tokenizer, row, rng, call_frac)
        calls = ids == assistant_token_mask(tokenizer, tool_transcript(row), TOOLS)[0]
        _, mask = assistant_token_mask(tokenizer, tool_transcript(row) if calls else give_up_transcript(row), TOOLS)
        first = mask.index(1)  # the assistant's first token: <tool_call>, or the answer's first
        seen.setdefault(calls, set()).add(round(weights[first], 6))
        assert weights[:first] + weights[first + 1 :] == [float(own) for own in mask[:first] + mask[first + 1 :]]
    assert seen[True] == {round(tool_weight, 6)} and seen[False] == {round(answer_weight, 6)}


def padded_loss(model, examples, pad_token_id):
    """The weighted next-token loss of a plain forward pass over the right-padded batch."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    weights = torch.zeros((len(examples), width))
    for row, (ids, token_weights) in enumerate(examples):
        input_ids[row, : len(ids)], attention_mask[row, : len(ids)] = torch.tensor(ids), 1
        weights[row, : len(ids)] = torch.tensor(token_weights)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    losses = F.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none")
    return (losses * weights[:, 1:].flatten()).sum() / weights[:, 1:].sum()


@pytest.mark.parametrize("with_system_prompt", [True, False])
def test_shared_prefix_loss_equals_a_plain_padded_forward_and_so_does_its_gradient(tiny, with_system_prompt):
    model, tokenizer = tiny
    rng = random.Random(1)
    examples = [training_example(tokenizer, sample_row(rng), rng, 0.05) for _ in range(5)]
    if not with_system_prompt:
        examples = [from_user_turn(tokenizer, ids, weights) for ids, weights in examples]
    assert len({len(ids) for ids, _ in examples}) > 1  # padded
    losses, grads = [], []
    for loss_of in (shared_prefix_loss, padded_loss):
        model.zero_grad()
        loss = loss_of(model, examples, tokenizer.pad_token_id)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] > 1.0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_tool_use_probabilities_are_the_models_at_the_call_the_key_and_the_copied_value(tiny):
    model, tokenizer = tiny
    rows = [sample_row(random.Random(seed)) for seed in range(3)]
    measured = tool_use_probabilities(model, tokenizer, rows)
    expected = {"call": 0.0, "asked_key": 0.0, "copy": 0.0}
    for row in rows:  # by hand: each transcript alone, the token at each choice found by its text
        ids, _ = assistant_token_mask(tokenizer, tool_transcript(row), TOOLS)
        with torch.no_grad():
            probabilities = model(input_ids=torch.tensor([ids])).logits[0].softmax(-1)
        before = ["", *itertools.accumulate(tokenizer.decode([token]) for token in ids)]  # the text before each token
        call = next(i for i, text in enumerate(before) if text.endswith("<|im_start|>assistant\n"))
        key = next(i for i in range(call, len(ids)) if before[i].endswith('"key": "'))
        copy = next(i for i in range(key, len(ids)) if before[i].endswith("The answer is "))
        value = json.loads(row["store"])[row["key"]]
        assert tokenizer.decode(ids[call : call + 11]) == "<tool_call>"
        assert (tokenizer.decode(ids[key]), tokenizer.decode(ids[copy])) == (row["key"], value)
        for choice, position in (("call", call), ("asked_key", key), ("copy", copy)):
            expected[choice] += probabilities[position - 1, ids[position]].item() / len(rows)
    assert measured == pytest.approx(expected, rel=1e-4)
