"""The offline tiny model loads like a hub model and behaves like a well-formed tokenizer/model pair."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from lit_grpo.tiny import CHAT_TEMPLATE, build_tiny_model

TEXT_WITH_WHITESPACE = "Hello, world!\n\tsecond  line (x=1; y=2)\n\nthird ~ line "


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def test_loads_through_auto_classes(tokenizer, model):
    assert isinstance(model, LlamaForCausalLM)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.is_fast
    assert tokenizer.padding_side == "left"
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings
    assert model.config.bos_token_id == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<s>")
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_each_character_is_one_token_and_decoding_round_trips(tokenizer):
    input_ids = tokenizer(TEXT_WITH_WHITESPACE).input_ids

    assert input_ids == tokenizer.convert_tokens_to_ids(list(TEXT_WITH_WHITESPACE))
    assert tokenizer.unk_token_id not in input_ids
    assert tokenizer.decode(input_ids) == TEXT_WITH_WHITESPACE


def test_plain_text_gets_no_special_tokens(tokenizer):
    assert len(tokenizer("ab").input_ids) == 2


def test_unknown_characters_map_to_unk(tokenizer):
    assert tokenizer("é").input_ids == [tokenizer.unk_token_id]


def test_special_tokens_are_skipped_when_decoding(tokenizer):
    input_ids = tokenizer("ab").input_ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]

    assert tokenizer.decode(input_ids, skip_special_tokens=True) == "ab"


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    assert text == "<|system|>Be brief.\n<|user|>2 + 2?\n<|assistant|>"


def test_pads_on_the_left(tokenizer):
    batch = tokenizer(["a", "abc"], padding=True)

    pad = tokenizer.pad_token_id
    assert tokenizer.pad_token == "<pad>" and pad == 0
    assert batch.input_ids[0] == [pad, pad, tokenizer.convert_tokens_to_ids("a")]
    assert batch.attention_mask == [[0, 0, 1], [1, 1, 1]]


def test_without_pad_token(tiny_model_dir_no_pad):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir_no_pad)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_no_pad)

    assert tokenizer.pad_token is None
    assert tokenizer.pad_token_id is None
    assert "<pad>" not in tokenizer.get_vocab()
    assert model.config.pad_token_id is None
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.decode(tokenizer(TEXT_WITH_WHITESPACE).input_ids) == TEXT_WITH_WHITESPACE


def test_generate_on_cpu(tokenizer, model):
    inputs = tokenizer(["Hi", "Hello"], return_tensors="pt", padding=True)

    output_ids = model.generate(**inputs, max_new_tokens=4, do_sample=True, top_k=0)

    completion_ids = output_ids[:, inputs.input_ids.shape[1] :]
    assert completion_ids.shape[0] == 2
    assert 1 <= completion_ids.shape[1] <= 4
    assert int(completion_ids.max()) < len(tokenizer)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    first = load_file(build_tiny_model(tmp_path / "first", seed=3) / "model.safetensors")
    again = load_file(build_tiny_model(tmp_path / "again", seed=3) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "other", seed=4) / "model.safetensors")

    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)


def test_leaves_global_random_state_alone(tmp_path):
    state_before = torch.random.get_rng_state()

    build_tiny_model(tmp_path, num_hidden_layers=1)

    assert torch.equal(torch.random.get_rng_state(), state_before)


def test_size_options_reach_the_config(tmp_path):
    build_tiny_model(
        tmp_path,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (32, 64, 1)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.max_position_embeddings == 128
    assert AutoTokenizer.from_pretrained(tmp_path).model_max_length == 128


def test_qwen2_variant_loads_as_qwen2_with_chatml_and_two_eos_ids(tiny_qwen2_dir):
    from transformers import Qwen2ForCausalLM, Qwen2Tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    assert isinstance(model, Qwen2ForCausalLM) and isinstance(tokenizer, Qwen2Tokenizer)
    assert model.dtype == torch.bfloat16  # saved in bf16, as hub checkpoints are
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token_id == im_end and tokenizer.pad_token_id == endoftext
    assert model.generation_config.eos_token_id == [im_end, endoftext]
    # one token per ASCII character, whitespace included, through the real byte-level class
    ids = tokenizer(TEXT_WITH_WHITESPACE).input_ids
    assert len(ids) == len(TEXT_WITH_WHITESPACE) and tokenizer.decode(ids) == TEXT_WITH_WHITESPACE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2 + 2?"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and im_end in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_vocab_size_pads_the_embedding_beyond_the_tokenizer(tmp_path):
    path = build_tiny_model(tmp_path / "big-vocab", architecture="qwen2", vocab_size=1000)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == 1000 and len(AutoTokenizer.from_pretrained(path)) < 1000
    with pytest.raises(ValueError, match="vocab_size 10 is smaller than the tokenizer's"):
        build_tiny_model(tmp_path / "small", vocab_size=10)
