"""A tiny randomly initialised Llama model with a character-level tokenizer, built offline.

Tests and the CPU quickstart need a causal language model that loads exactly like a hub model
(``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` on a directory) but
without network access. :func:`build_tiny_model` writes one into a directory:

* the tokenizer has one token per printable ASCII character (space, tab and newline included) plus
  the special tokens ``<pad>``, ``<s>``, ``</s>`` and ``<unk>``; it pads on the left, carries a chat
  template, and adds no special tokens when encoding plain text;
* the model is a ``LlamaForCausalLM`` with tied embeddings and random weights drawn from ``seed``.

A Llama config is deliberately used: transformers 5 maps a Qwen2 config to a byte-level tokenizer
class, which breaks a character-level tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "build_tiny_model"]

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"

# Printable ASCII except the carriage return, vertical tab and form feed.
CHARACTERS = [character for character in string.printable if character not in "\r\x0b\x0c"]

# One line per message, role in angle-bar brackets; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


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

    Returns:
        ``output_dir`` as a :class:`~pathlib.Path`.
    """
    output_dir = Path(output_dir)
    tokenizer = _build_tokenizer(pad_token=pad_token, model_max_length=max_position_embeddings)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def _build_tokenizer(*, pad_token: bool, model_max_length: int) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: every character is one token, decoding concatenates."""
    special_tokens = ([PAD_TOKEN] if pad_token else []) + [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
    vocab = {token: token_id for token_id, token in enumerate(special_tokens + CHARACTERS)}

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # `[\s\S]` rather than `.`: the Oniguruma `.` does not match a newline, so "\n\n" would become a
    # single unknown piece instead of two newline tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN if pad_token else None,
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
