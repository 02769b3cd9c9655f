"""``python -m bench.gpu_check`` runs here at toy size (``--device cpu --shapes tiny``), so the GPU
check cannot rot before a GPU is lent: every part of its report is computed and consistent, its
log-prob comparison catches a sampler that is wrong, and its floors add up by hand. (TRL's rows run
where TRL is installed, the bench extra; elsewhere the report says in one line that it is missing.)"""

import json
import math

import pytest
import torch

from bench import gpu_check
from bench.flops import ModelShape, forward_flops
from bench.trainer_runs import even_token_fraction
from lit_grpo.rollout.engines import policy as generation

TRL_INSTALLED = gpu_check.installed("trl")


def test_gpu_check_reports_every_part_on_cpu(tmp_path):
    report = gpu_check.main(["--device", "cpu", "--shapes", "tiny", "--out", str(tmp_path), "--name", "toy"])

    assert json.loads((tmp_path / "toy.json").read_text())["shapes"] == ["tiny"]
    text = (tmp_path / "toy.md").read_text()
    assert "| tiny | 4 x 16 |" in text and "smoke test" in text
    greedy = report["samplers"]["greedy"]
    assert greedy["rows"] == 8 and greedy["rows_equal"] == 8  # float32 on the CPU: the same tokens
    logprobs = report["samplers"]["logprobs"]
    assert logprobs["lit"]["tokens"] == logprobs["transformers"]["tokens"] == 8 * 8
    assert logprobs["lit"]["like_generate"]
    assert ("vLLM is not installed: no vLLM rows." in report["notes"]) == (not gpu_check.installed("vllm"))

    fit = report["fit"]
    assert set(fit["summaries"]) == {"lit-grpo", "trl"} if TRL_INSTALLED else {"lit-grpo"}
    assert any("TRL is not installed" in note for note in report["notes"]) == (not TRL_INSTALLED)
    for label, summary in fit["summaries"].items():
        assert summary["num_steps"] == 2, label  # 2 runs x 1 timed step
        assert len(summary["losses"]) == 4 and summary["all_losses_finite"], label  # 2 runs x (warm-up + timed)
        assert summary["weights_changed"] and summary["trainable_dtypes"] == ["float32"], label
        assert summary["peak_gpu_memory_gib"] is None and summary["tokens_per_second"] > 0
        floors = summary["floors"]
        assert floors["furthest"] in ("generate", "train")
        assert floors["parts"]["train"]["floor_seconds"] > 0 and floors["floor_training_tokens_per_second"] > 0
        assert sum(part["seconds"] for part in floors["parts"].values()) == pytest.approx(summary["median_step_seconds"])
    if TRL_INSTALLED:
        assert len(fit["tokens_per_second_ratio_per_pair"]) == 2 and fit["tokens_per_second_ratio"] > 0
        assert "lit-grpo/TRL completion tokens per second" in text

    decode = report["decode"]["tiny"]
    assert decode["rows"] == 4 and decode["new_tokens"] == 16
    for key in ("lit_ms_per_step", "transformers_ms_per_step", "floor_ms_per_step"):
        assert decode[key] > 0, key
    assert report["padding_free"]["max_abs_logp_difference"] < 1e-4 and "## Padding-free forwards" in text


def test_padding_free_part_times_packed_and_padded_with_the_same_logprobs(tmp_path):
    checkpoint = gpu_check.build_checkpoint("tiny", tmp_path)
    row = gpu_check.padding_free_rows(checkpoint, "cpu")
    assert row["attn_implementation"] == "sdpa" and row["rows"] == 4
    assert row["tokens"]["packed"] < row["tokens"]["padded"]  # ragged rows: padding left out
    assert row["seconds"]["packed"] > 0 and row["seconds"]["padded"] > 0
    assert row["max_abs_logp_difference"] < 1e-4  # float32 on the CPU: the same log-probs
    lines = gpu_check.padding_free_markdown({"padding_free": row})
    assert lines[0] == "## Padding-free forwards (`model.padding_free`)" and "| packed |" in "\n".join(lines)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    checkpoint = gpu_check.build_checkpoint("tiny", tmp_path_factory.mktemp("models"))
    return gpu_check.load(checkpoint, "cpu", torch.float32)


def sampler_attending_left_padding(model, prompt_ids, prompt_mask, num_generations, config):
    """The ``lit`` sampler with the prompts' padding left unmasked: a wrong sampler."""
    return generation.SAMPLERS["lit"](model, prompt_ids, torch.ones_like(prompt_mask), num_generations, config)


def test_the_logprob_check_catches_a_wrong_sampler(tiny_model, monkeypatch):
    model, tokenizer = tiny_model
    monkeypatch.setitem(generation.SAMPLERS, "wrong", sampler_attending_left_padding)
    texts = gpu_check.prompts(8)  # of different lengths: every row but the longest has left padding
    rows = {backend: gpu_check.sampled_logprob_check(model, tokenizer, texts, 8, backend) for backend in ("lit", "transformers", "wrong")}

    assert rows["lit"]["max_abs_difference"] < 1e-4 and rows["transformers"]["max_abs_difference"] < 1e-4  # float32
    assert gpu_check.like_generate(rows["lit"], rows["transformers"])
    assert rows["wrong"]["mean_abs_difference"] > 100 * rows["lit"]["mean_abs_difference"] + 1e-3
    assert not gpu_check.like_generate(rows["wrong"], rows["transformers"])


def test_generation_floor_by_hand():
    shape = ModelShape(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=10)
    slow_copies = gpu_check.Hardware(copy_bytes_per_second=1e3, matmul_flops_per_second=1e12)
    weights = (shape.linear_weights_per_layer * 2 + 10 * 8) * 2  # bf16
    per_position = 2 * 2 * 4 * 2  # keys and values, 2 layers, 1 head of 4, bf16
    # one group of 2 rows, prompt 3: the prefill, then decode steps 1 and 2 (both rows), 3 (the longer one)
    rows = [(3, 3), (3, 4)]
    expected = weights + (weights + 2 * 4 * per_position) + (weights + 2 * 5 * per_position) + (weights + 6 * per_position)
    assert gpu_check.generation_floor_seconds(shape, rows, 2, 2, slow_copies) == pytest.approx(expected / 1e3)
    # with slow matmuls, the FLOPs set the floor instead
    slow_matmuls = gpu_check.Hardware(copy_bytes_per_second=1e15, matmul_flops_per_second=1.0)
    flops = forward_flops(shape, 3, 6, 1) + 2 * forward_flops(shape, 1, 4, 1) + 2 * forward_flops(shape, 1, 5, 1) + forward_flops(shape, 1, 6, 1)
    assert gpu_check.generation_floor_seconds(shape, rows, 2, 2, slow_matmuls) == pytest.approx(flops)


def test_step_parts_of_each_trainer():
    lit = {"seconds": 1.0, "phases": {"generate": 0.5, "rewards": 0.1, "logprobs": 0.0, "train": 0.3}}
    assert gpu_check.step_parts(lit, "lit-grpo") == pytest.approx({"generate": 0.5, "rewards": 0.1, "logprobs": 0.0, "train": 0.3, "other": 0.1})
    # TRL: training is the step less _prepare_inputs (which holds generation, rewards and the log-prob passes)
    trl = {"seconds": 2.0, "phases": {"generate": 1.2, "rewards": 0.1, "logprobs": 0.0, "prepare_inputs": 1.4, "compute_loss": 0.5}}
    parts = gpu_check.step_parts(trl, "trl")
    assert parts == pytest.approx({"generate": 1.2, "rewards": 0.1, "logprobs": 0.0, "train": 0.6, "other": 0.1})
    assert math.fsum(parts.values()) == pytest.approx(2.0)


def test_even_token_fraction_by_hand():
    assert even_token_fraction([[2, 4, 5], []]) == [2 / 3, 0.0]
