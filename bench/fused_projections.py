"""Would fusing a decoder layer's projections pay off? Separate matrix products against one fused one.

    python -m bench.fused_projections --threads 1

A Llama layer multiplies the same input by three weights for the query, key and value projections,
and by two for the MLP's gate and up projections. Fused, each group is one product with the weights
stacked (``[q; k; v]``, ``[gate; up]``) and the output split afterwards: fewer, larger calls, one read
of the input. This measures whether that is faster on this machine, at the bench models' shapes
(``harness.MODEL_SIZES``), with 64 rows (a decode step of 8 prompts x G 8) and 1024 rows (a training
chunk at the default token budget), in float32 and in bf16 operands (what the products see under
``bf16-mixed`` once the weights are cast). Each variant is timed ``--repeats`` times, alternating
with the other, and the median kept. Forward products only: the backward's products have the same
shapes transposed.

Writes ``bench/results/<name>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import statistics

from bench.flops import calls_lasting, seconds_per_call
from bench.harness import MODEL_SIZES, command_line, machine_description, markdown_table, write_outputs


def projection_groups(size: str) -> dict[str, list[int]]:
    """Output widths of the projections that read the same input: {group name: [width, ...]}."""
    shape = MODEL_SIZES[size]
    head_dim = shape.hidden_size // shape.num_attention_heads
    key_value_width = shape.num_key_value_heads * head_dim
    return {
        "q, k, v": [shape.hidden_size, key_value_width, key_value_width],
        "gate, up": [shape.intermediate_size, shape.intermediate_size],
    }


def measure(size: str, dtype_name: str, rows: int, repeats: int, min_seconds: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    hidden = MODEL_SIZES[size].hidden_size
    inputs = torch.randn(rows, hidden).to(dtype)  # [rows, hidden]
    results = []
    for group, widths in projection_groups(size).items():
        weights = [torch.randn(width, hidden).to(dtype) for width in widths]  # [width, hidden] each
        fused_weight = torch.cat(weights)  # [sum(widths), hidden]

        def separate():
            return [F.linear(inputs, weight) for weight in weights]

        def fused():
            return F.linear(inputs, fused_weight).split(widths, dim=-1)

        for out_separate, out_fused in zip(separate(), fused()):  # the same products, rounded alike
            torch.testing.assert_close(out_fused, out_separate, rtol=2e-2, atol=2e-2)
        variants = {"separate": separate, "fused": fused}  # each called above: oneDNN has picked its kernels
        calls = {name: calls_lasting(function, min_seconds) for name, function in variants.items()}
        timings = {name: [] for name in variants}
        for _ in range(repeats):
            for name, function in variants.items():
                timings[name].append(seconds_per_call(function, calls[name]))
        separate_ms = statistics.median(timings["separate"]) * 1e3
        fused_ms = statistics.median(timings["fused"]) * 1e3
        results.append({
            "size": size, "dtype": dtype_name, "rows": rows, "group": group, "widths": widths,
            "separate_ms": separate_ms, "fused_ms": fused_ms, "speedup": separate_ms / fused_ms,
            "separate_ms_all": [t * 1e3 for t in timings["separate"]], "fused_ms_all": [t * 1e3 for t in timings["fused"]],
        })
        print(f"{size} {dtype_name} {rows} rows, {group}: separate {separate_ms:.3f} ms, fused {fused_ms:.3f} ms "
              f"({separate_ms / fused_ms:.2f}x)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--sizes", nargs="+", default=["4M", "30M"], choices=["4M", "30M"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 1024], help="rows of the input")
    parser.add_argument("--repeats", type=int, default=5, help="timings per variant, alternating")
    parser.add_argument("--min-seconds", type=float, default=0.1, help="length of one timing loop")
    parser.add_argument("--name", default="fused_projections")
    args = parser.parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = [
        result
        for size in args.sizes for dtype_name in args.dtypes for rows in args.rows
        for result in measure(size, dtype_name, rows, args.repeats, args.min_seconds)
    ]
    machine = machine_description()
    command = command_line("fused_projections", None)
    markdown = "\n\n".join([
        "# Separate against fused projections", f"`{command}`",
        f"Machine: {machine['cpu']}, {torch.get_num_threads()} torch threads, oneDNN bf16 kernels: "
        f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}. Median ms over {args.repeats} alternating timings; "
        "`speedup` = separate / fused (above 1: fusing pays).",
        markdown_table(
            ["model", "dtype", "rows", "projections", "separate ms", "fused ms", "speedup"],
            [[r["size"], r["dtype"], str(r["rows"]), r["group"], f"{r['separate_ms']:.3f}", f"{r['fused_ms']:.3f}",
              f"{r['speedup']:.2f}"] for r in results],
        ),
    ])
    md, js = write_outputs(args.name, markdown + "\n", {"command": command, "machine": machine, "results": results})
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
