"""bench/trainer_runs.py's extra, untimed steps: the matmul counter and the operator profiler
(bench/profile_step.py), and how a profiled step's time is split."""

import mmap

import pytest
import torch

from bench.trainer_runs import RECORDER, RecordingCallback, RunSpec, split_step_time


def test_a_timed_step_is_split_into_matmuls_copies_other_operators_the_rest_and_the_timers_cost():
    ops = [
        ("aten::mm", 0.30, 10),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", 0.10, 2),
        ("aten::copy_", 0.08, 40),
        ("aten::_to_copy", 0.02, 40),
        ("aten::mul", 0.15, 30),
        ("aten::_softmax", 0.05, 2),
        ("lit::custom", 0.01, 1),  # an operator of another namespace: still an operator
    ]
    split = split_step_time(1.0, ops, seconds_per_call=1e-3, top=3)
    # 125 calls x 1 ms of timer cost; the rest of the second is outside operators
    assert split["seconds_by_category"] == pytest.approx(
        {"matrix products": 0.40, "copies and casts": 0.10, "other operators": 0.21,
         "outside operators": 0.165, "timer overhead": 0.125}
    )
    assert [op["name"] for op in split["top_ops"]] == ["aten::mm", "aten::mul", "aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert split["top_ops"][0] == {"name": "aten::mm", "seconds": 0.30, "calls": 10}


def test_the_operator_timer_sees_the_kernels_below_autocast_and_in_the_backward_pass():
    from bench.trainer_runs import OpTimer

    weight = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(4, 8)
    timer = OpTimer()
    assert 0 < timer.seconds_per_call < 1e-3
    with timer, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(x, weight).float().sum().backward()
    names = {op["name"]: op["calls"] for op in timer.summary["top_ops"]}
    assert names["aten::_to_copy"] >= 2  # autocast's casts of x and of the weight to bf16
    assert names["aten::mm"] == 2  # forward (x w^T) and the weight's gradient; x needs none
    assert timer.summary["seconds_by_category"]["matrix products"] > 0
    assert sum(timer.summary["seconds_by_category"].values()) == pytest.approx(timer.summary["wall_seconds"])


def touch_fresh_pages(size: int = 64 * 2**20) -> None:
    """Write to every page of a new anonymous mapping: page faults whatever the heap holds (a tensor
    may reuse memory that an earlier test faulted in and the allocator kept, and then fault nothing)."""
    with mmap.mmap(-1, size) as fresh:
        for offset in range(0, size, mmap.PAGESIZE):
            fresh[offset] = 1


def test_the_timed_steps_come_first_then_the_counted_step_then_the_profiled_one():
    recorder = RecordingCallback(recorded_steps=2, count_matmuls=True, profile_ops=True)
    assert recorder.extra_steps == 2  # the trainer runs 2 + 2 steps
    a, b = torch.ones(4, 8), torch.ones(8, 16)
    work = [
        touch_fresh_pages,  # 64 MiB of fresh memory, touched in this step
        lambda: a @ b,
        lambda: a @ b,  # counted: 2 * 4 * 8 * 16 FLOPs
        lambda: torch.bmm(a[None], b[None]),  # profiled
    ]
    recorder.train_start()
    for step, run in enumerate(work):
        RECORDER.prompt_lengths, RECORDER.completion_lengths, RECORDER.rewards = [5, 6], [step + 1, step + 2], [0.5]
        recorder.step_start()
        run()
        recorder.step_end({"generate": 0.25})
    result = recorder.result(RunSpec(trainer="lit-grpo", model_dir="m", data_file="d", steps=2, count_matmuls=True, profile_ops=True))
    assert [record.step for record in result.steps] == [0, 1]
    touching, quiet = (record.minor_faults for record in result.steps)
    assert touching > quiet + 10  # at least 32 faults even with 2 MiB pages
    assert quiet < touching / 2  # each step counts its own faults, not those since the start
    assert result.matmul_flops_by_dtype == {"float32": 2 * 4 * 8 * 16}
    assert result.counted_step_completion_lengths == [3, 4]
    profile = result.op_profile
    names = {op["name"] for op in profile["top_ops"]}
    assert "aten::bmm" in names and "aten::mm" not in names  # only the last step was profiled
    assert profile["completion_lengths"] == [4, 5] and profile["prompt_lengths"] == [5, 6]
    assert profile["phases"] == {"generate": 0.25}
    assert profile["seconds_by_category"]["matrix products"] > 0
    assert sum(profile["seconds_by_category"].values()) == pytest.approx(profile["wall_seconds"])
    assert isinstance(profile["minor_faults"], int) and profile["minor_faults"] >= 0


def test_without_extra_steps_nothing_is_counted_or_profiled():
    recorder = RecordingCallback(recorded_steps=1, count_matmuls=False)
    assert recorder.extra_steps == 0
    recorder.train_start()
    for _ in range(2):  # a step beyond the recorded ones is neither timed nor instrumented
        recorder.step_start()
        torch.ones(2, 2) @ torch.ones(2, 2)
        recorder.step_end()
    result = recorder.result(RunSpec(trainer="trl", model_dir="m", data_file="d", steps=1))
    assert len(result.steps) == 1 and result.op_profile is None and result.matmul_flops_by_dtype is None


def test_with_num_iterations_a_trl_record_spans_the_sampling_step_and_the_training_only_steps():
    """TRL's trainer steps alternate (one samples, num_iterations - 1 train on the buffered batch);
    one record covers them all, and the counted step is a whole generation batch too."""
    from types import SimpleNamespace

    recorder = RecordingCallback.for_transformers(2, count_matmuls=True, optimizer_steps_per_record=3)
    state = SimpleNamespace(global_step=0)
    a, b = torch.ones(4, 8), torch.ones(8, 16)
    recorder.on_train_begin(None, state, None)
    for generation_batch in range(3):  # 2 timed + the counted one
        for inner in range(3):
            if inner == 0:  # the sampling step scores the batch
                RECORDER.prompt_lengths, RECORDER.completion_lengths, RECORDER.rewards = [5, 6], [generation_batch + 1, 2], [0.5]
            recorder.on_step_begin(None, state, None)
            a @ b
            state.global_step += 1  # the trainer counts the step before on_step_end
            recorder.on_step_end(None, state, None)
    result = recorder.result(RunSpec(trainer="trl", model_dir="m", data_file="d", steps=2, num_iterations=3, count_matmuls=True))
    assert [record.step for record in result.steps] == [0, 1]
    assert [record.completion_lengths for record in result.steps] == [[1, 2], [2, 2]]
    assert result.matmul_flops_by_dtype == {"float32": 3 * 2 * 4 * 8 * 16}  # all 3 optimizer steps
    assert result.counted_step_completion_lengths == [3, 2]


def test_trl_phases_of_a_generation_batch_sum_its_trainer_steps():
    from bench.trainer_runs import TRLPhaseTimer

    timer = object.__new__(TRLPhaseTimer)  # without patching TRL (not installed for the tests)
    timer.spans = [
        (2, "transformers.generate", 0.0, 1.0),
        (2, "_prepare_inputs", 0.0, 1.75),
        (2, "_get_per_token_logps_and_entropies", 1.25, 1.5),  # the old log-probs, before the loss
        (2, "compute_loss", 2.0, 3.0),
        (2, "_get_per_token_logps_and_entropies", 2.0, 2.5),  # inside compute_loss: training
        (3, "_prepare_inputs", 3.0, 3.125),  # the training-only step reads the buffered batch
        (3, "compute_loss", 3.25, 4.0),
        (4, "transformers.generate", 5.0, 6.0),  # the next generation batch
    ]
    phases = timer.phases(range(2, 4))
    assert phases["generate"] == 1.0
    assert phases["logprobs"] == 0.25
    assert phases["prepare_inputs"] == 1.875
    assert phases["compute_loss"] == 1.75
