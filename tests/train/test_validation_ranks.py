"""Validation on two processes: an evaluation reward that raises on one rank stops both with its own
error, as a training reward does (tests/train/test_distributed.py), instead of leaving the other rank
in the next collective (the reduction of the validation metrics)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_an_evaluation_reward_that_raises_on_one_rank_stops_both_ranks_with_its_message(tiny_model_dir, tmp_path):
    """2 processes (gloo DDP), ``lit-grpo validate`` on the quickstart: rank 1's evaluation reward raises
    in its first validation step. Both ranks end with the reward's own ``error:`` line and status 2;
    neither waits in the metrics' reduction for the other (a hang fails at the timeout) nor dies with
    gloo's 'Connection closed by peer'."""
    (tmp_path / "flaky.py").write_text(
        "import os\n\ndef broken_on_rank_1(completions, **kwargs):\n"
        "    if os.environ['RANK'] == '1':\n        raise ValueError(\"rank 1's evaluation reward broke\")\n"
        "    return [0.0] * len(completions)\n")
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["model"].update(model_name_or_path=str(tiny_model_dir), eval_rewards=[{"name": "flaky.py:broken_on_rank_1"}],
                           num_generations_eval=2)
    config["data"].update(data_files=str(REPO / config["data"]["data_files"]), val_split="train[:8]", batch_size=4)
    config["trainer"].update(devices=2, strategy="ddp", logger=False)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "lit_grpo.cli", "validate", "--config", "config.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    stopped = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)  # a hang fails here
    assert stopped.returncode != 0
    assert "Connection closed by peer" not in stopped.stderr, stopped.stderr[-3000:]
    # (two processes share one stderr pipe: a message can start right after the other's last word)
    errors = re.split(r"error: (?=Reward 'flaky)", stopped.stderr)[1:]
    assert len(errors) == 2, stopped.stderr[-3000:]  # one per rank
    for message in errors:
        assert message.startswith("Reward 'flaky.py:broken_on_rank_1'") and "rank 1's evaluation reward broke" in message, message
    # torchrun's report of its workers: each rank exited with the status of a user's error
    exit_codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", stopped.stderr))
    assert exit_codes == {"0": "2", "1": "2"}, stopped.stderr[-3000:]
