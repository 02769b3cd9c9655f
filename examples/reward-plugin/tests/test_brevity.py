from lit_grpo import plugins
from lit_grpo.scoring import build_reward
from lit_grpo_brevity import brevity


def test_brevity_values():
    assert brevity(prompts=["p"] * 3, completions=["ab", "abcd", "abcdefgh"], max_chars=4) == [1.0, 1.0, 0.5]


def test_brevity_conversational():
    completion = [{"role": "assistant", "content": "x" * 10}]
    assert brevity(prompts=[[]], completions=[completion], max_chars=5) == [0.5]


def test_registered_through_the_entry_point():
    plugins.reset_plugins()
    info = plugins.get_reward("brevity")
    assert info.package == "lit-grpo-brevity"
    assert build_reward("brevity", {"max_chars": 1})(prompts=["p"], completions=["ab"]) == [0.5]
