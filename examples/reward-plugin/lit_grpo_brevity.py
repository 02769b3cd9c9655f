"""An example lit-grpo reward plugin: ``brevity`` prefers completions of at most ``max_chars``."""

import lit_grpo


def brevity(prompts, completions, max_chars: int = 200, **kwargs):
    """1.0 for completions of at most ``max_chars`` characters, decaying as max_chars / length beyond.

    args:
        max_chars (int): the length that still scores 1.0 (default 200).
    """
    scores = []
    for completion in completions:
        # conversational data: completions are [{"role": "assistant", "content": ...}]
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        scores.append(1.0 if len(text) <= max_chars else max_chars / len(text))
    return scores


@lit_grpo.hookimpl
def register_rewards(register):
    register(brevity)
