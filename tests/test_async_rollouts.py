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
import torch
import yaml
from test_distributed import STRATEGIES, run_dir, run_worker  # noqa: F401  (run_dir is a fixture)
from test_resume import PROMPTS, REPO, checkpoint_at, fit_config, killed_during_step_after, lit_grpo_fit, logged_scalars

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


def trained_prompts(directory: Path, completions: bool = False) -> list:
    """The prompt (or the prompt and completion) of every completion trained on, in order (each
    step's table: every row)."""
    path = directory / "runs/resume/version_0/completions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row["prompt"], row["completion"]) if completions else row["prompt"] for row in rows]


def run(directory: Path, config: dict, *args: str):
    directory.mkdir()
    finished = lit_grpo_fit(directory, config, *args)
    assert finished.returncode == 0, finished.stderr[-5000:]
    return logged_scalars(directory / "runs/resume/version_0")


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

    directory = tmp_path / "interrupted"
    directory.mkdir()
    # killed in the optimizer step after the checkpoint of step 2 (a sampled batch in the pipeline),
    # then again after step 4, at the epoch boundary (3 batches per epoch, one more drawn to fill)
    for step, args in ((2, ()), (4, ("--ckpt_path", "last"))):
        killed = lit_grpo_fit(directory, killed_during_step_after(config, step), *args)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-5000:]
        assert checkpoint_at(directory)["global_step"] == step
    resumed = lit_grpo_fit(directory, config, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]

    # every step was logged once (each kill came before its step's optimizer step and logging), with
    # the reference's values, and trained the reference's prompts
    logged = logged_scalars(directory / "runs/resume/version_0")
    assert sorted(logged["reward"]) == sorted(reference["reward"]) == [1, 2, 3, 4, 5, 6]
    for tag, values in reference.items():
        assert logged[tag] == values, tag
    expected = trained_prompts(tmp_path / "reference")
    # 2 epochs of the 6 prompts (the first batch of the second filled the pipeline of the first)
    assert Counter(expected) == {row["prompt"]: 2 * 4 for row in PROMPTS}
    assert Counter(trained_prompts(directory)) == Counter(expected)


def test_batches_older_than_max_staleness_are_dropped_and_counted(tiny_model_dir, tmp_path):
    """A run checkpointed with k = 2 (two batches in flight, sampled 1 and 2 optimizer steps before the
    last) and resumed with k = 1: the oldest batch would be trained 2 steps stale, so it is dropped
    (its 2 prompts x 4 completions counted) and the next is trained; then one batch stays in flight."""
    directory = tmp_path / "run"
    run(directory, {**async_config(tiny_model_dir, tmp_path, max_staleness=2), "trainer": {
        **async_config(tiny_model_dir, tmp_path, 2)["trainer"], "max_steps": 3}})
    first = logged_scalars(directory / "runs/resume/version_0")
    assert first["async/staleness_max"] == {2: 0.0, 3: 1.0, 4: 2.0}  # trained at k = 2
    resumed = lit_grpo_fit(directory, async_config(tiny_model_dir, tmp_path, max_staleness=1), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    logged = logged_scalars(directory / "runs/resume/version_0")
    after = {step: value for step, value in logged["async/staleness_max"].items() if step > 4}
    assert after == {5: 1.0, 6: 1.0, 7: 1.0}
    assert logged["async/dropped_stale"] == {2: 0.0, 3: 0.0, 4: 0.0, 5: 8.0, 6: 8.0, 7: 8.0}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_keep_every_ranks_batches_in_flight_across_a_resume(run_dir, strategy):  # noqa: F811
    """DDP and FSDP2 on 2 processes with k = 1 and real sampling (each rank its own prompts): every trained batch
    is one optimizer step stale on both ranks; a run stopped after 2 optimizer steps (a batch of each
    rank in flight, in last.ckpt) and resumed logs what an uninterrupted one logs."""
    def overrides(name: str, max_steps: int) -> dict:
        return {
            "trainer": {"devices": 2, "strategy": STRATEGIES[strategy], "max_steps": max_steps, "enable_checkpointing": True,
                        "default_root_dir": str(run_dir / name),
                        "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                       "init_args": {"save_last": True, "save_top_k": 0, "every_n_train_steps": 1}}]},
            "model": {"temperature": 1.0, "num_iterations": 1, "max_staleness": 1},
            "data": {"batch_size": 2},
        }

    straight = run_worker(run_dir, f"async_straight_{strategy}", 2, overrides(f"async_straight_{strategy}", 4))
    trained = [step for step in straight["steps"] if "loss" in step]
    assert len(trained) == 4
    assert [step["async/staleness_max"] for step in trained] == [0.0, 1.0, 1.0, 1.0]
    run_worker(run_dir, f"async_first_half_{strategy}", 2, overrides(f"async_resumed_{strategy}", 2))
    checkpoint = run_dir / f"async_resumed_{strategy}" / "lit-grpo" / "version_0" / "checkpoints" / "last.ckpt"
    if strategy == "ddp":  # (FSDP2's is a directory of shards and metadata)
        saved = torch.load(checkpoint, weights_only=True)["callbacks"]["RolloutPipeline"]
        assert [len(batches) for batches in saved["per_rank"]] == [1, 1]  # each rank's own prompts
        assert saved["per_rank"][0][0]["prompts"] != saved["per_rank"][1][0]["prompts"]
    resumed = run_worker(run_dir, f"async_second_half_{strategy}", 2, overrides(f"async_resumed_{strategy}", 4),
                         "--ckpt-path", str(checkpoint))
    resumed_trained = [step for step in resumed["steps"] if "loss" in step]
    assert len(resumed_trained) == 2
    for name in ["loss", "reward", "reward_std", "async/staleness_max", "grad_norm"]:
        for got, expected in zip(resumed_trained, trained[2:]):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    for name, expected in straight["state"].items():
        torch.testing.assert_close(resumed["state"][name], expected, rtol=1e-5, atol=1e-6, msg=name)


def quickstart_rewards(tiny_model_dir, directory: Path, max_staleness: int, seed: int, steps: int) -> list[float]:
    """The reward of every training step of configs/quickstart.yaml (``steps`` optimizer steps)."""
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["seed_everything"] = seed
    config["trainer"].update(max_steps=steps, enable_checkpointing=False, enable_progress_bar=False)
    config["trainer"]["logger"]["init_args"]["save_dir"] = "runs"
    config["model"].update(model_name_or_path=str(tiny_model_dir), max_staleness=max_staleness, log_completions_every_n_steps=0)
    config["data"].update(seed=seed, data_files=str(REPO / config["data"]["data_files"]))
    directory.mkdir()
    finished = lit_grpo_fit(directory, config)
    assert finished.returncode == 0, finished.stderr[-5000:]
    rewards = logged_scalars(directory / "runs/quickstart/version_0")["reward"]
    return [rewards[step] for step in sorted(rewards)]


def test_one_step_off_learns_the_quickstart_as_the_synchronous_run_does(tiny_model_dir, tmp_path):
    """50 optimizer steps of the quickstart, seeds 0-2: the reward rises from about 0.02 to about 0.24
    (measured: synchronous 0.239/0.245/0.241, k = 1 0.245/0.234/0.232 over the last 10 steps); the mean
    over the seeds of k = 1 is within 0.05 of the synchronous one's."""
    final = {}
    for k in (0, 1):
        last_ten = []
        for seed in range(3):
            rewards = quickstart_rewards(tiny_model_dir, tmp_path / f"k{k}-seed{seed}", k, seed, steps=50)
            assert len(rewards) == 50
            assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1, (k, seed, rewards)
            last_ten.append(sum(rewards[-10:]) / 10)
        final[k] = sum(last_ten) / len(last_ten)
    assert abs(final[1] - final[0]) < 0.05, final


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
