"""The plugin authors' path end to end: examples/reward-plugin, installed with pip (the README's test
command installs it), is discovered through its entry point and drives a real `lit-grpo fit`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[2]
LIT_GRPO = str(Path(sys.executable).with_name("lit-grpo"))


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    return subprocess.run([LIT_GRPO, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_example_plugin_is_listed_with_its_package():
    listing = run("rewards", "--json", cwd=REPO)
    assert listing.returncode == 0, listing.stderr
    rewards = {entry["name"]: entry for entry in json.loads(listing.stdout)}
    assert rewards["brevity"]["package"] == "lit-grpo-brevity"
    assert rewards["brevity"]["version"] == "0.1.0"
    assert rewards["brevity"]["description"].startswith("1.0 for completions of at most")


def test_two_step_fit_with_the_example_plugin(tiny_model_dir, tmp_path):
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["trainer"].update(max_steps=2, enable_checkpointing=False, enable_progress_bar=False)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    config["model"].update(model_name_or_path=str(tiny_model_dir), rewards=[{"name": "brevity", "args": {"max_chars": 4}}])
    config["data"]["data_files"] = str(REPO / config["data"]["data_files"])
    config_path = tmp_path / "brevity.yaml"
    config_path.write_text(yaml.safe_dump(config))

    result = run("fit", "--config", str(config_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    (event_dir,) = {path.parent for path in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(event_dir))
    events.Reload()
    brevity = [event.value for event in events.Scalars("rewards/brevity/mean")]
    # 16-character completions of a random model mostly exceed 4 characters: 4/16 = 0.25 <= score <= 1
    assert len(brevity) == 2 and all(0.25 - 1e-6 <= value <= 1.0 for value in brevity), brevity
    assert [event.value for event in events.Scalars("rewards/brevity/errors")] == [0.0, 0.0]
