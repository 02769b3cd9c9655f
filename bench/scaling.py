"""How the cost of a GRPO step grows with G, completion length and model size: lit-grpo beside TRL.

Same identical-work setup as ``bench/compare_trl.py`` (quickstart prompts and reward, 8 prompts per
step, dapo, beta 0, one optimizer step per generation batch), but by default every completion is
exactly ``max_completion_length`` tokens (EOS suppressed on both trainers), so the work of a step is
exactly ``8 * G * L`` sampled tokens and the rows compare like with like; ``--stop-at-eos`` samples
normally instead (a random model then stops after ~100 tokens on average, which hides the growth
with L).

By default one axis varies at a time around 4M parameters, G = 8, L = 128:
G in (4, 8, 16); L in (32, 128, 512); model 4M and 30M. ``--full`` runs the whole grid
(every size x G x L, 18 configurations: much longer, mainly because of 30M at L = 512).

    python -m bench.scaling                        # the one-axis-at-a-time subset
    python -m bench.scaling --full --precision bf16
    python -m bench.scaling --sizes 4M --generations 4 8 --lengths 32 --steps 1   # a quick check

Writes ``bench/results/scaling.md`` and ``.json`` (``--name`` changes the file name).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.harness import (
    QUICKSTART_DATA,
    RunSpec,
    add_contention_options,
    build_models,
    command_line,
    fmt,
    load_line,
    machine_description,
    markdown_table,
    matmul_rates,
    per_pair_ratios,
    run_measured,
    summarize_runs,
    write_outputs,
)

BASE = {"size": "4M", "num_generations": 8, "max_completion_length": 128}
AXES = {"size": ["4M", "30M"], "num_generations": [4, 8, 16], "max_completion_length": [32, 128, 512]}


def grid(axes: dict[str, list], full: bool) -> list[dict]:
    """Configurations as dicts with the keys of ``axes``: the full product, or one axis at a time
    around ``BASE`` (a base value missing from its axis is replaced by the axis' first value)."""
    if full:
        return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    base = {axis: BASE[axis] if BASE[axis] in values else values[0] for axis, values in axes.items()}
    points = []
    for axis, values in axes.items():
        for value in values:
            point = dict(base, **{axis: value})
            if point not in points:
                points.append(point)
    return points


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every size x G x L instead of one axis at a time")
    parser.add_argument("--sizes", nargs="+", default=AXES["size"], choices=AXES["size"])
    parser.add_argument("--generations", nargs="+", type=int, default=AXES["num_generations"], help="values of G")
    parser.add_argument("--lengths", nargs="+", type=int, default=AXES["max_completion_length"], help="values of L")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--stop-at-eos", action="store_true", help="sample normally instead of exactly L tokens")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of every run")
    parser.add_argument("--repeats", type=int, default=1, help="lit-grpo/TRL pairs per configuration")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    add_contention_options(parser)
    parser.add_argument("--name", default="scaling", help="output file name in bench/results/")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("scaling", argv)
    machine_before = machine_description()
    axes = {"size": args.sizes, "num_generations": args.generations, "max_completion_length": args.lengths}
    points = grid(axes, args.full)
    sizes = sorted({p["size"] for p in points}, key=["4M", "30M"].index)
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lit-grpo-bench-") as tmp:
        models = build_models(sizes, Path(tmp))
        rates = {name: matmul_rates(models[name].shape, 64, 128, args.threads)[args.precision]["best"] for name in sizes}
        for index, point in enumerate(points):
            model = models[point["size"]]
            runs: dict[str, list[dict]] = {"lit-grpo": [], "trl": []}
            for _ in range(args.repeats):
                for trainer in ("lit-grpo", "trl"):
                    spec = RunSpec(
                        trainer=trainer,
                        model_dir=model.path,
                        data_file=str(QUICKSTART_DATA),
                        steps=args.warmup + args.steps,
                        num_generations=point["num_generations"],
                        max_completion_length=point["max_completion_length"],
                        fixed_length=not args.stop_at_eos,
                        precision=args.precision,
                        learning_rate=args.learning_rate,
                        threads=args.threads,
                    )
                    runs[trainer].append(
                        run_measured(spec, args.warmup, args.quiet_wait, args.retries, args.min_cpu_share)
                    )
                    print(f"[{index + 1}/{len(points)} {(time.perf_counter() - start) / 60:5.1f} min] {point} {trainer}",
                          file=sys.stderr, flush=True)
            summaries = {t: summarize_runs(runs[t], args.warmup, model.shape, rates[point["size"]]) for t in runs}
            ratios = per_pair_ratios(runs["lit-grpo"], runs["trl"], args.warmup)
            rows.append(
                {
                    **point,
                    "num_parameters": model.num_parameters,
                    "summaries": summaries,
                    "tokens_per_second_ratio": statistics.median(ratios),
                    "runs": runs,
                }
            )
    machine_after = machine_description()

    header = ["model", "G", "L", "tok/step", "lit-grpo s/step", "TRL s/step", "lit/TRL tok/s",
              "lit-grpo peak MiB", "TRL peak MiB", "floor s"]
    table = []
    for row in rows:
        lit, trl = row["summaries"]["lit-grpo"], row["summaries"]["trl"]
        table.append(
            [
                f"{row['size']} ({row['num_parameters'] / 1e6:.1f}M)",
                str(row["num_generations"]),
                str(row["max_completion_length"]),
                fmt(lit["tokens_per_step"], 0),
                fmt(lit["median_step_seconds"]),
                fmt(trl["median_step_seconds"]),
                fmt(row["tokens_per_second_ratio"]),
                fmt(lit["peak_rss_mib"], 0),
                fmt(trl["peak_rss_mib"], 0),
                fmt(lit["median_floor_seconds"], 3),
            ]
        )
    threads = rows[0]["summaries"]["lit-grpo"]["torch_threads"] if rows else "?"
    length_rule = "sampling stops at EOS" if args.stop_at_eos else "every completion exactly L tokens (EOS suppressed)"
    markdown = "\n".join(
        [
            "# Scaling: seconds per step against G, completion length L and model size",
            "",
            f"`{command}`",
            "",
            f"Machine: {machine_before['cpu']}, {machine_before['cores']} cores, {threads} torch threads per run; "
            f"{load_line(machine_before)} before, {load_line(machine_after)} after. {args.precision}, beta 0, "
            f"8 prompts per step, {length_rule}; {args.warmup} warm-up + {args.steps} timed steps per run, "
            f"{args.repeats} pair(s). `floor s`: matmul FLOPs of the step / best measured {args.precision} matmul rate.",
            "",
            markdown_table(header, table),
            "",
        ]
    )
    data = {
        "command": command,
        "machine_before": machine_before,
        "machine_after": machine_after,
        "models": {name: {"num_parameters": m.num_parameters, "shape": asdict(m.shape)} for name, m in models.items()},
        "matmul_rate_flops_per_second": rates,
        "rows": rows,
    }
    md_path, json_path = write_outputs(args.name, markdown, data)
    print(markdown)
    print(f"wrote {md_path} and {json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
