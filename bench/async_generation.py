"""Synchronous against asynchronous GRPO (``model.max_staleness``) through a vLLM server: whole-run time.

    .venv-vllm/bin/python -m bench.async_generation                  # CPU: server on core 0, trainer on core 1
    .venv-vllm/bin/python -m bench.async_generation --shape cpu-25M --steps 20 --repeats 2

One ``lit-grpo serve`` is started, pinned with ``taskset`` to ``--server-cores``; then each run is
``lit-grpo fit --config configs/quickstart.yaml`` with ``model.generation_backend: vllm_server``, pinned
to ``--trainer-cores`` (``OMP_NUM_THREADS`` their count), the model replaced by a random-weight model of
``--shape`` (``bench.backends``' shapes), for ``--steps`` optimizer steps: ``max_staleness`` 0
(synchronous) and each of ``--staleness``, alternated ``--repeats`` times so that the machine's load
falls on both alike. Per setting: the whole ``fit``'s wall time (process start to exit, the server
already up), the sum of ``step_time``, the median ``time/generate``, ``time/train``, the weight push
(``time/weight_sync`` synchronous, ``time/wait_for_weights`` asynchronous) and ``time/wait_for_samples``, and the mean reward of the last 10 steps (the
same learning). With ``k >= 1`` a run takes ``k`` more training steps (they fill the pipeline), which
the wall time counts. Results: ``bench/results/async_generation_<device>.{md,json}`` (``--name``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.backends import SHAPES, build_model
from bench.harness import command_line, fmt, load_line, machine_description, markdown_table, write_outputs

REPO_DIR = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.async_generation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="quickstart", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
    parser.add_argument("--staleness", nargs="+", type=int, default=[1], help="the k values compared with 0")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternated")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--server-cores", default="0", help="taskset CPU list of the server")
    parser.add_argument("--trainer-cores", default="1", help="taskset CPU list of the trainer")
    parser.add_argument("--name", default=None, help="results name (default async_generation_cpu)")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: Path, cores: str, log: Path) -> tuple[subprocess.Popen, str]:
    import requests

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpu_list(cores)))}
    command = ["taskset", "-c", cores, str(BIN / "lit-grpo"), "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server stopped:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no server at {url} after 600 s")


def cpu_list(cores: str) -> list[int]:
    result = []
    for part in cores.split(","):
        low, _, high = part.partition("-")
        result += list(range(int(low), int(high or low) + 1))
    return result


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def fit(directory: Path, model: Path, url: str, k: int, args: argparse.Namespace) -> dict:
    config = yaml.safe_load((REPO_DIR / "configs/quickstart.yaml").read_text())
    config["trainer"].update(max_steps=args.steps, enable_checkpointing=False, enable_progress_bar=False)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(directory / "runs")
    config["model"].update(model_name_or_path=str(model), generation_backend="vllm_server", vllm_server_urls=[url],
                           max_staleness=k, max_completion_length=args.max_completion_length,
                           log_completions_every_n_steps=0)
    config["data"]["data_files"] = str(REPO_DIR / config["data"]["data_files"])
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpu_list(args.trainer_cores))), "HF_HUB_OFFLINE": "1"}
    command = ["taskset", "-c", args.trainer_cores, str(BIN / "lit-grpo"), "fit", "--config", "config.yaml"]
    start = time.perf_counter()
    result = subprocess.run(command, check=False, cwd=directory, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{result.stderr[-3000:]}")
    logged = scalars(next((directory / "runs").rglob("version_0")))

    def median(tag: str) -> float | None:
        return statistics.median(logged[tag]) if logged.get(tag) else None

    return {
        "k": k, "wall_seconds": wall, "step_seconds": sum(logged["step_time"]), "steps": len(logged["reward"]),
        "generate": median("time/generate"), "train": median("time/train"),
        "wait_for_samples": median("time/wait_for_samples"),
        # the servers' weight push: time/weight_sync in the synchronous step, time/wait_for_weights in the pipeline
        "weight_push": median("time/wait_for_weights") or median("time/weight_sync"),
        "final_reward": sum(logged["reward"][-10:]) / 10,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_description()
    settings = [0, *args.staleness]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        directory = Path(tmp)
        model = build_model(args.shape, directory)
        server, url = start_server(model, args.server_cores, directory / "server.log")
        try:
            for repeat in range(args.repeats):
                for k in settings:
                    run = fit(directory / f"k{k}-{repeat}", model, url, k, args)
                    print(f"k={k} repeat={repeat}: {run['wall_seconds']:.1f} s whole run, {run['step_seconds']:.1f} s "
                          f"in steps, reward {run['final_reward']:.3f}", flush=True)
                    runs.append(run)
        finally:
            os.killpg(server.pid, 9)
            server.wait(timeout=60)

    rows, summary = [], {}
    for k in settings:
        mine = [run for run in runs if run["k"] == k]
        entry = {key: statistics.median(run[key] for run in mine if run[key] is not None)
                 if any(run[key] is not None for run in mine) else None
                 for key in ("wall_seconds", "step_seconds", "generate", "train", "weight_push", "wait_for_samples",
                             "final_reward")}
        summary[k] = entry
        rows.append([str(k), fmt(entry["wall_seconds"], 1), fmt(entry["step_seconds"], 1), fmt(entry["generate"], 3),
                     fmt(entry["train"], 3), fmt(entry["weight_push"], 3), fmt(entry["wait_for_samples"], 3),
                     fmt(entry["final_reward"], 3)])
    speedups = {k: summary[0]["wall_seconds"] / summary[k]["wall_seconds"] for k in args.staleness}
    markdown = "\n".join([
        f"# Synchronous vs asynchronous GRPO through a vLLM server ({args.shape}, {args.steps} optimizer steps)",
        "",
        f"`{command_line('async_generation', argv)}`",
        "",
        (f"{machine['cpu']}, {machine['cores']} cores; server on cores {args.server_cores}, trainer on cores "
         f"{args.trainer_cores}; {load_line(machine)} at the end; medians of {args.repeats} runs each"),
        "",
        markdown_table(["max_staleness", "whole run s", "sum of step_time s", "time/generate", "time/train",
                        "weight push s", "time/wait_for_samples", "reward (last 10)"], rows),
        "",
        "Speed-up over k = 0, whole run (start-up included) / sum of step times: " + ", ".join(
            f"k = {k}: {value:.2f}x / {summary[0]['step_seconds'] / summary[k]['step_seconds']:.2f}x"
            for k, value in speedups.items()),
        "",
    ])
    print(markdown)
    md, js = write_outputs(args.name or "async_generation_cpu", markdown,
                           {"args": vars(args), "machine": machine, "runs": runs, "summary": summary})
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
