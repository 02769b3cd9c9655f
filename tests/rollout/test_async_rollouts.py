"""Asynchronous GRPO (lit_grpo/rollout/async_pipeline.py, ``model.max_staleness``).

The runs are `lit-grpo fit` processes (tests/run/test_resume.py's): the staleness of every trained batch
is logged, and a run killed with SIGKILL and resumed with `--ckpt_path last` trains the same prompts
(read from completions.jsonl, every step's completions) as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from test_distributed import STRATEGIES, run_dir, run_worker  # noqa: F401  (run_dir is a fixture)
from test_resume import PROMPTS, checkpoint_at, fit_config, killed_during_step_after, lit_grpo_fit, logged_scalars

from lit_grpo.data import PromptBatch
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.async_pipeline import InFlight, RolloutPipeline, check_async_settings


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


@pytest.fixture(scope="module")
def one_step_off_run(tmp_path_factory, tiny_model_dir):
    """An uninterrupted run with k = 1, which two tests read: started when first asked for and run beside
    that test's own run (their imports overlap on CI's 2 cores); ``.result()`` is its directory and logged scalars."""
    directory = tmp_path_factory.mktemp("one-step-off")

    def uninterrupted() -> tuple[Path, dict]:
        return directory / "run", run(directory / "run", async_config(tiny_model_dir, directory, max_staleness=1))

    with ThreadPoolExecutor(1) as beside:
        yield beside.submit(uninterrupted)


def test_one_step_off_trains_each_batch_one_optimizer_step_after_it_was_sampled(one_step_off_run, tiny_model_dir,
                                                                                  tmp_path):
    synchronous = run(tmp_path / "synchronous", async_config(tiny_model_dir, tmp_path, max_staleness=0))
    run_directory, logged = one_step_off_run.result()
    assert not [tag for tag in synchronous if tag.startswith("async/")]  # k = 0: the synchronous step
    # The first batch is sampled from the same random state by the same weights, and trained before
    # any optimizer step: the same completions, rewards and loss as the synchronous run's first step.
    first = trained_prompts(run_directory, completions=True)[: 2 * 4]
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
    prompts = trained_prompts(run_directory)
    assert len(prompts) == 6 * 2 * 4


def test_killed_one_step_off_run_resumes_with_no_prompt_lost_or_trained_twice(one_step_off_run, tiny_model_dir, tmp_path):
    config = async_config(tiny_model_dir, tmp_path, max_staleness=1)

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
    reference_directory, reference = one_step_off_run.result()

    # every step was logged once (each kill came before its step's optimizer step and logging), with
    # the reference's values, and trained the reference's prompts
    logged = logged_scalars(directory / "runs/resume/version_0")
    assert sorted(logged["reward"]) == sorted(reference["reward"]) == [1, 2, 3, 4, 5, 6]
    for tag, values in reference.items():
        assert logged[tag] == values, tag
    expected = trained_prompts(reference_directory)
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

    with ThreadPoolExecutor(1) as beside:  # the straight run beside the stopped and resumed ones: their imports overlap
        straight_run = beside.submit(run_worker, run_dir, f"async_straight_{strategy}", 2, overrides(f"async_straight_{strategy}", 4))
        run_worker(run_dir, f"async_first_half_{strategy}", 2, overrides(f"async_resumed_{strategy}", 2))
        checkpoint = run_dir / f"async_resumed_{strategy}" / "lit-grpo" / "version_0" / "checkpoints" / "last.ckpt"
        if strategy == "ddp":  # (FSDP2's is a directory of shards and metadata)
            saved = torch.load(checkpoint, weights_only=True)["callbacks"]["RolloutPipeline"]
            assert [len(batches) for batches in saved["per_rank"]] == [1, 1]  # each rank's own prompts
            assert saved["per_rank"][0][0]["prompts"] != saved["per_rank"][1][0]["prompts"]
        resumed = run_worker(run_dir, f"async_second_half_{strategy}", 2, overrides(f"async_resumed_{strategy}", 4),
                             "--ckpt-path", str(checkpoint))
        straight = straight_run.result()
    trained = [step for step in straight["steps"] if "loss" in step]
    assert len(trained) == 4
    assert [step["async/staleness_max"] for step in trained] == [0.0, 1.0, 1.0, 1.0]
    resumed_trained = [step for step in resumed["steps"] if "loss" in step]
    assert len(resumed_trained) == 2
    for name in ["loss", "reward", "reward_std", "async/staleness_max", "grad_norm"]:
        for got, expected in zip(resumed_trained, trained[2:]):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    for name, expected in straight["state"].items():
        torch.testing.assert_close(resumed["state"][name], expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_staleness": -1}, "model.max_staleness must be at least 0"),
        ({"max_staleness": 1, "steps_per_generation": 2}, "model.max_staleness (1) is below"),
        # max_staleness > 0 with tools, environments and dynamic sampling: still refused for the reasons that stay
        ({"max_staleness": 1, "dynamic_sampling": True, "steps_per_generation": 2}, "model.max_staleness (1) is below"),
        ({"max_staleness": 2, "tools": ["x.py:f"], "environment": {"name": "e"}, "dynamic_sampling": True,
          "vllm_importance_sampling_correction": False}, "model.vllm_importance_sampling_correction: false"),
    ],
)
def test_settings_async_grpo_cannot_run_with_fail_naming_the_key(settings, message):
    from types import SimpleNamespace

    hp = SimpleNamespace(**{"num_iterations": 1, "steps_per_generation": 1, "dynamic_sampling": False, "tools": None,
                            "environment": None, **settings})
    with pytest.raises(ConfigError) as error:
        check_async_settings(hp)
    assert message in str(error.value)


def test_async_grpo_runs_with_tools_environments_and_dynamic_sampling():
    """Refused before issue 55 (tests/rollout/test_async_tools.py runs them)."""
    from types import SimpleNamespace

    check_async_settings(SimpleNamespace(max_staleness=1, num_iterations=1, steps_per_generation=1, dynamic_sampling=True,
                                         tools=["x.py:f"], environment={"name": "e"}, vllm_importance_sampling_correction=True))


def pipeline_holding(*prompts: str) -> RolloutPipeline:
    """A one-step-off pipeline with one batch of ``prompts`` in flight, not sampled yet."""
    pipeline = RolloutPipeline(max_staleness=1, optimizer_steps_per_batch=1)
    pipeline.in_flight.append(InFlight(PromptBatch(list(prompts), {"target": ["x"] * len(prompts)}), {"generate": 0.0}))
    return pipeline


def test_a_checkpoint_before_the_first_step_after_a_resume_keeps_the_restored_batches():
    """The restored batches are shared out at the first training step; a checkpoint written before it
    (a server lost during the sanity validation) holds them still, not an empty pipeline."""
    state = pipeline_holding("Say a:", "Say b:").state_dict()
    assert [batch["prompts"] for batch in state["per_rank"][0]] == [["Say a:", "Say b:"]]
    resumed = RolloutPipeline(max_staleness=1, optimizer_steps_per_batch=1)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state


def save_pipeline_state_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo processes: a batch of this rank's own prompts in flight, then a checkpoint's state."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.save(pipeline_holding(f"Say {rank}:").state_dict(), Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_a_checkpoint_gathers_every_ranks_batches_in_flight_to_the_writer_only(tmp_path):
    """Rank 0 writes the checkpoint: it holds both ranks' batches, each under its rank; rank 1 holds
    none of rank 0's (a gather to the writer, not an all-gather to every rank)."""
    torch.multiprocessing.spawn(save_pipeline_state_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    writer = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert [[batch["prompts"] for batch in batches] for batches in writer["per_rank"]] == [[["Say 0:"]], [["Say 1:"]]]
    assert torch.load(tmp_path / "rank1.pt", weights_only=True)["per_rank"] is None


def test_a_reward_that_raises_in_the_background_on_one_rank_stops_both_ranks_with_a_checkpoint(tiny_model_dir, tmp_path):
    """2 processes (gloo DDP), k = 1: rank 1's reward raises, in the background, on the batch sampled
    while the pipeline fills. Both ranks stop at the next step, where they agree on it (no rank left
    waiting in a collective), each with one line naming the rank and the error; the checkpoint holds
    the batch (its prompts and completions), to score again after the resume."""
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(textwrap.dedent("""
        import os

        def broken_on_rank_1(completions, **kwargs):
            if os.environ["RANK"] == "1":
                raise ValueError("rank 1's reward broke")
            return [float(len(text) % 3) for text in completions]
    """))
    config = async_config(tiny_model_dir, tmp_path, max_staleness=1)
    config["trainer"].update(devices=2, strategy="ddp")
    config["model"]["rewards"] = [{"name": f"{reward_file}:broken_on_rank_1"}]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "lit_grpo.cli", "fit", "--config", str(tmp_path / "config.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    stopped = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)  # a hang fails here
    assert stopped.returncode != 0
    # one message per rank (the reward's error spans lines: its frames, then what to set)
    # (two processes share one stderr pipe: a message can start right after the other's last word)
    errors = re.split(r"error: (?=the background job)", stopped.stderr)[1:]
    assert len(errors) == 2, stopped.stderr[-5000:]
    for message in errors:
        assert message.startswith("the background job of the asynchronous pipeline (model.max_staleness) failed on "
                                  "rank 1: RewardError: "), message
        assert "rank 1's reward broke" in message and "; checkpoint: " in message and "--ckpt_path last" in message
    saved = checkpoint_at(tmp_path)
    assert saved["global_step"] == 0  # stopped in the first step after the fill, before its optimizer step
    (rank_0_batch,), (rank_1_batch,) = saved["callbacks"]["RolloutPipeline"]["per_rank"]
    assert rank_0_batch["rewards_per_func"] is not None  # scored: trained after the resume
    assert len(rank_1_batch["prompts"]) == 2 and rank_1_batch["rewards_per_func"] is None  # failed: scored again
    assert rank_1_batch["rollout"]["completion_ids"].size(0) == 2 * 4


SIGNAL_HELPERS = '''
import os
import signal

from lightning.pytorch.callbacks import Callback


class SigtermAtFirstBatch(Callback):
    """SIGTERM to this process as the first training step starts: one that only fills the pipeline."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)
'''


SLOW_REWARD = '''
import json
import time
from pathlib import Path

CHECKPOINT = Path("runs/resume/version_0/checkpoints/last.ckpt")
BATCHES = Path("batches.json")  # the batches scored, in order (the reward may run in a process of its own)


def slow_second_batch(prompts, completions, **kwargs):
    """The second batch ever scored is held until a checkpoint is written (or 30 s), once."""
    batches = json.loads(BATCHES.read_text()) if BATCHES.exists() else []
    batch = sorted(set(prompts))
    if batch not in batches:
        batches.append(batch)
        BATCHES.write_text(json.dumps(batches))
    if batches.index(batch) == 1 and not Path("slow.json").exists():
        start, started_at = time.monotonic(), time.time()
        while not (CHECKPOINT.exists() and CHECKPOINT.stat().st_mtime > started_at) and time.monotonic() - start < 30:
            time.sleep(0.05)
        Path("slow.json").write_text(json.dumps({"waited": time.monotonic() - start}))
    return [float(len(text) % 3) for text in completions]
'''


def test_signals_while_the_pipeline_fills_and_while_a_slow_reward_scores_checkpoint_at_once(tiny_model_dir, tmp_path,
                                                                                              monkeypatch):
    """k = 1, three runs of one training directory. 1: SIGTERM in the first step, which only fills the
    pipeline (samples a batch, takes no optimizer step): the run stops with the path of a checkpoint
    that exists (step 0, the batch in flight). 2: resumed, with a reward that holds the second batch
    until a checkpoint is written, SIGTERM in the step that trains the first: the signal's checkpoint
    waits 1 s (``in_flight_wait_seconds``) for the scoring, then saves the sampled batch unscored. 3:
    resumed, it scores that batch and trains it."""
    (tmp_path / "signal_helpers.py").write_text(SIGNAL_HELPERS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    reward_file = tmp_path / "slow_reward.py"
    reward_file.write_text(SLOW_REWARD)
    config = async_config(tiny_model_dir, tmp_path, max_staleness=1)
    config["trainer"]["max_steps"] = 2
    config["model"]["rewards"] = [{"name": f"{reward_file}:slow_second_batch"}]
    config["trainer"]["callbacks"] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",  # last.ckpt only on the signals
         "init_args": {"every_n_train_steps": 100, "save_last": True, "save_top_k": 0}},
        {"class_path": "lit_grpo.run.preemption.CheckpointOnSignal", "init_args": {"in_flight_wait_seconds": 1.0}},
    ]

    def with_callback(callback: dict) -> dict:
        return {**config, "trainer": {**config["trainer"], "callbacks": [*config["trainer"]["callbacks"], callback]}}

    directory = tmp_path / "run"
    directory.mkdir()
    stopped = lit_grpo_fit(directory, with_callback({"class_path": "signal_helpers.SigtermAtFirstBatch"}))
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-5000:]
    line = next(line for line in stopped.stderr.splitlines() if line.startswith("stopped by SIGTERM"))
    path = line.split("checkpoint: ")[1].split(";")[0]
    assert path.endswith("last.ckpt") and (directory / path).is_file(), line
    saved = checkpoint_at(directory)
    assert saved["global_step"] == 0
    (first,) = saved["callbacks"]["RolloutPipeline"]["per_rank"][0]

    stopped = lit_grpo_fit(directory, with_callback({"class_path": "resume_helpers.SignalDuringStep",
                                                     "init_args": {"signal_name": "SIGTERM", "after_step": 0}}),
                           "--ckpt_path", "last")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-5000:]
    # the reward started on the second batch while the first trained; the checkpoint came 1 s after that
    # step, not after the reward (measured: about 3 s on a busy 2-core machine; 30 without the bound)
    assert json.loads((directory / "slow.json").read_text())["waited"] < 10
    saved = checkpoint_at(directory)
    assert saved["global_step"] == 1
    (second,) = saved["callbacks"]["RolloutPipeline"]["per_rank"][0]
    assert second["rollout"] is not None and second["rewards_per_func"] is None  # sampled, not scored

    resumed = lit_grpo_fit(directory, config, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert sorted(logged_scalars(directory / "runs/resume/version_0")["reward"]) == [1, 2]
    assert trained_prompts(directory) == [prompt for batch in (first, second) for prompt in batch["prompts"] for _ in range(4)]


ERRORS_REWARD = '''
import json
from pathlib import Path

BATCHES = Path("batches.txt")  # (the reward may run in a process of its own)
FAILING = Path("failing.json")


def fails_on_the_second_batch(prompts, completions, **kwargs):
    """Raises on every sample of the second batch scored (called with the batch, then each sample)."""
    if len(completions) > 1:
        with BATCHES.open("a") as batches:
            batches.write("batch\\n")
        if len(BATCHES.read_text().splitlines()) == 2:
            FAILING.write_text(json.dumps(sorted(set(prompts))))
    if FAILING.exists() and set(prompts) <= set(json.loads(FAILING.read_text())):
        raise ValueError("the second batch")
    return [float(len(text) % 3) for text in completions]
'''


def test_reward_errors_are_logged_at_the_step_that_trains_the_batch(tiny_model_dir, tmp_path):
    """k = 1: the second batch's 2 x 4 samples fail (``on_error: zero``); it is scored during step 1
    (which trains the first) and trained at step 2, where ``rewards/<name>/errors`` counts them."""
    reward_file = tmp_path / "errors_reward.py"
    reward_file.write_text(ERRORS_REWARD)
    config = async_config(tiny_model_dir, tmp_path, max_staleness=1)
    config["trainer"]["max_steps"] = 2
    config["model"]["rewards"] = [{"name": f"{reward_file}:fails_on_the_second_batch", "on_error": "zero"}]
    logged = run(tmp_path / "run", config)
    (tag,) = [tag for tag in logged if tag.startswith("rewards/") and tag.endswith("/errors")]
    assert logged[tag] == {1: 0.0, 2: 8.0}


def test_the_scoring_thread_reads_and_makes_only_cpu_tensors(tiny_model_dir):
    """Issue 49.13's guard (bench/gpu_check.py runs the same on CUDA): every rollout the background
    thread scores, and the rewards it makes, are on the CPU, so that the thread never syncs with the
    trainer's device."""
    from bench.gpu_check import scoring_thread_devices

    seen = scoring_thread_devices(tiny_model_dir, "cpu", steps=2)
    assert seen["devices"] == ["cpu"]
    assert seen["threads"] and all(name.startswith("lit-grpo-scoring") for name in seen["threads"])


def test_a_pipeline_checkpoint_of_another_number_of_processes_is_refused_when_loaded():
    """At the start of the resumed run (callbacks load before validation or any step), in one line."""
    pipeline = RolloutPipeline(max_staleness=1, optimizer_steps_per_batch=1)
    with pytest.raises(ConfigError, match=r"the asynchronous pipeline \(model.max_staleness\) of 2 process\(es\) and this "
                                          r"run has 1: .* resume with 2 process\(es\)"):
        pipeline.load_state_dict({"per_rank": [[], []], "dropped_stale": 0})
    pipeline.load_state_dict({"per_rank": [[]], "dropped_stale": 3})  # its own number: kept to restore
