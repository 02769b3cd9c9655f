"""Wall time of ``code_execution`` on 64 completions, serial vs a thread pool of sandboxes.

The mix: correct and wrong solutions (fast), slow-ish ones (a Python loop of roughly 50-100 ms),
and two that loop forever and are killed at the 1 s timeout. Every configuration must give the
same scores. Prints a Markdown table.

    python -m bench.code_execution_parallel [--workers 1 2 4] [--timeout 1.0]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from lit_grpo_rewards.code import code_execution

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 3\n"  # passes 1 of the 3 tests
SLOW = "s = 0\nfor i in range(400_000):\n    s += i * i\n\ndef add(a, b):\n    return a + b\n"
FOREVER = "while True:\n    pass\n"


def completions() -> list[str]:
    mix = [CORRECT] * 24 + [WRONG] * 20 + [SLOW] * 18 + [FOREVER] * 2
    # interleave so that each worker sees a bit of everything
    return [mix[(i * 37) % len(mix)] for i in range(len(mix))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=1.0)
    args = parser.parse_args()
    comps = completions()
    assert len(comps) == 64 and len(set(comps)) == 4
    tests = [TESTS] * len(comps)

    start = time.perf_counter()
    slow_alone = code_execution([SLOW], test_cases=[TESTS], timeout=args.timeout)
    slow_s = time.perf_counter() - start
    assert slow_alone == [1.0]

    rows = []
    reference = None
    for workers in args.workers:
        start = time.perf_counter()
        scores = code_execution(comps, test_cases=tests, timeout=args.timeout, num_workers=workers)
        wall = time.perf_counter() - start
        if reference is None:
            reference = scores
        assert scores == reference, f"num_workers={workers} changed the scores"
        rows.append((workers, wall))

    base = rows[0][1]
    print(f"64 completions (24 correct, 20 wrong, 18 slow-ish, 2 infinite loops), timeout {args.timeout:g} s, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, running as "
          f"{'root' if os.geteuid() == 0 else 'non-root'}; one slow-ish completion alone: {slow_s:.2f} s; "
          f"mean score {sum(reference) / len(reference):.3f}")
    print()
    print("| num_workers | wall (s) | speed-up vs 1 |")
    print("| ---: | ---: | ---: |")
    for workers, wall in rows:
        print(f"| {workers} | {wall:.2f} | {base / wall:.2f}x |")


if __name__ == "__main__":
    main()
