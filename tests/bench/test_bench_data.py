"""bench/harness.py's long-prompt variant of the quickstart data (bench/compare_trl.py --long-prompts-at), the
floor each run is set against, and the runs compare_trl.py and learning.py ask for."""

import json

import pytest

from bench.harness import QUICKSTART_DATA, long_prompt_data


def test_long_prompts_put_an_instruction_of_the_given_length_before_every_prompt(tmp_path):
    original = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines()]
    for extra in (40, 300):  # shorter and longer than one copy of the instruction
        rows = [json.loads(line) for line in long_prompt_data(tmp_path, extra).read_text().splitlines()]
        assert len(rows) == len(original)
        instruction = rows[0]["prompt"][:extra]
        for row, before in zip(rows, original):
            assert row["prompt"] == instruction + before["prompt"]
            assert row["target"] == before["target"]
        assert len(set(instruction)) > 10  # text, not one repeated character


def test_a_runs_floor_counts_its_passes_over_the_generation_batch():
    from bench.flops import ModelShape, grpo_step_flops
    from bench.harness import step_flops

    shape = ModelShape(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    step = {"prompt_lengths": [2, 2, 3, 3], "completion_lengths": [3, 1, 2, 4]}
    rows = list(zip(step["prompt_lengths"], step["completion_lengths"]))
    spec = {"num_generations": 2, "beta": 0.04, "lit_options": {"num_iterations": 2, "steps_per_generation": 2}}
    expected = grpo_step_flops(shape, rows, 2, 0.04, num_iterations=2, steps_per_generation=2)
    assert step_flops(shape, step, spec) == expected
    assert expected.training == 2 * grpo_step_flops(shape, rows, 2, 0.04).training
    assert step_flops(shape, step, {"num_generations": 2, "beta": 0.04}) == grpo_step_flops(shape, rows, 2, 0.04)


def test_the_floor_share_2x_would_need_follows_from_both_trainers_rates():
    from bench import compare_trl

    # lit-grpo: 1000 tok/s at 40 % of its floor (0.4 ms of matmuls per token); TRL: 600 tok/s.
    # 2x TRL = 1200 tok/s = 0.833 ms per token, of which the 0.4 ms floor is 48 %.
    lit = {"percent_of_floor": 40.0, "tokens_per_second": 1000.0}
    trl = {"percent_of_floor": 30.0, "tokens_per_second": 600.0}
    assert compare_trl.percent_of_floor_needed(lit, trl) == pytest.approx(48.0)
    assert compare_trl.percent_of_floor_needed(lit, trl, goal=1.0) == pytest.approx(24.0)
    # with the same floor per token TRL runs at 0.4 ms / (1/600 s) = 24 % of it: 2x needs twice that
    assert compare_trl.percent_of_floor_needed(lit, trl) == pytest.approx(2 * 0.4e-3 * 600 * 100)
    # lit-grpo at 70 % of its floor, TRL at 0.7 ms / (1/900 s) = 63 %: 2x would need 126 %, beyond the machine
    lit = {"percent_of_floor": 70.0, "tokens_per_second": 1000.0}
    trl = {"percent_of_floor": 63.0, "tokens_per_second": 900.0}
    assert compare_trl.percent_of_floor_needed(lit, trl) == pytest.approx(126.0)


def test_a_runs_num_iterations_sets_the_floors_training_passes_for_both_trainers():
    from bench.flops import ModelShape, grpo_step_flops
    from bench.harness import step_flops

    shape = ModelShape(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    step = {"prompt_lengths": [2, 2, 3, 3], "completion_lengths": [3, 1, 2, 4]}
    rows = list(zip(step["prompt_lengths"], step["completion_lengths"]))
    twice = grpo_step_flops(shape, rows, 2, 0.0, num_iterations=2)
    assert step_flops(shape, step, {"num_generations": 2, "beta": 0.0, "num_iterations": 2}) == twice
    assert twice.training == 2 * grpo_step_flops(shape, rows, 2, 0.0).training
    # an ablation's lit_options win over the run's own setting
    spec = {"num_generations": 2, "beta": 0.0, "num_iterations": 2, "lit_options": {"num_iterations": 3}}
    assert step_flops(shape, step, spec) == grpo_step_flops(shape, rows, 2, 0.0, num_iterations=3)


def test_compare_trl_runs_every_configuration_at_each_num_iterations():
    from bench import compare_trl

    args = compare_trl.parse_args(["--sizes", "4M", "--lengths", "32", "--betas", "0", "--precisions", "bf16", "--num-iterations", "1", "2"])
    labels = [config.label for config in compare_trl.configs_from(args)]
    assert labels == [
        "4M, L=32, beta=0, bf16",
        "4M, L=32, beta=0, bf16, num_iterations=2",
        "4M, L=128, beta=0, bf16, fixed length",
        "4M, L=128, beta=0, bf16, fixed length, num_iterations=2",
    ]
    with pytest.raises(SystemExit, match="--num-iterations must be at least 1"):
        compare_trl.configs_from(compare_trl.parse_args(["--num-iterations", "0"]))


def test_learning_runs_both_trainers_at_the_asked_num_iterations():
    from bench import learning

    args = learning.parse_args(["--num-iterations", "2", "--steps", "50"])
    specs = [learning.run_spec(args, trainer, "model", seed=3) for trainer in learning.TRAINERS]
    assert [spec.trainer for spec in specs] == ["lit-grpo", "trl"]
    assert [(spec.num_iterations, spec.steps, spec.seed) for spec in specs] == [(2, 50, 3), (2, 50, 3)]
    assert learning.run_spec(learning.parse_args([]), "trl", "model", seed=0).num_iterations == 1
    with pytest.raises(SystemExit, match="--num-iterations must be at least 1, got 0"):
        learning.parse_args(["--num-iterations", "0"])


def test_learning_runs_both_trainers_at_the_asked_steps_per_generation():
    from bench import learning
    from bench.flops import ModelShape, grpo_step_flops
    from bench.harness import step_flops

    args = learning.parse_args(["--steps-per-generation", "2", "--num-iterations", "2"])
    specs = [learning.run_spec(args, trainer, "model", seed=0) for trainer in learning.TRAINERS]
    assert [(spec.steps_per_generation, spec.num_iterations) for spec in specs] == [(2, 2), (2, 2)]
    assert learning.run_spec(learning.parse_args([]), "trl", "model", seed=0).steps_per_generation == 1
    # the floor counts the run's old-log-prob pass over the rows trained after the first step
    shape = ModelShape(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    step = {"prompt_lengths": [2, 2, 3, 3], "completion_lengths": [3, 1, 2, 4]}
    rows = list(zip(step["prompt_lengths"], step["completion_lengths"]))
    spec = {"num_generations": 2, "beta": 0.0, "steps_per_generation": 2}
    assert step_flops(shape, step, spec) == grpo_step_flops(shape, rows, 2, 0.0, steps_per_generation=2)
    assert step_flops(shape, step, spec) != step_flops(shape, step, {"num_generations": 2, "beta": 0.0})
    for bad in ("0", "3"):  # 64 completions per generation batch
        with pytest.raises(SystemExit, match=f"--steps-per-generation must be at least 1 and divide the 64 completions, got {bad}"):
            learning.parse_args(["--steps-per-generation", bad])
