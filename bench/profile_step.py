"""Where one GRPO step's time goes, by operator: lit-grpo and TRL on the same work.

Same identical-work setup as ``bench/compare_trl.py`` (quickstart prompts and reward, G = 8, 8 prompts
per step, dapo, one optimizer step per generation batch). Each trainer runs in its own process:
warm-up steps, timed steps, then one extra step in which every ATen operator call is timed
(``trainer_runs.OpTimer``, below autograd and autocast: the kernels that really run, the backward
pass's included). That step's wall time is split into

* **matrix products**: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` and SDPA's CPU kernels, beside the
  step's matmul floor (``bench/flops.py``): what the hardware's matmul rate allows for the FLOPs the
  step needs;
* **copies and casts**: ``copy_`` (autocast's dtype casts land here), ``_to_copy``, ``clone``,
  ``cat``, ``index``;
* **other operators**: every other ATen operator (elementwise, norms, softmax, reductions, sampling,
  the optimizer);
* **outside operators**: the rest of the wall time: Python, Lightning / the Hugging Face Trainer, and
  the dispatcher above the kernels (autograd, autocast);
* **timer overhead**: the timer's own cost, measured per call on a cheap operator before the step,
  times the number of calls.

The profiled step is slower than the timed ones (both are shown): the timer overhead column is a
lower bound of the timer's cost (calls with many arguments cost it more than the cheap calibration
call), and each operator's time includes a little of it, so the many small operators (copies,
elementwise) read somewhat high; matrix products, few and long calls, are measured accurately. The
split says where a step's time goes, the timed steps how long it takes. Minor page faults (fresh
memory touched for the first time) are counted in both: the operators that touch fresh pages
(allocations, mostly copies) pay for them.

    python -m bench.profile_step --threads 1 --size 30M --length 32 --precision bf16
    python -m bench.profile_step --threads 1 --size 4M --length 128 --fixed-length --trainers lit-grpo

Writes ``bench/results/profile_step.md`` and ``.json`` (``--name`` changes the file name).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import (
    TRAINERS,
    add_contention_options,
    add_work_options,
    build_models,
    command_line,
    fmt,
    load_line,
    machine_description,
    markdown_table,
    matmul_rates,
    run_measured,
    step_flops,
    summarize_runs,
    work_label,
    work_spec,
    write_outputs,
)
from bench.trainer_runs import OP_CATEGORIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_work_options(parser, length=32, precision="bf16")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (before the profiled one)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of every run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--top", type=int, default=12, help="operators listed per trainer")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    add_contention_options(parser)
    parser.add_argument("--name", default="profile_step", help="output file name in bench/results/")
    return parser.parse_args(argv)


def split_table(profiles: dict[str, dict], summaries: dict[str, dict], floor_seconds: dict[str, float]) -> str:
    """One row per trainer: the profiled step's seconds by category, and the share of its wall time."""
    header = ["trainer", "timed s/step", "profiled step s", "page faults timed / profiled", "matmul floor s",
              *(f"{category} s (%)" for category in OP_CATEGORIES)]
    table = []
    for trainer, profile in profiles.items():
        wall = profile["wall_seconds"]
        table.append(
            [
                trainer,
                fmt(summaries[trainer]["median_step_seconds"]),
                fmt(wall),
                f"{fmt(summaries[trainer]['median_minor_faults'], 0)} / {profile['minor_faults']}",
                fmt(floor_seconds[trainer]),
                *(
                    f"{fmt(profile['seconds_by_category'][category])} ({100 * profile['seconds_by_category'][category] / wall:.0f})"
                    for category in OP_CATEGORIES
                ),
            ]
        )
    return markdown_table(header, table)


def top_ops_table(profile: dict, top: int) -> str:
    wall = profile["wall_seconds"]
    rows = [
        [op["name"], fmt(op["seconds"], 3), f"{100 * op['seconds'] / wall:.1f}", str(op["calls"])]
        for op in profile["top_ops"][:top]
    ]
    return markdown_table(["operator", "s", "% of step", "calls"], rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("profile_step", argv)
    machine_before = machine_description()
    runs, summaries, profiles, floors = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="lit-grpo-bench-") as tmp:
        model = build_models([args.size], Path(tmp))[args.size]
        rate = matmul_rates(model.shape, 64, args.length, args.threads)[args.precision]["best"]
        for trainer in args.trainers:
            spec = work_spec(args, trainer, model.path, Path(tmp), args.warmup + args.steps, threads=args.threads, profile_ops=True)
            start = time.perf_counter()
            runs[trainer] = run_measured(spec, args.warmup, args.quiet_wait, args.retries, args.min_cpu_share)
            print(f"[{(time.perf_counter() - start) / 60:5.1f} min] {trainer}", file=sys.stderr, flush=True)
            summaries[trainer] = summarize_runs([runs[trainer]], args.warmup, model.shape, rate)
            profiles[trainer] = runs[trainer]["op_profile"]
            floors[trainer] = step_flops(model.shape, profiles[trainer], dataclasses.asdict(spec)).total / rate
    machine_after = machine_description()

    config = work_label(args)
    out = [
        "# Where a step's time goes, by operator",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine_before['cpu']}, {machine_before['cores']} cores, {args.threads or 'default'} torch threads "
        f"per run; {load_line(machine_before)} before, {load_line(machine_after)} after. {config}; G 8, 8 prompts "
        f"per step; {args.warmup} warm-up + {args.steps} timed steps, then one step with every operator timed. "
        f"Matmul floor: the profiled step's matmul FLOPs (`bench/flops.py`) at {rate / 1e9:.0f} GFLOP/s, this "
        "machine's best measured rate. Categories: see `bench/profile_step.py`; `%` is of the profiled step's wall time.",
        "",
        split_table(profiles, summaries, floors),
        "",
    ]
    for trainer, profile in profiles.items():
        phases = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in sorted(profile["phases"].items()))
        out += [f"## {trainer}: the {args.top} operators with the most time", ""]
        out += [f"Phases of the profiled step: {phases}.", ""] if phases else []
        out += [top_ops_table(profile, args.top), ""]
    markdown = "\n".join(out)
    data = {
        "command": command,
        "machine_before": machine_before,
        "machine_after": machine_after,
        "matmul_rate_flops_per_second": rate,
        "floor_seconds": floors,
        "summaries": summaries,
        "runs": runs,
    }
    md_path, json_path = write_outputs(args.name, markdown, data)
    print(markdown)
    print(f"\nwrote {md_path} and {json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
