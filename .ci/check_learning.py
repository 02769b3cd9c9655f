"""Fail unless the latest run under RUN_DIR learned: the mean of a metric (`reward`) over its last 10
logged steps is at least twice, and at least 0.3 above, the mean of its first 10 (the quickstart's
promise). Options set the metric, the number of first and last steps, and absolute bounds:

    check_learning.py runs/tools-quickstart --first 3 --first-at-most 0.2 --last-at-least 0.6
"""

import argparse
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("run_dir", type=Path)
parser.add_argument("--metric", default="reward", help="a scalar the run logs at every step")
parser.add_argument("--first", type=int, default=10, help="steps averaged at the start")
parser.add_argument("--last", type=int, default=10, help="steps averaged at the end")
parser.add_argument("--first-at-most", type=float, default=None, help="the start's mean must be at most this")
parser.add_argument("--last-at-least", type=float, default=None, help="the end's mean must be at least this")
args = parser.parse_args()

run_dir = max(args.run_dir.glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
events.Reload()
values = [event.value for event in events.Scalars(args.metric)]
first, last = sum(values[: args.first]) / args.first, sum(values[-args.last :]) / args.last
print(f"{run_dir}: {len(values)} steps, mean {args.metric} first {args.first} = {first:.3f}, last {args.last} = {last:.3f}")
failures = []
if len(values) < args.first + args.last:
    failures.append(f"only {len(values)} steps logged")
if last < 2 * first or last < first + 0.3:
    failures.append("the end's mean is not twice and 0.3 above the start's")
if args.first_at_most is not None and first > args.first_at_most:
    failures.append(f"the start's mean is above {args.first_at_most}")
if args.last_at_least is not None and last < args.last_at_least:
    failures.append(f"the end's mean is below {args.last_at_least}")
if failures:
    sys.exit(f"{args.run_dir} did not learn enough: " + "; ".join(failures))
