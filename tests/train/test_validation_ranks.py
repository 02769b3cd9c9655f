"""Validation on two processes: an evaluation reward that raises on one rank stops both with its own
error, as a training reward does (tests/train/test_distributed.py), instead of leaving the other rank
in the next collective (the reduction of the validation metrics)."""

from __future__ import annotations

import re

from test_distributed import two_ranks_with_a_reward_broken_on_rank_1


def test_an_evaluation_reward_that_raises_on_one_rank_stops_both_ranks_with_its_message(tiny_model_dir, tmp_path):
    """2 processes (gloo DDP), ``lit-grpo validate`` on the quickstart: rank 1's evaluation reward raises
    in its first validation step. Both ranks end with the reward's own ``error:`` line and status 2;
    neither waits in the metrics' reduction for the other (a hang fails at the timeout) nor dies with
    gloo's 'Connection closed by peer'."""
    stopped = two_ranks_with_a_reward_broken_on_rank_1(
        tmp_path, tiny_model_dir, "validate", "rank 1's evaluation reward broke",
        model={"eval_rewards": [{"name": "flaky.py:broken_on_rank_1"}], "num_generations_eval": 2},
        data={"val_split": "train[:8]", "batch_size": 4}, trainer={"logger": False})
    # torchrun's report of its workers: the first to end exited with the status of a user's error; torchrun
    # stops the other with SIGTERM once one has failed, which may come after that rank's own error line (above)
    # and before its exit
    exit_codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", stopped.stderr))
    first = re.search(r"Root Cause \(first observed failure\):\n.*\n.*\n.*\n\s*rank\s*:\s*(\d+)", stopped.stderr)
    assert first is not None and exit_codes[first.group(1)] == "2", (exit_codes, stopped.stderr[-3000:])
    assert set(exit_codes) == {"0", "1"} and set(exit_codes.values()) <= {"2", "-15"}, (exit_codes, stopped.stderr[-3000:])
