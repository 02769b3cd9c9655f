"""First-party reward functions for lit-grpo.

This distribution (``lit-grpo-rewards``) is a plain lit-grpo plugin: its ``pyproject.toml`` declares
the entry point ``[project.entry-points.lit_grpo] lit_grpo_rewards = "lit_grpo_rewards"`` and this
module implements the ``register_rewards`` hook, exactly as a third-party plugin would.
"""

import lit_grpo

from lit_grpo_rewards.format import think_format
from lit_grpo_rewards.text import char_fraction, completion_text, exact_match

__version__ = "0.1.0"

__all__ = ["char_fraction", "completion_text", "exact_match", "register_rewards", "think_format"]


@lit_grpo.hookimpl
def register_rewards(register):
    register(char_fraction)
    register(exact_match)
    register(think_format)
