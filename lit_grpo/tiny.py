"""A tiny randomly initialised Llama model with a character-level tokenizer, built offline.

Tests and the CPU quickstart need a causal language model that loads exactly like a hub model
(``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` on a directory) but
without network access. :func:`build_tiny_model` writes one into a directory:

* the tokenizer has one token per printable ASCII character (space, tab and newline included) plus
  the special tokens ``<pad>``, ``<s>``, ``</s>`` and ``<unk>``; it pads on the left, carries a chat
  template, and adds no special tokens when encoding plain text;
* the model is a ``LlamaForCausalLM`` with tied embeddings and random weights drawn from ``seed``.

``architecture="qwen2"`` writes a ``Qwen2ForCausalLM`` instead, shaped like a Qwen2.5-Instruct
checkpoint in everything a recipe depends on: ChatML special tokens (``<|im_start|>``,
``<|im_end|>``, ``<|endoftext|>``), Qwen2.5's chat template (tools included), ``<|im_end|>`` as the
tokenizer's EOS, ``<|endoftext|>`` as its pad token, and *both* as EOS ids of the generation config
(a chat model ends a turn with either). transformers 5 loads any Qwen2 checkpoint's tokenizer as
its byte-level BPE class ``Qwen2Tokenizer`` whatever ``tokenizer_config.json`` says, so this
tokenizer *is* a ``Qwen2Tokenizer``: a byte-level vocabulary of the 256 bytes and no merges, so that
every ASCII character is still one token.
``dtype="bfloat16"`` saves the weights in bf16, as hub checkpoints are.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

__all__ = ["ARCHITECTURES", "CHAT_TEMPLATE", "QWEN2_CHAT_TEMPLATE", "build_tiny_model"]

ARCHITECTURES = ("llama", "qwen2")

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"

# Qwen2.5-Instruct's special tokens: <|endoftext|> pads and ends documents, <|im_end|> ends a turn.
QWEN2_ENDOFTEXT = "<|endoftext|>"
QWEN2_IM_START = "<|im_start|>"
QWEN2_IM_END = "<|im_end|>"

# Printable ASCII except the carriage return, vertical tab and form feed.
CHARACTERS = [character for character in string.printable if character not in "\r\x0b\x0c"]

# One line per message, role in angle-bar brackets; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# Qwen2.5-Instruct's chat template: ChatML turns, a default system message, and tools described in
# <tools></tools> with calls answered in <tool_call></tool_call> and results in <tool_response>.
QWEN2_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' }}{{- tool_call.name }}{{- '\\\", \\\"arguments\\\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# Whole: over 60 lines for its documented arguments; the body is about 50.
def build_tiny_model(
    output_dir: str | Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    seed: int = 0,
    pad_token: bool = True,
    architecture: str = "llama",
    dtype: str | torch.dtype | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Write a tiny random Llama model and its character-level tokenizer to ``output_dir``.

    The result loads with ``AutoModelForCausalLM.from_pretrained(output_dir)`` and
    ``AutoTokenizer.from_pretrained(output_dir)``. The same arguments always produce the same
    weights; the global torch random state is left untouched.

    Args:
        output_dir: Directory to write to (created if missing).
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the MLP hidden layer.
        num_hidden_layers: Number of decoder layers.
        num_attention_heads: Number of query heads; must divide ``hidden_size``.
        num_key_value_heads: Number of key/value heads (grouped-query attention); must divide
            ``num_attention_heads``.
        max_position_embeddings: Longest sequence the model supports; also the tokenizer's
            ``model_max_length``.
        seed: Seed for the random weights.
        pad_token: Whether the vocabulary has a ``<pad>`` token (id 0). Without one the tokenizer's
            ``pad_token`` is ``None``, which exercises the code paths that must fall back to EOS.
            (Llama only: the Qwen2 tokenizer pads with ``<|endoftext|>``, as Qwen2.5's does.)
        architecture: ``llama`` (``LlamaForCausalLM``) or ``qwen2`` (``Qwen2ForCausalLM`` with
            Qwen2.5-Instruct's special tokens, chat template and two EOS ids; see the module doc).
        dtype: the dtype the weights are saved in (``bfloat16`` as in hub checkpoints); None keeps
            float32.
        vocab_size: rows of the embedding and the output head when more than the tokenizer has (a
            real model's size, e.g. Qwen2.5's 151936; like Qwen2.5's, the rows past the tokenizer's
            vocabulary decode to nothing); None: the tokenizer's size.

    Returns:
        ``output_dir`` as a :class:`~pathlib.Path`.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    output_dir = Path(output_dir)
    qwen2 = architecture == "qwen2"
    tokenizer = (
        _build_qwen2_tokenizer(model_max_length=max_position_embeddings)
        if qwen2
        else _build_tokenizer(pad_token=pad_token, model_max_length=max_position_embeddings)
    )
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    shape = dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
    )
    if qwen2:  # as Qwen2.5-Instruct's config.json: bos = <|endoftext|>, eos = <|im_end|>
        endoftext = tokenizer.convert_tokens_to_ids(QWEN2_ENDOFTEXT)
        config = Qwen2Config(**shape, bos_token_id=endoftext, eos_token_id=tokenizer.eos_token_id, use_sliding_window=False)
        model_class = Qwen2ForCausalLM
        generation_eos = [tokenizer.eos_token_id, endoftext]  # a turn ends with either
    else:
        config = LlamaConfig(
            **shape,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model_class = LlamaForCausalLM
        generation_eos = tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = generation_eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if dtype is not None:
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)

    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def _build_tokenizer(*, pad_token: bool, model_max_length: int) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: every character is one token, decoding concatenates."""
    special_tokens = ([PAD_TOKEN] if pad_token else []) + [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
    return PreTrainedTokenizerFast(
        tokenizer_object=_character_tokenizer(special_tokens, UNK_TOKEN),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN if pad_token else None,
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )


def _character_tokenizer(special_tokens: list[str], unk_token: str) -> Tokenizer:
    """Every character one token (special tokens first in the vocabulary); decoding concatenates."""
    vocab = {token: token_id for token_id, token in enumerate(special_tokens + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    # `[\s\S]` rather than `.`: the Oniguruma `.` does not match a newline, so "\n\n" would become a
    # single unknown piece instead of two newline tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def _build_qwen2_tokenizer(*, model_max_length: int) -> Qwen2Tokenizer:
    """Qwen2.5-Instruct's tokenizer class, special tokens and chat template over a byte-level
    vocabulary without merges: one token per byte, so one per ASCII character."""
    byte_symbols = bytes_to_unicode()  # byte -> the printable character byte-level BPE writes it as
    special_tokens = [QWEN2_ENDOFTEXT, QWEN2_IM_START, QWEN2_IM_END]
    vocab = {token: token_id for token_id, token in enumerate(special_tokens)}
    vocab.update({byte_symbols[byte]: len(special_tokens) + byte for byte in range(256)})
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token=QWEN2_IM_END,
        pad_token=QWEN2_ENDOFTEXT,
        unk_token=None,
        extra_special_tokens=[QWEN2_IM_START],
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=QWEN2_CHAT_TEMPLATE,
    )
