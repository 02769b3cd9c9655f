"""Asynchronous GRPO (lit_grpo/async_rollouts.py, ``model.max_staleness``).

The runs are `lit-grpo fit` processes (tests/test_resume.py's): the staleness of every trained batch
is logged, and a run killed with SIGKILL and resumed with `--ckpt_path last` trains the same prompts
(read from completions.jsonl, every step's completions) as an uninterrupted one.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest
from test_resume import PROMPTS, checkpoint_at, fit_config, killed_during_step_after, lit_grpo_fit, logged_scalars

from lit_grpo.async_rollouts import check_async_settings
from lit_grpo.errors import ConfigError


def async_config(tiny_model_dir, tmp_path: Path, max_staleness: int, **model) -> dict:
    """test_resume's run (6 prompts, batches of 2, 10 optimizer steps, a checkpoint after every
    step), one optimizer step per batch, every step's completions written to completions.jsonl."""
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    config = fit_config(tiny_model_dir, data_file)
    config["trainer"]["max_steps"] = 6
    config["model"].update(steps_per_generation=1, max_staleness=max_staleness, log_completions_every_n_steps=1,
                           num_completions_to_log=100, **model)
    return config


def trained_prompts(run_dir: Path, completions: bool = False) -> list:
    """The prompt (or the prompt and completion) of every completion trained on, in order (each
    step's table: every row)."""
    path = run_dir / "runs/resume/version_0/completions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row["prompt"], row["completion"]) if completions else row["prompt"] for row in rows]


def run(run_dir: Path, config: dict, *args: str):
    run_dir.mkdir()
    finished = lit_grpo_fit(run_dir, config, *args)
    assert finished.returncode == 0, finished.stderr[-5000:]
    return logged_scalars(run_dir / "runs/resume/version_0")


def test_one_step_off_trains_each_batch_one_optimizer_step_after_it_was_sampled(tiny_model_dir, tmp_path):
    config = async_config(tiny_model_dir, tmp_path, max_staleness=1)
    logged = run(tmp_path / "run", config)
    synchronous = run(tmp_path / "synchronous", async_config(tiny_model_dir, tmp_path, max_staleness=0))
    assert not [tag for tag in synchronous if tag.startswith("async/")]  # k = 0: the synchronous step
    # The first batch is sampled from the same random state by the same weights, and trained before
    # any optimizer step: the same completions, rewards and loss as the synchronous run's first step.
    first = trained_prompts(tmp_path / "run", completions=True)[: 2 * 4]
    assert first == trained_prompts(tmp_path / "synchronous", completions=True)[: 2 * 4]
    assert logged["reward"][1] == synchronous["reward"][0]
    assert logged["loss"][1] == pytest.approx(synchronous["loss"][0], abs=1e-6)
    assert logged["loss"][2] != pytest.approx(synchronous["loss"][1], abs=1e-3)  # then they part
    # 6 optimizer steps; the first training step (logged step 0) only filled the pipeline
    assert sorted(logged["reward"]) == [1, 2, 3, 4, 5, 6]
    assert all(value <= 1 for value in logged["async/staleness_max"].values())
    # the first trained batch was sampled by the initial weights when the policy had not moved yet
    # (staleness 0), every later one by the weights one optimizer step older
    assert logged["async/staleness_max"] == {1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0}
    assert logged["async/staleness_mean"] == logged["async/staleness_max"]
    assert set(logged["async/dropped_stale"].values()) == {0.0}
    # the behaviour log-probs are those of the weights that sampled: equal to the trainer's while
    # the policy has not moved, then corrected for the step it has
    assert logged["sampling/sampling_logp_difference/max"][1] == 0.0
    assert min(logged["sampling/sampling_logp_difference/mean"][step] for step in range(2, 7)) > 0.01
    # the prompts trained, in the data loader's order (6 prompts, 2 per batch, reshuffled each epoch):
    # 6 batches of 2 prompts, 4 completions each
    prompts = trained_prompts(tmp_path / "run")
    assert len(prompts) == 6 * 2 * 4


def test_killed_one_step_off_run_resumes_with_no_prompt_lost_or_trained_twice(tiny_model_dir, tmp_path):
    config = async_config(tiny_model_dir, tmp_path, max_staleness=1)
    reference = run(tmp_path / "reference", config)

    run_dir = tmp_path / "interrupted"
    run_dir.mkdir()
    # killed in the optimizer step after the checkpoint of step 2 (a sampled batch in the pipeline),
    # then again after step 4, at the epoch boundary (3 batches per epoch, one more drawn to fill)
    for step, args in ((2, ()), (4, ("--ckpt_path", "last"))):
        killed = lit_grpo_fit(run_dir, killed_during_step_after(config, step), *args)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-5000:]
        assert checkpoint_at(run_dir)["global_step"] == step
    resumed = lit_grpo_fit(run_dir, config, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]

    # every step was logged once (each kill came before its step's optimizer step and logging), with
    # the reference's values, and trained the reference's prompts
    logged = logged_scalars(run_dir / "runs/resume/version_0")
    assert sorted(logged["reward"]) == sorted(reference["reward"]) == [1, 2, 3, 4, 5, 6]
    for tag, values in reference.items():
        assert logged[tag] == values, tag
    expected = trained_prompts(tmp_path / "reference")
    # 2 epochs of the 6 prompts (the first batch of the second filled the pipeline of the first)
    assert Counter(expected) == {row["prompt"]: 2 * 4 for row in PROMPTS}
    assert Counter(trained_prompts(run_dir)) == Counter(expected)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_staleness": -1}, "model.max_staleness must be at least 0"),
        ({"max_staleness": 1, "steps_per_generation": 2}, "model.max_staleness (1) is below"),
        ({"max_staleness": 1, "dynamic_sampling": True}, "model.dynamic_sampling does not run"),
        ({"max_staleness": 2, "tools": ["x.py:f"]}, "model.tools / model.environment"),
    ],
)
def test_settings_async_grpo_cannot_run_with_fail_naming_the_key(settings, message):
    from types import SimpleNamespace

    hp = SimpleNamespace(**{"num_iterations": 1, "steps_per_generation": 1, "dynamic_sampling": False, "tools": None,
                            "environment": None, **settings})
    with pytest.raises(ConfigError) as error:
        check_async_settings(hp)
    assert message in str(error.value)
