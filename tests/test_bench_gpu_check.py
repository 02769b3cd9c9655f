"""``python -m bench.gpu_check`` runs here at toy size (``--device cpu --shapes tiny``), so the GPU
check cannot rot before a GPU is lent: every part of its report is computed and consistent."""

import json

from bench import gpu_check


def test_gpu_check_reports_every_part_on_cpu(tmp_path):
    report = gpu_check.main(["--device", "cpu", "--shapes", "tiny", "--out", str(tmp_path)])

    assert json.loads((tmp_path / "gpu_check_cpu.json").read_text())["shapes"] == ["tiny"]
    assert "| tiny | 4 x 16 |" in (tmp_path / "gpu_check_cpu.md").read_text()
    greedy = report["greedy"]
    assert greedy["rows"] == 8 and greedy["rows_equal"] == 8  # float32 on the CPU: the same tokens
    fit = report["fit"]
    assert fit["steps"] == 2 and fit["all_losses_finite"] and fit["weights_changed"]
    assert fit["trainable_dtypes"] == ["torch.float32"]
    assert 0 < fit["training_tokens_per_second"] and 0 < fit["floor_tokens_per_second"]
    decode = report["decode"]["tiny"]
    assert decode["rows"] == 4 and decode["new_tokens"] == 16
    for key in ("lit_ms_per_step", "transformers_ms_per_step", "floor_ms_per_step"):
        assert decode[key] > 0, key
    # the floor is the weights plus the KV cache over the measured bandwidth
    expected = (decode["weight_gib"] + decode["mean_kv_cache_gib"]) * 2**30 / (report["copy_bandwidth_gbs"] * 1e9) * 1000
    assert abs(decode["floor_ms_per_step"] - expected) < 1e-6 * expected


def test_even_token_fraction_by_hand():
    assert gpu_check.even_token_fraction(["", ""], [[2, 4, 5], []]) == [2 / 3, 0.0]
