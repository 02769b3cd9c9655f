"""The quickstart on a CPU shared with another job, against the same run alone.

    python -m bench.busy_cpu                                   # lit-grpo's defaults, 3 pairs
    python -m bench.busy_cpu --env GOMP_SPINCOUNT=300000       # libgomp's own spin count (torch's default)
    python -m bench.busy_cpu --env OMP_NUM_THREADS=1 --steps 100 --repeats 1

Each run is ``lit-grpo fit --config configs/quickstart.yaml`` (a fresh tiny model, ``--steps``
optimizer steps, no logger or checkpoint) as a user starts it, timed as a whole process. A *quiet*
run has the machine to itself (the script waits for an idle CPU first); a *busy* run starts beside
one other job: a PyTorch process multiplying 512 x 512 matrices on as many threads as the machine
has cores, with torch's own OpenMP settings (another training job, a test suite, a notebook). The
settings under test (``--env``, added to lit-grpo's defaults) apply to the quickstart only. Quiet
and busy runs alternate, ``--repeats`` pairs; the table gives the medians and busy / quiet.

Results: ``bench/results/busy_cpu.{md,json}`` (``--name``).
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

from bench.harness import (
    command_line,
    fmt,
    load_line,
    machine_description,
    markdown_table,
    wait_for_idle_cpu,
    write_outputs,
)

REPO_DIR = Path(__file__).resolve().parents[1]
LIT_GRPO = str(Path(sys.executable).with_name("lit-grpo"))

OTHER_JOB = """
import sys, time, torch
torch.set_num_threads({threads})
a, b = torch.randn(512, 512), torch.randn(512, 512)
end = time.time() + {seconds}
while time.time() < end:
    a @ b
"""


def quickstart_seconds(directory: Path, steps: int, env: dict[str, str]) -> float:
    """Wall seconds of ``lit-grpo fit`` of the quickstart, as a whole process."""
    command = [LIT_GRPO, "fit", "--config", str(REPO_DIR / "configs/quickstart.yaml"),
               "--model.model_name_or_path", str(directory / "tiny-model"),
               "--data.data_files", str(REPO_DIR / "configs/data/quickstart.jsonl"),
               "--trainer.max_steps", str(steps), "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
               "--trainer.enable_progress_bar", "false", "--model.log_completions_every_n_steps", "0"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=directory, env={**os.environ, **env}, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return seconds


def busy_seconds(directory: Path, steps: int, env: dict[str, str], threads: int) -> float:
    """:func:`quickstart_seconds` beside another job on ``threads`` threads."""
    other = subprocess.Popen([sys.executable, "-c", OTHER_JOB.format(threads=threads, seconds=3600)],
                             env={k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))})
    try:
        time.sleep(2.0)  # the other job is running
        return quickstart_seconds(directory, steps, env)
    finally:
        other.kill()
        other.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.busy_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (the quickstart: 300)")
    parser.add_argument("--repeats", type=int, default=3, help="quiet/busy pairs")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="settings for the quickstart runs")
    parser.add_argument("--other-threads", type=int, default=os.cpu_count(), help="threads of the other job")
    parser.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait at most for an idle CPU")
    parser.add_argument("--name", default="busy_cpu")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    machine = machine_description()
    quiet, busy = [], []
    with tempfile.TemporaryDirectory(prefix="busy-cpu-") as tmp:
        directory = Path(tmp)
        subprocess.run([LIT_GRPO, "init-tiny", str(directory / "tiny-model")], check=True, capture_output=True)
        for repeat in range(args.repeats):
            wait_for_idle_cpu(args.quiet_wait)
            quiet.append(quickstart_seconds(directory, args.steps, env))
            busy.append(busy_seconds(directory, args.steps, env, args.other_threads))
            print(f"pair {repeat + 1}: quiet {quiet[-1]:.1f} s, busy {busy[-1]:.1f} s", flush=True)
    ratios = [b / q for q, b in zip(quiet, busy)]
    setting = " ".join(args.env) or "lit-grpo's defaults"
    row = [setting, fmt(statistics.median(quiet), 1), fmt(statistics.median(busy), 1), fmt(statistics.median(ratios), 2),
           ", ".join(f"{r:.2f}" for r in ratios)]
    markdown = "\n".join([
        f"# The quickstart on a shared CPU ({args.steps} steps)",
        "",
        f"`{command_line('busy_cpu', argv)}`",
        "",
        load_line(machine),
        "",
        f"Busy: beside one PyTorch job multiplying 512 x 512 matrices on {args.other_threads} threads (torch's own "
        "OpenMP settings). Whole-process wall seconds, medians over the pairs.",
        "",
        markdown_table(["quickstart settings", "quiet s", "busy s", "busy / quiet", "each pair"], [row]),
        "",
    ])
    data = {"machine": machine, "steps": args.steps, "env": env, "other_threads": args.other_threads,
            "quiet_seconds": quiet, "busy_seconds": busy, "ratios": ratios}
    md_path, _ = write_outputs(args.name, markdown, data)
    print(markdown)
    print(f"wrote {md_path}")


if __name__ == "__main__":
    main()
