"""``bench/gpu_check.py``'s fused-head part (issue 53 leftover): on CUDA it compares the fused LM head in
bf16 with the full bf16 logits, each against float32, and counts the weight-gradient products that took
``add_product_in_float32``'s CUDA branch (``addmm(out_dtype=float32)``, never run before a GPU is lent).
Here, on the CPU: skipped by default, and its mechanics at toy size."""

from bench import gpu_check


def test_the_fused_head_part_is_skipped_without_cuda():
    assert gpu_check.fused_head_bf16_check("cpu") == {"skipped": "no CUDA"}


def test_the_fused_head_part_compares_both_bf16_paths_with_float32_on_the_cpu():
    row = gpu_check.fused_head_bf16_check("cpu", tokens=64, hidden_size=32, vocab_size=1000, tile_tokens=16, cuda_only=False)
    assert row["add_product_calls"] == 64 // 16  # one weight-gradient product per tile: the custom backward ran
    assert row["add_product_cuda_bf16_branch"] == 0  # off CUDA: the float32 copies' branch
    errors = row["relative_error_to_float32"]
    for label in ("full_bf16", "fused_bf16"):
        assert set(errors[label]) == {"logps", "entropy", "grad_hidden", "grad_weight"}
        for name, error in errors[label].items():
            assert 0 < error < 0.05, (label, name, error)  # bf16's rounding: not zero, not wrong
    assert row["fused_within_full"]
    assert row["max_abs_logp_difference_fused_full"] < 0.1
