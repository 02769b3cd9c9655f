"""Shared pytest fixtures. Tests run on CPU without network access."""

import os

# Never reach for the Hugging Face Hub: fail fast instead of hanging on a network that is not there.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from lit_grpo.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama model with a character-level tokenizer and a ``<pad>`` token, built once."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_dir_no_pad(tmp_path_factory):
    """Like ``tiny_model_dir`` but without a pad token (``tokenizer.pad_token is None``)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-no-pad"), pad_token=False)
