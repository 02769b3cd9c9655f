"""First-party reward functions for lit-grpo.

This distribution (``lit-grpo-rewards``) is a plain lit-grpo plugin: its ``pyproject.toml`` declares
the entry point ``[project.entry-points.lit_grpo] lit_grpo_rewards = "lit_grpo_rewards"`` and this
module implements the ``register_rewards`` hook, exactly as a third-party plugin would.

Heavy dependencies (``math_verify``, ``transformers``) are imported on first use, so loading the
plugin (``lit-grpo rewards``, config parsing) stays cheap.
"""

import lit_grpo

from lit_grpo_rewards.answer import answer_match
from lit_grpo_rewards.code import code_execution
from lit_grpo_rewards.format import think_format
from lit_grpo_rewards.length import cosine_scaled_accuracy, soft_overlong_punishment
from lit_grpo_rewards.math_rewards import math_accuracy
from lit_grpo_rewards.numeric import numeric_accuracy
from lit_grpo_rewards.repetition import repetition_penalty
from lit_grpo_rewards.reward_model import RewardModel
from lit_grpo_rewards.text import char_fraction, completion_text, exact_match

__version__ = "0.1.0"

__all__ = [
    "RewardModel",
    "answer_match",
    "char_fraction",
    "code_execution",
    "completion_text",
    "cosine_scaled_accuracy",
    "exact_match",
    "math_accuracy",
    "numeric_accuracy",
    "register_rewards",
    "repetition_penalty",
    "soft_overlong_punishment",
    "think_format",
]


@lit_grpo.hookimpl
def register_rewards(register):
    register(char_fraction)
    register(exact_match)
    register(think_format)
    register(answer_match)
    register(numeric_accuracy)
    register(math_accuracy)
    register(cosine_scaled_accuracy)
    register(soft_overlong_punishment)
    register(repetition_penalty)
    register(RewardModel, name="reward_model")
    register(code_execution)
