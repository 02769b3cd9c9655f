"""Rewards that depend on the length of a completion."""

from __future__ import annotations

import math
import numbers

from lit_grpo_rewards.math_rewards import math_correctness
from lit_grpo_rewards.text import completion_text

__all__ = ["cosine_scaled_accuracy", "soft_overlong_punishment"]


def _check_int(who: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{who}: {name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def _check_number(who: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{who}: {name} must be a finite number; got {value!r}")
    return float(value)


def soft_overlong_punishment(
    completion_ids, max_completion_len: int | None = None, soft_punish_cache: int | None = None, **kwargs
) -> list[float]:
    """DAPO's soft overlong penalty from the completion's token count: 0 when short, down to -1.

    From DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476, eq. 13), as TRL's ``get_soft_overlong_punishment``. With
    ``L = len(completion_ids[i])`` (the generated tokens, EOS included when generated),
    ``L_max = max_completion_len`` and ``L_cache = soft_punish_cache``::

        0                                  if L <= L_max - L_cache
        (L_max - L_cache - L) / L_cache    if L_max - L_cache < L <= L_max
        -1                                 if L > L_max

    Completions cut off at ``model.max_completion_length`` have exactly that length, so setting
    ``max_completion_len`` to it makes truncated completions score 0 down to -1 linearly over the
    last ``soft_punish_cache`` tokens (DAPO: 20480 and 4096).

    args:
        max_completion_len (int): ``L_max`` in tokens (default in a run: ``model.max_completion_length``).
        soft_punish_cache (int): ``L_cache`` in tokens, ``0 <= L_cache <= L_max`` (required; 0
            gives a hard -1 beyond ``L_max`` only).

    columns: none (uses ``completion_ids``).
    """
    who = "soft_overlong_punishment"
    if max_completion_len is None or soft_punish_cache is None:
        raise ValueError(f"{who} needs args `max_completion_len` and `soft_punish_cache` (token counts)")
    max_len = _check_int(who, "max_completion_len", max_completion_len, 1)
    cache = _check_int(who, "soft_punish_cache", soft_punish_cache, 0)
    if cache > max_len:
        raise ValueError(
            f"{who}: soft_punish_cache ({cache}) must not exceed max_completion_len ({max_len})"
        )
    if completion_ids is None:
        raise ValueError(f"{who} needs `completion_ids` (the trainer passes them on every call)")
    threshold = max_len - cache
    scores = []
    for ids in completion_ids:
        length = len(ids)
        if length <= threshold:
            scores.append(0.0)
        elif length <= max_len:
            scores.append((threshold - length) / cache)
        else:
            scores.append(-1.0)
    return scores


# Whole: over 60 lines for its documented arguments and formula; the body is about 45.
def cosine_scaled_accuracy(
    completions,
    completion_ids=None,
    answer=None,
    solution=None,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    max_len: int = 1000,
    length_unit: str = "chars",
    answer_pattern: str | None = None,
    answer_tag: str | None = "answer",
    timeout_seconds: float | None = 5,
    **kwargs,
) -> list[float | None]:
    """Length-scaled math accuracy: 1.0 down to 0.5 if correct, -1.0 up to -0.5 if wrong (defaults).

    From Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs" (arXiv:2502.03373),
    as open-r1's ``get_cosine_scaled_reward``. Correctness is decided exactly as in
    ``math_accuracy`` (Math-Verify). With ``progress = min(L / max_len, 1)`` and
    ``cosine = cos(progress * pi)``::

        correct: min_value_correct + 0.5 * (max_value_correct - min_value_correct) * (1 + cosine)
        wrong:   max_value_wrong   + 0.5 * (min_value_wrong   - max_value_wrong)   * (1 + cosine)

    With the defaults a correct answer scores 1.0 at length 0 falling to 0.5 at ``max_len``; a
    wrong one scores -1.0 at length 0 rising to -0.5 at ``max_len`` (being wrong at length is
    penalised less, encouraging the model to keep thinking when unsure). Lengths beyond
    ``max_len`` score as ``max_len`` (open-r1 does not clamp, so its cosine turns back up). A gold
    answer that cannot be parsed scores None (open-r1 gives 1.0).

    args:
        min_value_wrong, max_value_wrong (float): reward range of wrong answers (-1.0, -0.5).
        min_value_correct, max_value_correct (float): reward range of correct answers (0.5, 1.0).
        max_len (int): the length at which the cosine reaches its end (default 1000).
        length_unit (str): ``chars`` (default, as open-r1: characters of the completion text) or
            ``tokens`` (``len(completion_ids[i])``).
        answer_pattern, answer_tag, timeout_seconds: as in ``math_accuracy``.

    columns:
        answer (str | number | None): the gold answer, as in ``math_accuracy``.
        solution (str | None): used instead when there is no ``answer`` column (open-r1's name).
    """
    who = "cosine_scaled_accuracy"
    values = {
        name: _check_number(who, name, value)
        for name, value in (
            ("min_value_wrong", min_value_wrong),
            ("max_value_wrong", max_value_wrong),
            ("min_value_correct", min_value_correct),
            ("max_value_correct", max_value_correct),
        )
    }
    max_len = _check_int(who, "max_len", max_len, 1)
    if length_unit not in ("chars", "tokens"):
        raise ValueError(f"{who}: length_unit must be 'chars' or 'tokens'; got {length_unit!r}")
    if length_unit == "tokens":
        if completion_ids is None:
            raise ValueError(f"{who}: length_unit='tokens' needs `completion_ids`")
        lengths = [len(ids) for ids in completion_ids]
    else:
        lengths = [len(completion_text(c)) for c in completions]
    correct = math_correctness(
        completions,
        answer=answer,
        solution=solution,
        answer_pattern=answer_pattern,
        answer_tag=answer_tag,
        timeout_seconds=timeout_seconds,
        who=who,
    )
    scores: list[float | None] = []
    for ok, length in zip(correct, lengths):
        if ok is None:
            scores.append(None)
            continue
        cosine = math.cos(min(length / max_len, 1.0) * math.pi)
        if ok:
            low, high = values["min_value_correct"], values["max_value_correct"]
        else:  # swapped, as in open-r1: short wrong answers get the most negative reward
            low, high = values["max_value_wrong"], values["min_value_wrong"]
        scores.append(low + 0.5 * (high - low) * (1.0 + cosine))
    return scores

# Safe in any thread (no signals, no state shared between calls): lit-grpo's scorer keeps such a
# reward in the asynchronous pipeline's scoring thread rather than in a worker process of its own.
soft_overlong_punishment.thread_safe = True
