"""A key-value lookup environment for lit-grpo's multi-turn rollouts, and the reward for its answers.

Each sample has a ``store`` column (a JSON object of keys and values) and a ``key`` column, and a
question such as "Which digit is stored under c?". The policy sees one tool, ``lookup(key)``; a good
rollout calls it with the asked key, reads the value and answers with it:

    <tool_call>
    {"name": "lookup", "arguments": {"key": "c"}}
    </tool_call>            -> tool: 1
    The answer is 1.

* environment ``kv_lookup`` (:class:`KeyValueLookup`): ``get_reward()`` is 1.0 when the rollout looked
  up the asked key, else 0.0 (logged as ``rewards/kv_lookup/mean``);
* reward ``kv_answer``: 1.0 when the last assistant message names one number, the asked key's value
  (a message listing many digits does not count).
"""

from __future__ import annotations

import json
import re

import lit_grpo

__all__ = ["KeyValueLookup", "kv_answer"]


def _store(store) -> dict[str, str]:
    return {str(k): str(v) for k, v in (json.loads(store) if isinstance(store, str) else dict(store)).items()}


class KeyValueLookup:
    """A key-value store the policy reads with the lookup tool."""

    def __init__(self, store, key: str):
        self.store = _store(store)
        self.key = key
        self.looked_up: list[str] = []

    def lookup(self, key: str) -> str:
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        self.looked_up.append(key)
        if key not in self.store:
            raise KeyError(f"no key {key!r}; the keys are {', '.join(sorted(self.store))}")
        return self.store[key]

    def get_reward(self) -> float:
        """1.0 when the rollout looked up the key the question asks about."""
        return 1.0 if self.key in self.looked_up else 0.0


def kv_answer(prompts, completions, store, key, **kwargs) -> list[float]:
    """1.0 when the last assistant message names exactly one number, the value stored under the asked key."""
    scores = []
    for completion, row_store, row_key in zip(completions, store, key):
        messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        answers = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
        value = _store(row_store).get(row_key)
        scores.append(1.0 if answers and value is not None and re.findall(r"\d+", answers[-1]) == [value] else 0.0)
    return scores


@lit_grpo.hookimpl
def register_environments(register):
    register(KeyValueLookup, name="kv_lookup")


@lit_grpo.hookimpl
def register_rewards(register):
    register(kv_answer)
