"""Fail unless the latest run under RUN_DIR learned: the mean `reward` of its last 10 logged steps is
at least twice, and at least 0.3 above, the mean of its first 10 (the quickstart's promise)."""

import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

run_dir = sorted(Path(sys.argv[1]).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
events = EventAccumulator(str(run_dir))
events.Reload()
rewards = [event.value for event in events.Scalars("reward")]
first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
print(f"{run_dir}: {len(rewards)} steps, mean reward first 10 = {first:.3f}, last 10 = {last:.3f}")
if len(rewards) < 20 or last < 2 * first or last < first + 0.3:
    sys.exit("the quickstart did not learn enough")
