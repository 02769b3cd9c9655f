"""bench/trainer_runs.py's extra, untimed steps: the matmul counter and the operator profiler
(bench/profile_step.py), and how a profiled step's time is split."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from trainer_runs import RECORDER, RecordingCallback, RunSpec, split_step_time  # noqa: E402


def test_a_profiled_step_is_split_into_matmuls_copies_other_operators_and_the_rest():
    ops = [
        ("aten::mm", 0.30, 10),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", 0.10, 2),
        ("aten::copy_", 0.08, 40),
        ("aten::_to_copy", 0.02, 40),
        ("aten::mul", 0.15, 30),
        ("aten::softmax", 0.05, 2),
        ("ProfilerStep#4", 0.04, 1),  # a profiler range, not an operator: its self time is Python
        ("autograd::engine::evaluate_function: MmBackward0", 0.01, 5),
    ]
    split = split_step_time(1.0, ops, top=3)
    assert split["seconds_by_category"] == pytest.approx(
        {"matrix products": 0.40, "copies and casts": 0.10, "other operators": 0.20, "outside operators": 0.30}
    )
    assert [op["name"] for op in split["top_ops"]] == ["aten::mm", "aten::mul", "aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert split["top_ops"][0] == {"name": "aten::mm", "self_seconds": 0.30, "calls": 10}


def test_the_timed_steps_come_first_then_the_counted_step_then_the_profiled_one(monkeypatch):
    recorder = RecordingCallback(recorded_steps=2, count_matmuls=True, profile_ops=True)
    assert recorder.extra_steps == 2  # the trainer runs 2 + 2 steps
    a, b = torch.ones(4, 8), torch.ones(8, 16)
    work = [
        lambda: a @ b,
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
    assert result.matmul_flops_by_dtype == {"float32": 2 * 4 * 8 * 16}
    assert result.counted_step_completion_lengths == [3, 4]
    profile = result.op_profile
    names = {op["name"] for op in profile["top_ops"]}
    assert "aten::bmm" in names and "aten::mm" not in names  # only the last step was profiled
    assert profile["completion_lengths"] == [4, 5] and profile["prompt_lengths"] == [5, 6]
    assert profile["phases"] == {"generate": 0.25}
    assert profile["seconds_by_category"]["matrix products"] > 0
    assert sum(profile["seconds_by_category"].values()) == pytest.approx(profile["wall_seconds"])


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
