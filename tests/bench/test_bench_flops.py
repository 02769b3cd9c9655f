"""The FLOP count behind the benchmark's compute floor (bench/flops.py), against hand-computed values.

The toy model: hidden 4, MLP 8, one layer, 2 query heads and 1 key/value head of width 2, vocabulary
10. Its projections hold q 4x4 + o 4x4 + k 4x2 + v 4x2 = 48 and MLP 3 x 4x8 = 96 weights: 144.
"""

import pytest

from bench.flops import ModelShape, forward_flops, generation_flops, grpo_step_flops

TOY = ModelShape(
    hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=10
)


def test_linear_weights_per_layer():
    assert TOY.linear_weights_per_layer == 144


def test_forward_flops_adds_projections_attention_and_output_head():
    # 3 tokens: 2 * 144 * 3 = 864; attention 4 * 4 * (1 + 2 + 3) = 96; 2 logits: 2 * 4 * 10 * 2 = 160
    assert forward_flops(TOY, num_tokens=3, sum_of_contexts=6, num_logits=2) == 864 + 96 + 160


def test_generation_prefills_once_and_decodes_all_but_the_first_token():
    # prefill of the 2-token prompt: 2 * 144 * 2 + 4 * 4 * (1 + 2) + 80 = 704
    # 3 sampled tokens need 2 decode forwards, seeing 3 and 4 keys: 576 + 4 * 4 * 7 + 160 = 848
    assert generation_flops(TOY, [2], [(2, 3)]) == 704 + 848


def test_grpo_step_flops_by_phase():
    rows = [(2, 3), (2, 1)]  # one prompt, G = 2
    # a log-prob forward needs what sampling needed: the prompt once (704, as in the test above),
    # then (2, 3)'s tokens 1 and 2 (848) and nothing of (2, 1), whose only token predicts nothing
    with_kl = grpo_step_flops(TOY, rows, num_generations=2, beta=0.04)
    assert (with_kl.generation, with_kl.training, with_kl.logprobs) == (1552, 3 * 1552, 1552)
    assert with_kl.total == 1552 + 4656 + 1552

    no_kl = grpo_step_flops(TOY, rows, num_generations=2, beta=0.0)
    assert no_kl.logprobs == 0

    # the first optimizer step's forward gives the old log-probs: no extra pass for one step per pass
    two_passes = grpo_step_flops(TOY, rows, num_generations=2, beta=0.0, num_iterations=2)
    assert (two_passes.training, two_passes.logprobs) == (2 * 4656, 0)
    # two steps per pass: one row is trained after the policy moved, at least the prompt (704) and
    # the cheaper row's tokens (none for (2, 1)) ...
    two_steps = grpo_step_flops(TOY, rows, num_generations=2, beta=0.0, steps_per_generation=2)
    assert (two_steps.training, two_steps.logprobs) == (4656, 704)
    # ... and with four groups of 2 and 4 steps: 6 rows, at least 3 groups' prompts
    rows = [(2, 3), (2, 1), (5, 2), (5, 2), (3, 1), (3, 1), (2, 1), (2, 3)]
    four_steps = grpo_step_flops(TOY, rows, num_generations=2, beta=0.04, steps_per_generation=4)
    prompts = [forward_flops(TOY, p, sum(range(1, p + 1)), 1) for p in (2, 2, 3)]
    # the four 1-token rows need no forward; then the two (5, 2), one token each (the (2, 3) rows need two)
    assert four_steps.logprobs == four_steps.generation + sum(prompts) + 2 * forward_flops(TOY, 1, 6, 1)


def test_grpo_step_flops_rejects_partial_groups():
    with pytest.raises(ValueError, match="num_generations = 2"):
        grpo_step_flops(TOY, [(2, 3), (2, 1), (2, 2)], num_generations=2, beta=0.0)


def test_model_shape_from_llama_config():
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )
    shape = ModelShape.from_config(config)
    assert shape.linear_weights_per_layer == 144
    assert (shape.attention_width, shape.key_value_width) == (4, 2)
