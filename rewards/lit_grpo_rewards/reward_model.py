"""A learned reward: any Hugging Face sequence-classification model with one output."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["RewardModel"]

_DTYPES = ("float32", "float16", "bfloat16")


def _looks_local(path: str) -> bool:
    """Whether ``path`` can only mean a local directory (not a hub id like ``org/name``)."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or path.count("/") > 1
        or (os.sep != "/" and os.sep in path)
    )


class RewardModel:
    """The score (single logit) a sequence-classification reward model gives prompt + completion.

    Loads ``AutoModelForSequenceClassification`` and ``AutoTokenizer`` from
    ``model_name_or_path`` (a local directory or a Hugging Face Hub id) on the **first call**, so
    building the config, ``lit-grpo rewards`` and ``--help`` never load it. The model must have
    ``num_labels == 1`` (a scalar reward head, as TRL's ``RewardTrainer`` trains); its
    ``logits[:, 0]`` are the rewards, computed in batches of ``batch_size`` under
    ``torch.inference_mode()`` with the model in ``eval()`` mode.

    Input text: for conversational data (``prompts[i]`` a list of chat messages) the reward
    model's own chat template is applied to ``prompt + completion`` messages (the policy's template
    is irrelevant); for plain strings the text is ``prompt + completion`` tokenized with the reward
    tokenizer's special tokens. Batches are padded on the right (with the EOS token when the tokenizer
    has no pad token). With ``max_length`` longer inputs are cut from the left, keeping the end of
    the completion.

    Device: ``"auto"`` puts the model on the training process's own GPU when CUDA is available,
    else on the CPU. That is the current CUDA device (Lightning selects the training device with
    ``torch.cuda.set_device`` before the first step, when the model is loaded), or ``cuda:LOCAL_RANK``
    (``LOCAL_RANK`` from the environment, default 0) if CUDA is not initialised yet. Any
    ``torch.device`` string (``"cpu"``, ``"cuda:1"``) is used as given.

    args:
        model_name_or_path (str): a local directory or a Hub id (required).
        batch_size (int): sequences per forward pass (default 16).
        device (str): ``auto`` (default: the training GPU, else CPU), ``cpu``, ``cuda:N``, ...
        max_length (int, optional): truncate inputs to this many tokens (from the left).
        dtype (str, optional): ``float32`` | ``bfloat16`` | ``float16`` | ``auto``; default:
            transformers' default for ``from_pretrained``.

    columns: none (uses ``prompts`` and ``completions``).

    Thread-safe (``thread_safe = True``): the trainer calls it in its own process from any thread
    (the asynchronous pipeline's scoring thread included) rather than in a worker process, which
    would load a second CUDA context and hold the model out of the training process.
    """

    thread_safe = True  # lit-grpo's scorer: keep it in the training process off the main thread too

    def __init__(
        self,
        model_name_or_path: str,
        batch_size: int = 16,
        device: str = "auto",
        max_length: int | None = None,
        dtype: str | None = None,
    ):
        if not isinstance(model_name_or_path, (str, os.PathLike)) or not str(model_name_or_path):
            raise ValueError(f"reward_model: model_name_or_path must be a path or hub id; got {model_name_or_path!r}")
        path = str(model_name_or_path)
        if _looks_local(path) and not Path(path).expanduser().exists():
            raise FileNotFoundError(f"reward_model: model_name_or_path {path!r} does not exist")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward_model: batch_size must be an integer >= 1; got {batch_size!r}")
        bad_max_length = isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        if max_length is not None and bad_max_length:
            raise ValueError(f"reward_model: max_length must be an integer >= 1 or null; got {max_length!r}")
        if dtype is not None and dtype != "auto" and str(dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"reward_model: dtype must be one of {', '.join(_DTYPES)}, auto or null; got {dtype!r}")
        if not isinstance(device, str) or not device:
            raise ValueError(f"reward_model: device must be a string such as 'auto', 'cpu' or 'cuda:0'; got {device!r}")
        self.model_name_or_path = str(Path(path).expanduser()) if _looks_local(path) else path
        self.batch_size = batch_size
        self.device = device
        self.max_length = max_length
        self.dtype = dtype
        self.__name__ = "reward_model"  # TRL-style callers label rewards by __name__
        self._model = None
        self._tokenizer = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"RewardModel({self.model_name_or_path!r}, batch_size={self.batch_size}, device={self.device!r}, "
            f"max_length={self.max_length}, dtype={self.dtype!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # Pickles as its configuration (for reward worker processes): the copy loads its own model
        # on its first call.
        state = self.__dict__.copy()
        state.update(_model=None, _tokenizer=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------------

    def resolve_device(self):
        """The ``torch.device`` the model runs on (see the class docstring for ``auto``)."""
        import torch

        if self.device != "auto":
            return torch.device(self.device)
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if torch.cuda.is_initialized():  # Lightning has called torch.cuda.set_device(training device)
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))

    @property
    def model(self):
        """The loaded model (loads it on first access)."""
        self._load()
        return self._model

    @property
    def tokenizer(self):
        """The loaded tokenizer (loads it on first access)."""
        self._load()
        return self._tokenizer

    def _load(self) -> None:
        if self._model is not None:
            return
        with self._lock:
            if self._model is not None:
                return
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            path = self.model_name_or_path
            kwargs: dict[str, Any] = {}
            if self.dtype is not None:
                dtype = str(self.dtype).removeprefix("torch.")
                kwargs["dtype"] = "auto" if dtype == "auto" else getattr(torch, dtype)
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    path, output_loading_info=True, **kwargs
                )
            except (OSError, ValueError) as exc:
                raise OSError(
                    f"reward_model: cannot load a sequence-classification model and tokenizer from "
                    f"{path!r} (a local directory or a Hugging Face Hub id): {type(exc).__name__}: {exc}"
                ) from exc
            num_labels = model.config.num_labels
            if num_labels != 1:
                raise ValueError(
                    f"reward_model: {path!r} has num_labels={num_labels}; a reward model must output one "
                    f"score (num_labels=1)"
                )
            missing = [k for k in (info or {}).get("missing_keys", []) or []]
            if missing:
                raise ValueError(
                    f"reward_model: {path!r} has no trained classification head (missing weights: "
                    f"{', '.join(sorted(missing)[:5])}); it is not a reward model checkpoint, and its "
                    f"scores would be random"
                )
            if tokenizer.pad_token is None:
                if tokenizer.eos_token is None:
                    raise ValueError(f"reward_model: the tokenizer of {path!r} has neither a pad nor an EOS token")
                tokenizer.pad_token = tokenizer.eos_token
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tokenizer.pad_token_id
            tokenizer.truncation_side = "left"
            tokenizer.padding_side = "right"  # positions start at 0 as in training
            model.to(self.resolve_device())
            model.eval()
            self._tokenizer = tokenizer
            self._model = model

    # ----------------------------------------------------------------------------------------------

    def texts(self, prompts: Sequence, completions: Sequence) -> tuple[list[str], bool]:
        """The texts that are scored, and whether they already contain special tokens (chat template)."""
        tokenizer = self.tokenizer
        conversational = any(not isinstance(x, str) for x in [*prompts, *completions])
        if not conversational:
            return [p + c for p, c in zip(prompts, completions)], False
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"reward_model: the data is conversational but the tokenizer of "
                f"{self.model_name_or_path!r} has no chat template"
            )
        texts = []
        for prompt, completion in zip(prompts, completions):
            messages = (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            ) + ([{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion))
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
        return texts, True

    def score_texts(self, texts: Sequence[str], templated: bool = False) -> list[float]:
        """The reward model's score of each text, ``batch_size`` texts per forward pass."""
        import torch

        model, tokenizer = self.model, self.tokenizer
        device = next(model.parameters()).device
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = tokenizer(
                    list(texts[start : start + self.batch_size]),
                    return_tensors="pt",
                    padding=True,
                    truncation=self.max_length is not None,
                    max_length=self.max_length,
                    add_special_tokens=not templated,
                ).to(device)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                scores.extend(logits[:, 0].float().tolist())
        return scores

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        if prompts is None or completions is None:
            raise ValueError("reward_model needs `prompts` and `completions`")
        if len(prompts) != len(completions):
            raise ValueError(f"reward_model: got {len(prompts)} prompts but {len(completions)} completions")
        if not completions:
            return []
        texts, templated = self.texts(prompts, completions)
        return self.score_texts(texts, templated)
