"""Test-only lit-grpo plugin: one function reward and one class reward with a constructor arg."""

import lit_grpo


def shouts(prompts, completions, **kwargs):
    """1.0 if the completion is all upper case, else 0.0."""
    return [1.0 if c.isupper() else 0.0 for c in completions]


class ContainsWord:
    """1.0 if the completion contains `word`, else 0.0.

    args:
        word (str): the word to look for.
    """

    def __init__(self, word):
        if not word:
            raise ValueError("word must be a non-empty string")
        self.word = word

    def __call__(self, prompts, completions, **kwargs):
        return [1.0 if self.word in c else 0.0 for c in completions]


@lit_grpo.hookimpl
def register_rewards(register):
    register(shouts)
    register(ContainsWord, name="contains_word")
