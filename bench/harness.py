"""Shared driver code for the benchmarks that compare lit-grpo with TRL's ``GRPOTrainer``.

* :data:`MODEL_SIZES` and :func:`build_models`: the tiny Llama-architecture models (random weights,
  character tokenizer, built offline by ``lit_grpo.tiny.build_tiny_model``);
* :func:`run_in_subprocess`: one trainer run (``python -m bench.trainer_runs``) in its own process, so
  its peak RSS is its own;
* :func:`summarize_run`: median seconds per step, completion tokens per second, the phase split and
  the compute floor of ``bench/flops.py``;
* machine facts (CPU, cores, load) and Markdown helpers.

Run the drivers from the repository root (``python -m bench.compare_trl``,
``python -m bench.learning``, ...) with the benchmark extra installed: ``pip install -e ".[bench]"
-e ./rewards`` (TRL is only a benchmark extra).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.flops import ModelShape, grpo_step_flops, matmul_shapes_for, measure_matmul_rate
from bench.trainer_runs import RunSpec

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
QUICKSTART_DATA = REPO_DIR / "configs" / "data" / "quickstart.jsonl"

TRAINERS = ("lit-grpo", "trl")


@dataclass(frozen=True)
class ModelSize:
    """Arguments of ``build_tiny_model`` for one benchmark model (head_dim 64 in both)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    def build_kwargs(self) -> dict:
        fields = dataclasses.asdict(self)
        fields.pop("name")
        return fields


MODEL_SIZES = {
    "4M": ModelSize("4M", hidden_size=256, intermediate_size=768, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2),
    "30M": ModelSize("30M", hidden_size=512, intermediate_size=1408, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4),
    # the quickstart's own model (`lit-grpo init-tiny` defaults), for the learning comparison
    "quickstart": ModelSize("quickstart", hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


@dataclass
class BuiltModel:
    size: ModelSize
    path: str
    num_parameters: int
    shape: ModelShape


LONG_PROMPT_INSTRUCTION = (
    "You are a careful assistant. Read the request at the end of this message and answer it with the "
    "single letter it names, nothing else, no punctuation and no explanation. "
)


def long_prompt_data(directory: Path, extra_chars: int) -> Path:
    """The quickstart prompts behind an instruction of ``extra_chars`` characters (tokens, with the
    benchmark models' character-level tokenizer): the same task and reward with long prompts."""
    instruction = (LONG_PROMPT_INSTRUCTION * (extra_chars // len(LONG_PROMPT_INSTRUCTION) + 1))[:extra_chars]
    path = Path(directory) / f"quickstart_prompt_plus_{extra_chars}.jsonl"
    rows = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({**row, "prompt": instruction + row["prompt"]}) + "\n" for row in rows))
    return path


def build_models(names: list[str], directory: Path, max_position_embeddings: int = 1024) -> dict[str, BuiltModel]:
    """Write each named model (seed 0 weights) under ``directory`` and count its parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_grpo.tiny import build_tiny_model

    built = {}
    for name in names:
        size = MODEL_SIZES[name]
        path = directory / f"tiny-llama-{name}"
        build_tiny_model(path, max_position_embeddings=max_position_embeddings, seed=0, **size.build_kwargs())
        model = AutoModelForCausalLM.from_pretrained(path)
        num_parameters = sum(p.numel() for p in model.parameters())  # tied embedding counted once
        built[name] = BuiltModel(size, str(path), num_parameters, ModelShape.from_config(AutoConfig.from_pretrained(path)))
    return built


def check_num_iterations(*values: int) -> None:
    """``--num-iterations`` (passes over each generation batch) must be at least 1."""
    for value in values:
        if value < 1:
            raise SystemExit(f"--num-iterations must be at least 1, got {value}")


def steps_per_generation_problem(value: int, completions: int, minimum: int = 1, noun: str = "completions") -> str | None:
    """What is wrong with ``--steps-per-generation``, or None: it must be at least ``minimum`` and
    split the ``completions`` of a generation batch evenly (``noun`` names them in the message)."""
    if value < minimum or completions % value:
        return f"--steps-per-generation must be at least {minimum} and divide the {completions} {noun}, got {value}"
    return None


def check_steps_per_generation(value: int, completions: int) -> None:
    """Exit with :func:`steps_per_generation_problem`'s message, if there is one."""
    problem = steps_per_generation_problem(value, completions)
    if problem:
        raise SystemExit(problem)


def add_work_options(parser, length: int, precision: str) -> None:
    """The options that say what one run trains on: ``--size``, ``--length``, ``--beta``,
    ``--precision``, ``--fixed-length``, ``--prompt-chars`` (see :func:`work_spec`)."""
    parser.add_argument("--size", default="4M", choices=[name for name in MODEL_SIZES if name != "quickstart"])
    parser.add_argument("--length", type=int, default=length, help="max_completion_length")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--precision", default=precision, choices=["fp32", "bf16"])
    parser.add_argument("--fixed-length", action="store_true", help="every completion exactly --length tokens")
    parser.add_argument("--prompt-chars", type=int, default=0, help="an instruction of this many tokens before every prompt")


def work_label(args) -> str:
    """``4M, L=128, beta=0, fp32`` (+ ``, fixed length``, ``, prompts +N tokens``) for :func:`add_work_options`."""
    label = f"{args.size}, L={args.length}, beta={args.beta:g}, {args.precision}"
    label += ", fixed length" if args.fixed_length else ""
    return label + (f", prompts +{args.prompt_chars} tokens" if args.prompt_chars else "")


def work_spec(args, trainer: str, model_dir: str, directory: Path, steps: int, **fields) -> RunSpec:
    """The :class:`RunSpec` of :func:`add_work_options`' work (the long-prompt data is written to
    ``directory``); ``fields`` sets the rest."""
    data_file = long_prompt_data(directory, args.prompt_chars) if args.prompt_chars else QUICKSTART_DATA
    return RunSpec(
        trainer=trainer,
        model_dir=model_dir,
        data_file=str(data_file),
        steps=steps,
        max_completion_length=args.length,
        fixed_length=args.fixed_length,
        beta=args.beta,
        precision=args.precision,
        **fields,
    )


def module_env(env: dict[str, str], *first: str) -> dict[str, str]:
    """``env`` with ``first`` and then the repository root at the head of ``PYTHONPATH``, so that a child
    started as ``python -m bench.<name>`` finds the ``bench`` package whatever its working directory."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [*first, str(REPO_DIR), env.get("PYTHONPATH")]))}


def run_in_subprocess(spec: RunSpec, python: str = sys.executable, timeout: float | None = None) -> dict:
    """Run ``python -m bench.trainer_runs`` on ``spec`` in a fresh process and return its result dict.

    The child's stderr is kept in the error message when it fails. It runs in a temporary directory:
    ``python -m`` puts the working directory first on ``sys.path``, where the repository root would
    shadow ``spec.lit_code_dir``'s ``lit_grpo``, which must come before the working tree's."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
        env = module_env(env, *([spec.lit_code_dir] if spec.lit_code_dir is not None else []))
        start = time.perf_counter()
        proc = subprocess.run(
            [python, "-m", "bench.trainer_runs", str(spec_path), str(result_path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{spec.trainer} run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        result = json.loads(result_path.read_text())
        result["process_seconds"] = time.perf_counter() - start
        return result


def cpu_busy_fraction(interval: float = 1.0) -> float:
    """Fraction of all CPUs' time spent busy over ``interval`` seconds (from ``/proc/stat``)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields), idle

    total_0, idle_0 = sample()
    time.sleep(interval)
    total_1, idle_1 = sample()
    return 1 - (idle_1 - idle_0) / max(total_1 - total_0, 1)


def wait_for_idle_cpu(max_wait: float, cores_needed: int | None = None) -> float:
    """Wait (up to ``max_wait`` seconds) until ``cores_needed`` cores (default: all) are free: other
    processes keep the CPUs busy less than ``(cores - cores_needed) / cores + 0.1`` of the time for
    two consecutive seconds. Returns the seconds waited. On a shared machine this keeps a run from
    starting while someone else's test suite holds a core."""
    cores = os.cpu_count() or 1
    busy_below = (cores - min(cores_needed or cores, cores)) / cores + 0.1
    start = time.perf_counter()
    quiet_seconds = 0
    while time.perf_counter() - start < max_wait and quiet_seconds < 2:
        quiet_seconds = quiet_seconds + 1 if cpu_busy_fraction() < busy_below else 0
    return time.perf_counter() - start


def cpu_share(result: dict, warmup_steps: int) -> float:
    """CPU time over wall time of a run's timed steps (about the thread count when nothing else runs)."""
    steps = result["steps"][warmup_steps:]
    return sum(s["cpu_seconds"] for s in steps) / sum(s["seconds"] for s in steps)


def add_contention_options(parser) -> None:
    """The ``--quiet-wait``, ``--min-cpu-share`` and ``--retries`` options of :func:`run_measured`."""
    parser.add_argument(
        "--quiet-wait", type=float, default=120,
        help="before each run, wait up to this many seconds for other processes to leave the CPU idle",
    )
    parser.add_argument(
        "--min-cpu-share", type=float, default=0.75,
        help="a run whose timed steps got less CPU time than this x threads x wall time was starved by "
        "another process: run it again (see --retries)",
    )
    parser.add_argument("--retries", type=int, default=1, help="extra attempts for a starved run")


def run_measured(spec: RunSpec, warmup_steps: int, quiet_wait: float, retries: int, min_cpu_share: float) -> dict:
    """:func:`run_in_subprocess` after waiting for an idle CPU; a run whose timed steps got less than
    ``min_cpu_share`` of the CPU time they should have had (``threads`` cores each second) was
    starved by another process and is run again, up to ``retries`` times. The result records the
    attempts and whether the kept run was still starved (``contended``)."""
    attempts = []
    for _ in range(retries + 1):
        waited = wait_for_idle_cpu(quiet_wait, spec.threads)
        load_at_start = os.getloadavg()
        result = run_in_subprocess(spec)
        result["load_average_at_start"] = load_at_start
        threads = result["torch_threads"]
        result["waited_for_idle_seconds"] = waited
        result["cpu_share"] = cpu_share(result, warmup_steps)
        attempts.append(result)
        if result["cpu_share"] >= min_cpu_share * threads:
            break
    best = max(attempts, key=lambda r: r["cpu_share"])
    best["attempts"] = len(attempts)
    best["contended"] = best["cpu_share"] < min_cpu_share * best["torch_threads"]
    return best


# ----------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------


def step_flops(shape: ModelShape, step: dict, spec: dict):
    """The floor FLOPs (:func:`flops.grpo_step_flops`) of one recorded step (one generation batch) of
    a run of ``spec`` (a :class:`RunSpec` as a dict; ``lit_options`` may set the passes over the
    generation batch, and take precedence over its ``num_iterations`` and ``steps_per_generation``)."""
    rows = list(zip(step["prompt_lengths"], step["completion_lengths"]))
    lit_options = spec.get("lit_options", {})
    return grpo_step_flops(
        shape, rows, spec["num_generations"], spec["beta"],
        num_iterations=lit_options.get("num_iterations", spec.get("num_iterations", 1)),
        steps_per_generation=lit_options.get("steps_per_generation", spec.get("steps_per_generation", 1)),
    )


def summarize_runs(results: list[dict], warmup_steps: int, shape: ModelShape, matmul_rate: float) -> dict:
    """Pool the timed steps (after ``warmup_steps``) of one trainer's runs of one configuration."""
    spec = results[0]["spec"]
    steps = [s for r in results for s in r["steps"][warmup_steps:]]
    seconds = [s["seconds"] for s in steps]
    tokens = [sum(s["completion_lengths"]) for s in steps]
    floors = [step_flops(shape, s, spec).total / matmul_rate for s in steps]
    phase_names = sorted({name for s in steps for name in s["phases"]})
    phases = {name: statistics.median(s["phases"].get(name, float("nan")) for s in steps) for name in phase_names}
    counted = next((r for r in results if r.get("matmul_flops_by_dtype")), None)
    executed = None
    if counted is not None:
        lengths = {"prompt_lengths": counted["counted_step_prompt_lengths"], "completion_lengths": counted["counted_step_completion_lengths"]}
        floor_flops = step_flops(shape, lengths, spec).total
        by_dtype = counted["matmul_flops_by_dtype"]
        executed = {
            "flops_by_dtype": by_dtype,
            "bf16_share": by_dtype.get("bfloat16", 0.0) / max(sum(by_dtype.values()), 1.0),
            "executed_over_floor_flops": sum(by_dtype.values()) / floor_flops,
        }
    return {
        "num_steps": len(steps),
        "median_step_seconds": statistics.median(seconds),
        "tokens_per_step": statistics.mean(tokens),
        "tokens_per_second": sum(tokens) / sum(seconds),
        "cpu_over_wall": sum(s["cpu_seconds"] for s in steps) / sum(seconds),
        "median_floor_seconds": statistics.median(floors),
        "median_minor_faults": (
            statistics.median(s["minor_faults"] for s in steps) if all(s.get("minor_faults") is not None for s in steps) else None
        ),
        "percent_of_floor": 100 * sum(floors) / sum(seconds),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "peak_gpu_memory_gib": max((r["peak_gpu_memory_gib"] for r in results if r.get("peak_gpu_memory_gib") is not None), default=None),
        "rss_before_training_mib": max(r["rss_before_training_mib"] for r in results),
        "setup_seconds": statistics.median(r["setup_seconds"] for r in results),
        "phases_median_seconds": phases,
        "mean_reward": statistics.mean(s["reward"] for s in steps),
        "torch_threads": results[0]["torch_threads"],
        "executed_matmuls": executed,
        "contended_runs": sum(bool(r.get("contended")) for r in results),
    }


def per_pair_ratios(lit_results: list[dict], trl_results: list[dict], warmup_steps: int) -> list[float]:
    """lit-grpo tokens/s divided by TRL tokens/s, for each A/B pair of runs."""
    ratios = []
    for lit, trl in zip(lit_results, trl_results):
        rates = []
        for result in (lit, trl):
            steps = result["steps"][warmup_steps:]
            rates.append(sum(sum(s["completion_lengths"]) for s in steps) / sum(s["seconds"] for s in steps))
        ratios.append(rates[0] / rates[1])
    return ratios


def matmul_rates(
    shape: ModelShape, num_rows: int, sequence_length: int, threads: int | None = None
) -> dict[str, dict[str, float]]:
    """This machine's matmul FLOP/s at the model's shapes, fp32 and bf16 (``best`` = the floor's rate),
    with ``threads`` torch threads (None: torch's default), as the runs use."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    shapes = matmul_shapes_for(shape, num_rows, sequence_length)
    return {name: measure_matmul_rate(shapes, dtype) for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16"))}


# ----------------------------------------------------------------------------------------------
# Machine facts and Markdown
# ----------------------------------------------------------------------------------------------


def machine_description() -> dict:
    """CPU model, core count, load average and library versions, for the table headers."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("torch", "transformers", "lightning", "trl", "accelerate"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 - a missing package is reported as missing
            versions[package] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average": os.getloadavg(), "versions": versions}


def load_line(machine: dict) -> str:
    one, five, fifteen = machine["load_average"]
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reproduces a run of ``bench.<module>`` from the repository root, quoted so that it
    can be pasted into a shell."""
    return shlex.join(["python", "-m", f"bench.{module}", *(sys.argv[1:] if argv is None else argv)])


def command_arguments(command: str) -> list[str]:
    """The arguments of a command written by :func:`command_line` (``python -m bench.<module> ...``), or
    by earlier versions of it (``python bench/<script>.py ...``), as results files record them."""
    words = shlex.split(command)
    return words[3:] if words[1:2] == ["-m"] else words[2:]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:  # None or NaN
        return "n/a"
    return f"{value:.{digits}f}"


def compact_step(step: dict) -> dict:
    """A step record for the JSON output: per-completion token counts replaced by their totals."""
    if "completion_lengths" not in step:
        return step
    out = {k: v for k, v in step.items() if k not in ("prompt_lengths", "completion_lengths")}
    out["completion_tokens"] = sum(step["completion_lengths"])
    out["prompt_tokens"] = sum(step["prompt_lengths"])
    out["num_completions"] = len(step["completion_lengths"])
    return out


def compact_runs(data):
    """``data`` with every run's steps compacted (:func:`compact_step`) and the counted step's
    per-completion lengths dropped, so the JSON stays small; summaries are computed before this."""
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            if key == "steps" and isinstance(value, list):
                out[key] = [compact_step(step) for step in value]
            elif key in ("counted_step_prompt_lengths", "counted_step_completion_lengths"):
                continue
            else:
                out[key] = compact_runs(value)
        return out
    if isinstance(data, list):
        return [compact_runs(item) for item in data]
    return data


def write_outputs(name: str, markdown: str, data: dict, results_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write ``bench/results/<name>.md`` and ``<name>.json`` (runs compacted)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = results_dir / f"{name}.md", results_dir / f"{name}.json"
    md_path.write_text(markdown)
    json_path.write_text(json.dumps(compact_runs(data), separators=(",", ":")) + "\n")
    return md_path, json_path
