"""The tool-result budget as users meet it, through ``lit-grpo fit`` with a real sampler.

A tool returns 500 characters (one token each for the tiny models) while ``max_prompt_length`` is 64:
the results are longer than the prompt and the completion budget together. Every finished turn is
read as a call of that tool (``model.tool_call_parser: long_tool_run:every_turn_calls``), so the
limits are reached whatever the tiny policy writes. Shared by tests/rollout/test_tools.py (the ``lit`` and
``transformers`` backends) and tests/rollout/test_vllm.py (``vllm``, in the README's vLLM environment).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CHARACTERS = 500


def long_result(characters: int) -> str:
    """Return a long text.

    Args:
        characters: how many characters
    """
    return "".join(str(i % 10) for i in range(characters))


def every_turn_calls(text: str) -> list[dict]:
    """``model.tool_call_parser``: whatever the turn says, it calls long_result."""
    return [{"name": "long_result", "arguments": {"characters": CHARACTERS}}]


def messages_after_the_prompt(completions, **kwargs) -> list[float]:
    """A reward that needs no plugin (the vLLM environment installs none): the rollout's messages."""
    return [float(len(completion)) for completion in completions]


def fit_with_long_tool_results(tmp_path: Path, model_dir: Path, backend: str, *overrides: str,
                               run=subprocess.run) -> tuple[dict, list[dict]]:
    """``lit-grpo fit`` of configs/tools-quickstart.yaml, 2 steps, with the long tool and
    ``max_prompt_length: 64``, started by ``run`` (``subprocess.run``'s signature); returns the logged scalars and
    the saved conversations."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((REPO / "configs/tools-quickstart.yaml").read_text())
    config["trainer"].update(max_steps=2)
    config["model"].update(model_name_or_path=str(model_dir), generation_backend=backend, max_prompt_length=64,
                           environment=None, tools=["long_tool_run:long_result"], tool_call_parser="long_tool_run:every_turn_calls",
                           max_tool_calling_iterations=1, log_completions_every_n_steps=1, num_generations=4,
                           rewards=[{"name": "long_tool_run:messages_after_the_prompt"}])
    config["data"].update(data_files=str(REPO / "configs/data/kv_lookup.jsonl"), batch_size=2)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [str(Path(sys.executable).with_name("lit-grpo")), "fit", "--config", "config.yaml", *overrides]
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    result = run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-2000:]}\n{result.stderr[-5000:]}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "runs/tools-quickstart/version_0"
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert len(logged["reward"]) == 2 and all(math.isfinite(v) for v in logged["loss"])
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    return logged, records


def tool_messages(records: list[dict]) -> list[str]:
    return [m["content"] for r in records for m in r["completion"] if m["role"] == "tool"]
