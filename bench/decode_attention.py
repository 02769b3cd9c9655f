"""What the group sampler's decode attention buys: PyTorch's SDPA kernel against
``lit_grpo.generation.decode_attention`` for one-token queries, and a whole generation batch of the
group sampler with each.

    python bench/decode_attention.py --threads 1

1. The attention of one decode step alone at the 4M model's shapes (64 rows, 4 query heads on 2
   key/value heads, head_dim 64) for several cache lengths, float32 and bf16.
2. ``sample_groups`` on the 4M benchmark model under bf16 autocast (and in float32 for contrast):
   8 prompts x G = 8, every completion exactly ``--length`` tokens, with the decode attention and
   with plain SDPA for every step (``fast_decode_attention`` replaced by a no-op), alternating.

Writes ``bench/results/decode_attention.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import QUICKSTART_DATA, build_models, machine_description, markdown_table, write_outputs  # noqa: E402


def median_seconds(function, repeats: int) -> float:
    function()  # warm-up (oneDNN primitives, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_rows(repeats: int) -> list[dict]:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lit_grpo.generation import decode_attention

    module = argparse.Namespace(num_key_value_groups=2, is_causal=True)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for cache_length in (32, 128, 256, 640):
            query = torch.randn(64, 4, 1, 64, dtype=dtype)
            key, value = (torch.randn(64, 2, cache_length, 64, dtype=dtype) for _ in range(2))
            mask = torch.ones(64, 1, 1, cache_length, dtype=torch.bool)
            mask[::2, :, :, :5] = False  # left padding on half the rows
            sdpa = median_seconds(lambda: sdpa_attention_forward(module, query, key, value, mask, scaling=0.125), repeats)
            ours = median_seconds(lambda: decode_attention(module, query, key, value, mask, scaling=0.125), repeats)
            rows.append({
                "dtype": str(dtype).removeprefix("torch."), "cache_length": cache_length,
                "sdpa_ms": sdpa * 1e3, "decode_attention_ms": ours * 1e3, "speedup": sdpa / ours,
            })
    return rows


def sampler_rows(model_dir: str, length: int, repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import lit_grpo.generation as generation

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in QUICKSTART_DATA.read_text().splitlines()[:8]]
    config = GenerationConfig(
        max_new_tokens=length, min_new_tokens=length, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    real = generation.fast_decode_attention
    rows = []
    for precision in ("bf16", "fp32"):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        times = {"decode attention": [], "SDPA": []}
        for _ in range(repeats):
            for name, context in (("decode attention", real), ("SDPA", lambda model: contextlib.nullcontext())):
                generation.fast_decode_attention = context
                try:
                    with autocast:
                        times[name].append(median_seconds(
                            lambda: generation.generate_completions(model, tokenizer, prompts, 8, config), 1
                        ))
                finally:
                    generation.fast_decode_attention = real
        sdpa, ours = statistics.median(times["SDPA"]), statistics.median(times["decode attention"])
        rows.append({"precision": precision, "length": length, "sdpa_s": sdpa, "decode_attention_s": ours, "speedup": sdpa / ours})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--length", type=int, default=128, help="completion length of the sampler runs")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (attention) / runs per variant (sampler)")
    parser.add_argument("--name", default="decode_attention")
    args = parser.parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        model = build_models(["4M"], Path(directory))["4M"]
        attention = attention_rows(max(args.repeats, 20))
        sampler = sampler_rows(model.path, args.length, args.repeats)
    machine = machine_description()
    command = "python bench/decode_attention.py " + " ".join(sys.argv[1:])
    markdown = "\n\n".join([
        "# Decode attention: PyTorch's SDPA against grouped matrix products", f"`{command}`",
        f"Machine: {machine['cpu']}, {torch.get_num_threads()} torch threads. 4M model shapes: 64 rows, 4 query heads on 2 key/value heads, head_dim 64.",
        "One decode step's attention (median ms):",
        markdown_table(
            ["dtype", "cache length", "SDPA ms", "decode_attention ms", "speedup"],
            [[r["dtype"], str(r["cache_length"]), f"{r['sdpa_ms']:.2f}", f"{r['decode_attention_ms']:.2f}", f"{r['speedup']:.2f}"] for r in attention],
        ),
        f"A whole generation batch of the group sampler (8 prompts x G 8, {args.length} tokens each; median s over {args.repeats} runs per variant, alternating; "
        "float32 takes SDPA either way, as decode_attention leaves full precision to it):",
        markdown_table(
            ["precision", "SDPA s", "decode attention s", "speedup"],
            [[r["precision"], f"{r['sdpa_s']:.2f}", f"{r['decode_attention_s']:.2f}", f"{r['speedup']:.2f}"] for r in sampler],
        ),
    ])
    md, js = write_outputs(args.name, markdown + "\n", {"command": command, "machine": machine, "attention": attention, "sampler": sampler})
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
