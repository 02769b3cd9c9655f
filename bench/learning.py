"""Same learning: lit-grpo's reward curve on the quickstart task against TRL's, over several seeds.

The quickstart setup on both trainers (``configs/quickstart.yaml``): the ``lit-grpo init-tiny``
model (hidden 64, 2 layers, seed 0 weights), the quickstart prompts and ``char_fraction`` reward,
G = 8, 8 prompts per step, ``max_completion_length`` 16, temperature 1, dapo, beta 0,
epsilon 0.2 / epsilon_high 0.28, AdamW lr 3e-3 (fused, no weight decay, constant), clipping at 1.0,
fp32, one optimizer step per generation batch (``--num-iterations N``: N passes on both trainers, so
the ratio against the sampling policy moves away from 1 and its clipping takes part;
``--steps-per-generation S``: S optimizer steps per pass, each on a shuffled 1/S of the 64
completions, TRL's ``steps_per_generation``). Only the seed
changes between runs (data order and sampling); the weights are the same. A step is one generation
batch.

The reward of a step is the mean ``char_fraction`` of its 64 completions, recorded identically for
both trainers. Summary: the mean reward of the last 10 steps per seed and trainer, and whether
lit-grpo's curve stays within TRL's seed-to-seed spread: for each block of ``--block`` steps, the
block's mean reward averaged over lit-grpo's seeds against the lowest and highest block mean among
TRL's seeds.

    python -m bench.learning                      # 3 seeds x 300 steps x 2 trainers (~10 min on 2 cores)
    python -m bench.learning --seeds 0 --steps 30 # a quick check

Writes ``bench/results/learning.md`` and ``.json`` (with every curve).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import (
    QUICKSTART_DATA,
    TRAINERS,
    RunSpec,
    build_models,
    check_num_iterations,
    check_steps_per_generation,
    command_line,
    fmt,
    load_line,
    machine_description,
    markdown_table,
    run_in_subprocess,
    write_outputs,
)

_RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSpec)}
COMPLETIONS_PER_STEP = _RUN_DEFAULTS["num_generations"] * _RUN_DEFAULTS["prompts_per_step"]  # G 8 x 8 prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block", type=int, default=10, help="steps per block when comparing curves")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument(
        "--num-iterations", type=int, default=1, help="optimizer steps on each generation batch, both trainers"
    )
    parser.add_argument(
        "--steps-per-generation", type=int, default=1,
        help="optimizer steps per pass over a generation batch, each on 1/S of its completions, both trainers",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--name", default="learning", help="output file name in bench/results/")
    args = parser.parse_args(argv)
    check_num_iterations(args.num_iterations)
    check_steps_per_generation(args.steps_per_generation, COMPLETIONS_PER_STEP)
    return args


def run_spec(args: argparse.Namespace, trainer: str, model_dir: str, seed: int) -> RunSpec:
    """One trainer's run on the quickstart task; only ``seed`` differs between a trainer's runs."""
    return RunSpec(
        trainer=trainer,
        model_dir=model_dir,
        data_file=str(QUICKSTART_DATA),
        steps=args.steps,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        seed=seed,
        threads=args.threads,
        num_iterations=args.num_iterations,
        steps_per_generation=args.steps_per_generation,
    )


def block_means(curve: list[float], block: int) -> list[float]:
    return [statistics.mean(curve[i : i + block]) for i in range(0, len(curve) - block + 1, block)]


def compare_curves(curves: dict[str, dict[int, list[float]]], block: int) -> dict:
    """lit-grpo's seed-averaged block means against the min-max band of TRL's seeds, block by block."""
    lit_blocks = [block_means(c, block) for c in curves["lit-grpo"].values()]
    trl_blocks = [block_means(c, block) for c in curves["trl"].values()]
    lit_mean = [statistics.mean(values) for values in zip(*lit_blocks)]
    trl_low = [min(values) for values in zip(*trl_blocks)]
    trl_high = [max(values) for values in zip(*trl_blocks)]
    inside = [low <= value <= high for value, low, high in zip(lit_mean, trl_low, trl_high)]
    return {
        "block": block,
        "lit_grpo_seed_mean": lit_mean,
        "trl_seed_min": trl_low,
        "trl_seed_max": trl_high,
        "inside": inside,
        "fraction_inside": sum(inside) / len(inside) if inside else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("learning", argv)
    machine_before = machine_description()
    curves: dict[str, dict[int, list[float]]] = {t: {} for t in TRAINERS}
    wall: dict[str, dict[int, float]] = {t: {} for t in TRAINERS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lit-grpo-bench-") as tmp:
        model = build_models(["quickstart"], Path(tmp))["quickstart"]
        for seed in args.seeds:
            for trainer in TRAINERS:
                result = run_in_subprocess(run_spec(args, trainer, model.path, seed))
                curves[trainer][seed] = [step["reward"] for step in result["steps"]]
                wall[trainer][seed] = sum(step["seconds"] for step in result["steps"])
                print(f"[{(time.perf_counter() - start) / 60:5.1f} min] seed {seed} {trainer}: last-10 reward "
                      f"{statistics.mean(curves[trainer][seed][-10:]):.3f}", file=sys.stderr, flush=True)
    machine_after = machine_description()
    comparison = compare_curves(curves, args.block)

    header = ["trainer", "seed", "reward, steps 1-10", "reward, last 10 steps", "training seconds"]
    table = [
        [trainer, str(seed), fmt(statistics.mean(curve[:10]), 3), fmt(statistics.mean(curve[-10:]), 3),
         fmt(wall[trainer][seed], 0)]
        for trainer in TRAINERS
        for seed, curve in curves[trainer].items()
    ]
    last10 = {t: [statistics.mean(c[-10:]) for c in curves[t].values()] for t in TRAINERS}
    lit_last10 = statistics.mean(last10["lit-grpo"])
    verdict = (
        f"lit-grpo's seed-mean block reward lies within TRL's seed min-max in "
        f"{sum(comparison['inside'])} of {len(comparison['inside'])} blocks of {args.block} steps. "
        f"Last 10 steps: lit-grpo mean {lit_last10:.3f} (seeds {', '.join(f'{v:.3f}' for v in last10['lit-grpo'])}), "
        f"TRL seeds {', '.join(f'{v:.3f}' for v in last10['trl'])} (range {min(last10['trl']):.3f}-{max(last10['trl']):.3f})."
    )
    block_rows = [
        [f"{i * args.block + 1}-{(i + 1) * args.block}", fmt(m, 3), fmt(lo, 3), fmt(hi, 3), "yes" if ok else "no"]
        for i, (m, lo, hi, ok) in enumerate(
            zip(comparison["lit_grpo_seed_mean"], comparison["trl_seed_min"], comparison["trl_seed_max"], comparison["inside"])
        )
    ]
    threads = "torch's default" if args.threads is None else str(args.threads)
    markdown = "\n".join(
        [
            "# Learning: lit-grpo vs TRL on the quickstart task",
            "",
            f"`{command}`",
            "",
            f"Machine: {machine_before['cpu']}, {machine_before['cores']} cores, torch threads {threads}; "
            f"{load_line(machine_before)} before, {load_line(machine_after)} after. Quickstart settings on both "
            f"(tiny model {model.num_parameters:,} parameters, G 8, 8 prompts/step, L {args.max_completion_length}, "
            f"lr {args.learning_rate:g}, dapo, beta 0, num_iterations {args.num_iterations}, steps_per_generation "
            f"{args.steps_per_generation}), {args.steps} steps "
            f"(generation batches), seeds {args.seeds}.",
            "",
            verdict,
            "",
            markdown_table(header, table),
            "",
            "Block means (lit-grpo averaged over seeds; TRL's lowest and highest seed):",
            "",
            markdown_table(["steps", "lit-grpo", "TRL min", "TRL max", "inside"], block_rows),
            "",
        ]
    )
    data = {
        "command": command,
        "machine_before": machine_before,
        "machine_after": machine_after,
        "settings": vars(args),
        "reward_curves": {t: {str(seed): c for seed, c in curves[t].items()} for t in TRAINERS},
        "training_seconds": {t: {str(seed): w for seed, w in wall[t].items()} for t in TRAINERS},
        "comparison": comparison,
    }
    md_path, json_path = write_outputs(args.name, markdown, data)
    print(markdown)
    print(f"wrote {md_path} and {json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
