"""lit-grpo against TRL 1.16's ``GRPOTrainer`` on identical work, with each figure's compute floor.

Identical work: the same tiny Llama weights (built offline, two sizes), the quickstart prompts
(``configs/data/quickstart.jsonl``) and reward (``char_fraction`` with the ``target`` column), G = 8
completions for each of 8 prompts per step, the same ``max_completion_length``, sampling at
temperature 1.0, loss ``dapo``, ``num_iterations`` 1 (``--num-iterations``: optimizer steps on
each generation batch), each optimizer step on the whole generation batch (TRL:
``per_device_train_batch_size`` 64 completions, ``gradient_accumulation_steps`` 1,
``steps_per_generation`` 1; lit-grpo: ``micro_batch_size`` null), fused AdamW with the same learning
rate and no weight decay, a constant learning rate, gradient clipping at 1.0, no gradient
checkpointing. bf16 means autocast with float32 weights on both (lit-grpo ``precision:
bf16-mixed``; TRL ``bf16=True, use_cpu=True``).

For each configuration the trainers alternate (lit-grpo, TRL, lit-grpo, TRL, ... for ``--repeats``
pairs), each run in its own process. The first ``--warmup`` steps of every run are not timed.
A *step* is one generation batch: sampling, scoring and its ``num_iterations`` optimizer steps (with
``num_iterations`` 2, TRL's trainer steps alternate between one that samples and one that trains
again on the buffered batch; the pair is one step here). Reported per trainer: the median seconds
per step, completion tokens per second (real generated tokens, EOS included, over the summed step
time), peak RSS of the process, the compute floor (``bench/flops.py``: matmul FLOPs the step needs /
this machine's best measured matmul rate at that precision) and the time split. ``lit/TRL`` is
lit-grpo's tokens per second over TRL's (above 1: lit-grpo is faster), the median over the pairs.

The first pair of each configuration also runs one extra, untimed step under a matmul counter
(``bench/trainer_runs.py``): the FLOPs each trainer really executes, by dtype, which shows whether
bf16 really multiplies in bf16.

    python -m bench.compare_trl                       # the full matrix (about 30-40 min on 2 idle cores)
    python -m bench.compare_trl --sizes 4M --lengths 32 --betas 0 --precisions fp32 bf16 \\
        --fixed-length-at --steps 4                   # a quick check (a few minutes)

Writes ``bench/results/compare_trl.md`` and ``.json`` (``--name`` changes the file name), after every
configuration, so a stopped run keeps its finished rows; ``--from-json FILE`` re-renders the Markdown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness import (
    QUICKSTART_DATA,
    RESULTS_DIR,
    RunSpec,
    add_contention_options,
    build_models,
    check_num_iterations,
    command_arguments,
    command_line,
    fmt,
    load_line,
    long_prompt_data,
    machine_description,
    markdown_table,
    matmul_rates,
    per_pair_ratios,
    run_measured,
    summarize_runs,
    wait_for_idle_cpu,
    write_outputs,
)

# Timed steps per run when --steps is not given: fewer where a step is slow, so the full matrix
# stays well under an hour on the 2-core machine (a 30M-parameter step at 128 tokens takes ~20 s).
DEFAULT_TIMED_STEPS = {("4M", 32): 8, ("4M", 128): 5, ("30M", 32): 5, ("30M", 128): 3}
PHASES = ("generate", "rewards", "logprobs", "train")


@dataclass(frozen=True)
class Config:
    size: str
    max_completion_length: int
    beta: float
    precision: str
    fixed_length: bool
    prompt_chars: int = 0  # an instruction of this many characters before every prompt
    num_iterations: int = 1  # optimizer steps on each generation batch

    @property
    def label(self) -> str:
        fixed = ", fixed length" if self.fixed_length else ""
        longer = f", prompts +{self.prompt_chars} tokens" if self.prompt_chars else ""
        passes = f", num_iterations={self.num_iterations}" if self.num_iterations != 1 else ""
        return f"{self.size}, L={self.max_completion_length}, beta={self.beta:g}, {self.precision}{fixed}{longer}{passes}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["4M", "30M"], choices=["4M", "30M"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[32, 128], help="max_completion_length values")
    parser.add_argument("--betas", nargs="+", type=float, default=[0.0, 0.04])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument(
        "--fixed-length-at", nargs="*", type=int, default=[128], metavar="L",
        help="also run beta 0 with every completion exactly L tokens (EOS suppressed), for each size and "
        "precision; give no value to skip",
    )
    parser.add_argument(
        "--long-prompts-at", nargs="*", type=int, default=[], metavar="L",
        help="also run beta 0 at max_completion_length L with --long-prompt-chars more prompt tokens, for each "
        "size and precision",
    )
    parser.add_argument("--long-prompt-chars", type=int, default=120, help="instruction length of --long-prompts-at")
    parser.add_argument(
        "--num-iterations", nargs="+", type=int, default=[1],
        help="optimizer steps on each generation batch (both trainers); every configuration runs at each value",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: by size and length)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    parser.add_argument("--repeats", type=int, default=1, help="lit-grpo/TRL pairs per configuration")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--no-count-matmuls", action="store_true", help="skip the untimed FLOP-counting step")
    add_contention_options(parser)
    parser.add_argument("--name", default="compare_trl", help="output file name in bench/results/")
    parser.add_argument("--from-json", type=Path, default=None, help="only re-render the Markdown of this JSON")
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the rows of bench/results/<name>.json whose configuration is in this matrix and run the rest "
        "(a long run that stopped)",
    )
    return parser.parse_args(argv)


def configs_from(args: argparse.Namespace) -> list[Config]:
    check_num_iterations(*args.num_iterations)
    configs = [
        Config(size, length, beta, precision, fixed_length=False, num_iterations=mu)
        for mu, size, length, beta, precision in itertools.product(
            args.num_iterations, args.sizes, args.lengths, args.betas, args.precisions
        )
    ]
    configs += [
        Config(size, length, 0.0, precision, fixed_length=True, num_iterations=mu)
        for mu, size, length, precision in itertools.product(args.num_iterations, args.sizes, args.fixed_length_at, args.precisions)
    ]
    configs += [
        Config(size, length, 0.0, precision, fixed_length=False, prompt_chars=args.long_prompt_chars, num_iterations=mu)
        for mu, size, length, precision in itertools.product(args.num_iterations, args.sizes, args.long_prompts_at, args.precisions)
    ]
    return configs


def run_matrix(
    args: argparse.Namespace, models: dict, rates: dict, on_row=None, done: dict | None = None, data_dir: Path | None = None
) -> list[dict]:
    """Run every configuration (A B A B ... per configuration); ``on_row(rows)`` after each one.
    ``done`` maps labels of configurations already measured to their rows, which are kept; the
    long-prompt data files are written to ``data_dir``."""
    rows = []
    configs = configs_from(args)
    start = time.perf_counter()
    for index, config in enumerate(configs):
        if done and config.label in done:
            rows.append(done[config.label])
            continue
        timed_steps = args.steps or DEFAULT_TIMED_STEPS.get((config.size, config.max_completion_length), 4)
        runs: dict[str, list[dict]] = {"lit-grpo": [], "trl": []}
        for repeat in range(args.repeats):
            for trainer in ("lit-grpo", "trl"):  # A B A B ...
                spec = RunSpec(
                    trainer=trainer,
                    model_dir=models[config.size].path,
                    data_file=str(long_prompt_data(data_dir, config.prompt_chars) if config.prompt_chars else QUICKSTART_DATA),
                    steps=args.warmup + timed_steps,
                    num_generations=args.num_generations,
                    prompts_per_step=args.prompts_per_step,
                    max_completion_length=config.max_completion_length,
                    fixed_length=config.fixed_length,
                    beta=config.beta,
                    num_iterations=config.num_iterations,
                    precision=config.precision,
                    learning_rate=args.learning_rate,
                    count_matmuls=repeat == 0 and not args.no_count_matmuls,
                    threads=args.threads,
                )
                result = run_measured(spec, args.warmup, args.quiet_wait, args.retries, args.min_cpu_share)
                runs[trainer].append(result)
                elapsed = time.perf_counter() - start
                print(
                    f"[{index + 1}/{len(configs)} {elapsed / 60:5.1f} min] {config.label}: {trainer} "
                    f"{statistics.median(s['seconds'] for s in result['steps'][args.warmup:]):.2f} s/step, "
                    f"cpu/wall {result['cpu_share']:.2f}, attempts {result['attempts']}",
                    file=sys.stderr,
                    flush=True,
                )
        model = models[config.size]
        rate = rates[config.size][config.precision]["best"]
        summaries = {t: summarize_runs(runs[t], args.warmup, model.shape, rate) for t in runs}
        ratios = per_pair_ratios(runs["lit-grpo"], runs["trl"], args.warmup)
        rows.append(
            {
                "config": asdict(config),
                "label": config.label,
                "num_parameters": model.num_parameters,
                "timed_steps_per_run": timed_steps,
                "summaries": summaries,
                "tokens_per_second_ratio_per_pair": ratios,
                "tokens_per_second_ratio": statistics.median(ratios),
                "peak_rss_ratio": summaries["lit-grpo"]["peak_rss_mib"] / summaries["trl"]["peak_rss_mib"],
                "runs": runs,
            }
        )
        if on_row is not None:
            on_row(rows)
    return rows


GOAL = 2.0  # the goal: lit-grpo at GOAL x TRL's completion tokens per second


def percent_of_floor_needed(lit: dict, trl: dict, goal: float = GOAL) -> float:
    """The % of its compute floor lit-grpo would have to run at for ``goal`` x TRL's tokens per second.

    lit-grpo's floor per completion token is ``percent_of_floor / 100 / tokens_per_second`` (both are
    sums over its timed steps); at ``goal`` x TRL's tok/s a token may take ``1 / (goal x TRL tok/s)``
    seconds. Above 100 the goal asks for more matmul throughput than the machine was measured to
    give: no implementation of the same work reaches it there."""
    return lit["percent_of_floor"] * goal * trl["tokens_per_second"] / lit["tokens_per_second"]


def summary_table(rows: list[dict]) -> str:
    """One line per configuration: both trainers side by side (the table the README shows)."""
    header = ["config", "lit-grpo s/step", "TRL s/step", "lit-grpo tok/s", "TRL tok/s", "lit/TRL tok/s",
              "lit-grpo peak MiB", "TRL peak MiB", "floor s", "lit-grpo % floor", "TRL % floor",
              f"% floor for {GOAL:g}x"]
    table = []
    for row in rows:
        lit, trl = row["summaries"]["lit-grpo"], row["summaries"]["trl"]
        starved = " (starved)" if lit["contended_runs"] or trl["contended_runs"] else ""
        table.append(
            [
                row["label"] + starved,
                fmt(lit["median_step_seconds"]),
                fmt(trl["median_step_seconds"]),
                fmt(lit["tokens_per_second"], 0),
                fmt(trl["tokens_per_second"], 0),
                fmt(row["tokens_per_second_ratio"]),
                fmt(lit["peak_rss_mib"], 0),
                fmt(trl["peak_rss_mib"], 0),
                fmt(lit["median_floor_seconds"], 3),
                fmt(lit["percent_of_floor"], 1),
                fmt(trl["percent_of_floor"], 1),
                fmt(percent_of_floor_needed(lit, trl), 1),
            ]
        )
    return markdown_table(header, table)


def markdown_report(args, machine_before, machine_after, num_parameters, rates, rows, command: str) -> str:
    sizes = ", ".join(f"{name}: {num_parameters[name]:,} parameters" for name in args.sizes)
    rate_lines = ", ".join(
        f"{name} {precision} {rates[name][precision]['best'] / 1e9:.0f}"
        for name in args.sizes
        for precision in args.precisions
    )
    versions = ", ".join(f"{k} {v}" for k, v in machine_before["versions"].items())
    threads = rows[0]["summaries"]["lit-grpo"]["torch_threads"] if rows else "?"
    out = [
        "# lit-grpo vs TRL GRPOTrainer",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine_before['cpu']}, {machine_before['cores']} cores, {threads} torch threads per run; "
        f"{load_line(machine_before)} before, {load_line(machine_after)} after (other processes share the CPU). "
        f"{versions}.",
        f"Models: {sizes}. G = {args.num_generations}, {args.prompts_per_step} prompts per step, "
        f"{args.warmup} warm-up steps per run not timed, {args.repeats} lit-grpo/TRL pair(s) per row.",
        f"Best measured matmul rate (GFLOP/s) behind the floor: {rate_lines}.",
        "",
        "A step is one generation batch: sampling, scoring and its `num_iterations` optimizer steps (TRL's "
        "alternating sampling and training-only trainer steps count together). "
        "`tok/s`: completion tokens (EOS included) per second of step time. `lit/TRL`: lit-grpo's tok/s over "
        "TRL's (above 1 = lit-grpo faster), median over pairs. `floor s`: matmul FLOPs the step needs / best "
        "matmul rate; `% floor` = floor / measured time. `(starved)`: even after a retry, the run got less "
        f"than {args.min_cpu_share:g} x threads of CPU time per second (another process held a core); its "
        "times are not reliable. `floor s` is lit-grpo's (TRL's sampled lengths differ slightly; "
        "its own floor is in the per-trainer table). "
        f"`% floor for {GOAL:g}x`: the % of its floor lit-grpo would have to run at for {GOAL:g}x TRL's tok/s "
        "(above 100: beyond this machine's measured matmul rate, for any implementation of the same work).",
        "",
        summary_table(rows),
        "",
        "## Per trainer",
        "",
    ]
    header = ["config", "trainer", "s/step", "tok/step", "tok/s", "lit/TRL", "peak RSS MiB", "floor s", "% floor"]
    table = []
    for row in rows:
        for trainer in ("lit-grpo", "trl"):
            s = row["summaries"][trainer]
            table.append(
                [
                    row["label"] if trainer == "lit-grpo" else "",
                    trainer + (" (starved)" if s["contended_runs"] else ""),
                    fmt(s["median_step_seconds"]),
                    fmt(s["tokens_per_step"], 0),
                    fmt(s["tokens_per_second"], 0),
                    fmt(row["tokens_per_second_ratio"]) if trainer == "lit-grpo" else "",
                    fmt(s["peak_rss_mib"], 0),
                    fmt(s["median_floor_seconds"], 3),
                    fmt(s["percent_of_floor"], 1),
                ]
            )
    out += [markdown_table(header, table), ""]

    out += [
        "## Time per step by phase (median seconds)",
        "",
        "lit-grpo: its logged `time/generate`, `time/rewards`, `time/logprobs`, `time/train`. TRL: its own "
        "profiling sections (`transformers.generate`, `_calculate_rewards`, no-gradient "
        "`_get_per_token_logps_and_entropies` calls outside `compute_loss`), train = step minus "
        "`_prepare_inputs`. `cpu/wall`: process CPU time over wall time (2 = both cores busy; lower means "
        "waiting, e.g. for a core another process holds).",
        "",
    ]
    header = ["config", "trainer", "step", *PHASES, "cpu/wall"]
    table = []
    for row in rows:
        for trainer in ("lit-grpo", "trl"):
            s = row["summaries"][trainer]
            phases = dict(s["phases_median_seconds"])
            if trainer == "trl" and "prepare_inputs" in phases:
                phases["train"] = s["median_step_seconds"] - phases["prepare_inputs"]
            table.append(
                [row["label"] if trainer == "lit-grpo" else "", trainer, fmt(s["median_step_seconds"])]
                + [fmt(phases.get(p), 3) for p in PHASES]
                + [fmt(s["cpu_over_wall"])]
            )
    out += [markdown_table(header, table), ""]

    counted = [row for row in rows if row["summaries"]["lit-grpo"]["executed_matmuls"]]
    if counted:
        out += [
            "## Matmul FLOPs executed in one (untimed) step",
            "",
            "Counted below autocast by a `TorchDispatchMode` (mm, addmm, bmm, baddbmm, CPU fused attention) "
            "by the dtype actually multiplied; `executed/floor`: executed FLOPs over the FLOPs that step needs "
            "(padding, finished rows kept decoding, full-sequence recomputation all show up here).",
            "",
        ]
        header = ["config", "trainer", "GFLOP executed", "bf16 share", "executed/floor"]
        table = []
        for row in counted:
            for trainer in ("lit-grpo", "trl"):
                e = row["summaries"][trainer]["executed_matmuls"]
                if e is None:
                    continue
                table.append(
                    [
                        row["label"] if trainer == "lit-grpo" else "",
                        trainer,
                        fmt(sum(e["flops_by_dtype"].values()) / 1e9, 1),
                        f"{100 * e['bf16_share']:.0f}%",
                        fmt(e["executed_over_floor_flops"]),
                    ]
                )
        out += [markdown_table(header, table), ""]
    return "\n".join(out)


def rerender(json_path: Path) -> None:
    """Write the Markdown (and the compacted JSON) again from a previous run's JSON, e.g. after a
    change of the report's format."""
    data = json.loads(json_path.read_text())
    args = parse_args(command_arguments(data["command"]))
    num_parameters = {n: m["num_parameters"] for n, m in data["models"].items()}
    markdown = markdown_report(
        args, data["machine_before"], data["machine_after"], num_parameters,
        data["matmul_rates_flops_per_second"], data["rows"], data["command"],
    )
    md_path, json_path = write_outputs(json_path.stem, markdown, data, json_path.parent)
    print(markdown)
    print(f"\nwrote {md_path} and {json_path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        rerender(args.from_json)
        return
    command = command_line("compare_trl", argv)
    machine_before = machine_description()
    print(f"{load_line(machine_before)}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="lit-grpo-bench-") as tmp:
        models = build_models(args.sizes, Path(tmp))
        for name in args.sizes:
            print(f"model {name}: {models[name].num_parameters:,} parameters", file=sys.stderr)
        longest = max(args.lengths + list(args.fixed_length_at))
        completions = args.num_generations * args.prompts_per_step
        wait_for_idle_cpu(args.quiet_wait, args.threads)
        rates = {name: matmul_rates(models[name].shape, completions, longest // 2, args.threads) for name in args.sizes}

        def write(rows: list[dict]) -> tuple[Path, Path]:
            """Write the tables so far (a long run that is stopped keeps its finished rows)."""
            machine_after = machine_description()
            num_parameters = {n: m.num_parameters for n, m in models.items()}
            markdown = markdown_report(args, machine_before, machine_after, num_parameters, rates, rows, command)
            data = {
                "command": command,
                "machine_before": machine_before,
                "machine_after": machine_after,
                "models": {n: {"num_parameters": m.num_parameters, "shape": asdict(m.shape)} for n, m in models.items()},
                "matmul_rates_flops_per_second": rates,
                "warmup_steps": args.warmup,
                "rows": rows,
            }
            return write_outputs(args.name, markdown, data)

        done = None
        previous = RESULTS_DIR / f"{args.name}.json"
        if args.resume and previous.exists():
            done = {row["label"]: row for row in json.loads(previous.read_text())["rows"]}
            rates = json.loads(previous.read_text())["matmul_rates_flops_per_second"]
        rows = run_matrix(args, models, rates, on_row=write, done=done, data_dir=Path(tmp))
        md_path, json_path = write(rows)
    print(md_path.read_text())
    print(f"\nwrote {md_path} and {json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
