"""What ``lit_grpo.cpu.attention`` and the sampler's cast-once weights buy under bf16 autocast on the CPU.

    python -m bench.attention --threads 1

1. One decode step's attention (one query token) at the 4M model's shapes (64 rows, 4 query heads
   on 2 key/value heads, head_dim 64) for several cache lengths: PyTorch's SDPA against
   ``cpu_half_attention``, float32 and bf16.
2. A training forward's attention, forward and forward + backward, at the shapes of a GRPO
   micro-batch chunk (rows x tokens, causal, left padding), bf16
   autocast as under ``bf16-mixed`` (float32 SDPA beside it for contrast).
3. A whole generation batch of the group sampler on the benchmark models (``--sizes``) under
   Lightning's ``bf16-mixed`` autocast (which caches no weight casts): 8 prompts x G = 8, every
   completion exactly ``--length`` tokens; as shipped, with SDPA attention, with weights cast at
   every token, and with the KV cache handed to attention as views of its filled positions (the
   layout used off the CPU and in float32) instead of whole buffers grown by blocks, alternating.

Writes ``bench/results/attention.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import (
    QUICKSTART_DATA,
    build_models,
    command_line,
    machine_description,
    markdown_table,
    write_outputs,
)


def median_seconds(function, repeats: int) -> float:
    function()  # warm-up (oneDNN primitives, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


MODULE = argparse.Namespace(num_key_value_groups=2, is_causal=True)  # 4 query heads on 2 key/value heads


def decode_rows(repeats: int) -> list[dict]:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lit_grpo.cpu.attention import cpu_half_attention

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for cache_length in (32, 128, 256, 640):
            query = torch.randn(64, 4, 1, 64, dtype=dtype)
            key, value = (torch.randn(64, 2, cache_length, 64, dtype=dtype) for _ in range(2))
            mask = torch.ones(64, 1, 1, cache_length, dtype=torch.bool)
            mask[::2, :, :, :5] = False  # left padding on half the rows
            sdpa = median_seconds(lambda: sdpa_attention_forward(MODULE, query, key, value, mask, scaling=0.125), repeats)
            ours = median_seconds(lambda: cpu_half_attention(MODULE, query, key, value, mask, scaling=0.125), repeats)
            rows.append({
                "dtype": str(dtype).removeprefix("torch."), "cache_length": cache_length,
                "sdpa_ms": sdpa * 1e3, "ours_ms": ours * 1e3, "speedup": sdpa / ours,
            })
    return rows


def training_rows(repeats: int) -> list[dict]:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lit_grpo.cpu.attention import cpu_half_attention

    rows = []
    for n, length in ((64, 38), (30, 134), (16, 254)):
        mask = torch.ones(n, 1, length, length, dtype=torch.bool).tril()
        mask[::2, :, :, :4] = False  # left padding on half the rows
        # float32 leaves, as the rotary embedding hands them over under autocast
        query = torch.randn(n, 4, length, 64, requires_grad=True)
        key, value = (torch.randn(n, 2, length, 64, requires_grad=True) for _ in range(2))

        def run(function, bf16: bool, backward: bool):
            def call():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    output, _ = function(MODULE, query, key, value, mask, scaling=0.125)
                if backward:
                    output.float().sum().backward()
            return median_seconds(call, repeats) * 1e3

        row = {"rows": n, "tokens": length}
        for name, function, bf16 in (("sdpa_fp32", sdpa_attention_forward, False), ("sdpa_bf16", sdpa_attention_forward, True), ("ours_bf16", cpu_half_attention, True)):
            row[f"{name}_forward_ms"] = run(function, bf16, backward=False)
            row[f"{name}_forward_backward_ms"] = run(function, bf16, backward=True)
        row["speedup"] = row["sdpa_bf16_forward_backward_ms"] / row["ours_bf16_forward_backward_ms"]
        rows.append(row)
    return rows


def sampler_rows(size: str, model_dir: str, length: int, repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import lit_grpo.cpu as cpu
    import lit_grpo.rollout.engines.policy as generation

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in QUICKSTART_DATA.read_text().splitlines()[:8]]
    config = GenerationConfig(
        max_new_tokens=length, min_new_tokens=length, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    # (module, attribute) -> what each variant puts there instead of the shipped function
    shipped = {
        (cpu, "use_cpu_half_attention"): cpu.use_cpu_half_attention,
        (generation, "weights_cast_once"): generation.weights_cast_once,
        (cpu, "kv_cache_block"): cpu.kv_cache_block,
    }
    off = lambda *args: contextlib.nullcontext()  # noqa: E731
    variants = {
        "as shipped": {},
        "SDPA attention": {(cpu, "use_cpu_half_attention"): off},
        "weights cast every token": {(generation, "weights_cast_once"): off},
        "KV cache as views of the filled positions": {(cpu, "kv_cache_block"): lambda model, device: None},
    }
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, replaced in variants.items():
            for (module, attribute), value in {**shipped, **replaced}.items():
                setattr(module, attribute, value)
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # as Lightning's bf16-mixed
                    times[name].append(median_seconds(lambda: generation.generate_completions(model, tokenizer, prompts, 8, config), 1))
            finally:
                for (module, attribute), value in shipped.items():
                    setattr(module, attribute, value)
    shipped_s = statistics.median(times["as shipped"])
    return [
        {"size": size, "variant": name, "length": length, "seconds": statistics.median(ts), "shipped_speedup": statistics.median(ts) / shipped_s}
        for name, ts in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--length", type=int, default=128, help="completion length of the sampler runs")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant of the sampler (attention: at least 10 calls)")
    parser.add_argument("--sizes", nargs="+", default=["4M"], choices=["4M", "30M"], help="models of the sampler runs")
    parser.add_argument("--name", default="attention")
    args = parser.parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        models = build_models(args.sizes, Path(directory))
        decode = decode_rows(max(args.repeats, 20))
        training = training_rows(max(args.repeats, 10))
        sampler = [row for size in args.sizes for row in sampler_rows(size, models[size].path, args.length, args.repeats)]
    machine = machine_description()
    command = command_line("attention", None)
    markdown = "\n\n".join([
        "# Attention on the CPU in bf16: PyTorch's SDPA against grouped matrix products", f"`{command}`",
        f"Machine: {machine['cpu']}, {torch.get_num_threads()} torch threads. 4M model shapes: 4 query heads on 2 key/value heads, head_dim 64.",
        "One decode step's attention, 64 rows (median ms):",
        markdown_table(
            ["dtype", "cache length", "SDPA ms", "cpu_half_attention ms", "speedup"],
            [[r["dtype"], str(r["cache_length"]), f"{r['sdpa_ms']:.2f}", f"{r['ours_ms']:.2f}", f"{r['speedup']:.2f}"] for r in decode],
        ),
        "A training forward's attention, causal with left padding (median ms; float32 leaves under bf16 autocast; the float32 SDPA column without autocast):",
        markdown_table(
            ["rows x tokens", "SDPA fp32 fwd", "SDPA fp32 fwd+bwd", "SDPA bf16 fwd", "SDPA bf16 fwd+bwd", "ours bf16 fwd", "ours bf16 fwd+bwd", "bf16 fwd+bwd speedup"],
            [[f"{r['rows']} x {r['tokens']}"] + [f"{r[k]:.2f}" for k in (
                "sdpa_fp32_forward_ms", "sdpa_fp32_forward_backward_ms", "sdpa_bf16_forward_ms", "sdpa_bf16_forward_backward_ms",
                "ours_bf16_forward_ms", "ours_bf16_forward_backward_ms")] + [f"{r['speedup']:.2f}"] for r in training],
        ),
        f"A whole generation batch of the group sampler under Lightning's bf16 autocast (8 prompts x G 8, {args.length} tokens each; "
        f"median s over {args.repeats} runs per variant, alternating):",
        markdown_table(
            ["model", "variant", "seconds", "seconds / as shipped"],
            [[r["size"], r["variant"], f"{r['seconds']:.2f}", f"{r['shipped_speedup']:.2f}"] for r in sampler],
        ),
    ])
    md, js = write_outputs(args.name, markdown + "\n", {"command": command, "machine": machine, "decode": decode, "training": training, "sampler": sampler})
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
