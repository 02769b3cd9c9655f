"""Sequence parallelism (``model.sequence_parallel_size``, lit_grpo.train.sequence_parallel) on 2 CPU
processes (gloo): the hidden states and gradients of the Ulysses forward equal one process's padded
forward; a training run with k = 2 equals one process with k = 1 on the union of the rows (loss,
metrics, weights); a failure inside one rank's forward ends every rank within a bound; and what
cannot run is refused in one line."""

from __future__ import annotations

import csv
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from test_distributed import (
    COMPARED_METRICS,
    GLOBAL_BATCH,
    STRATEGIES,
    run_worker,
    start_worker,
    write_run_dir,
)

from lit_grpo.errors import ConfigError
from lit_grpo.rollout.records import position_ids_from_mask
from lit_grpo.train import sequence_parallel
from lit_grpo.train.sequence_parallel import SequenceParallel, check_model, check_settings

REPO = Path(__file__).resolve().parents[2]

# three rows: left-padded prompts, right-padded completions; 5 + 7 + 3 = 15 real tokens (odd: k pads one)
INPUT_IDS = torch.tensor([[0, 0, 11, 12, 13, 14, 15, 0], [21, 22, 23, 24, 25, 26, 27, 0], [0, 0, 0, 31, 32, 33, 0, 0]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 0, 0]])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def padded_hidden_and_grads(model_dir: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, the padded forward: hidden states ``[n, L, H]`` (0 at padding) and the gradients of
    a weighted sum of them."""
    from transformers import AutoModelForCausalLM

    from lit_grpo import models

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    head = models.output_head(model)
    hidden = models.decoder_hidden_states(model, head, input_ids=INPUT_IDS, attention_mask=MASK,
                                          position_ids=position_ids_from_mask(MASK), use_cache=False)
    hidden = hidden * MASK.unsqueeze(-1)
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
    (hidden * weights).sum().backward()
    return hidden.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def sequence_parallel_worker(rank: int, port: int, model_dirs: list[str], out: str, fail_on_rank: int | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from datetime import timedelta

    from transformers import AutoModelForCausalLM

    from lit_grpo import models

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    try:
        sp = SequenceParallel.of_world(2)

        def forward_and_backward(model: torch.nn.Module) -> dict:
            hidden = sp.hidden_states(model, models.output_head(model), input_ids=INPUT_IDS, attention_mask=MASK)  # [n, L, H]
            weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
            (hidden * weights).sum().backward()
            return {"hidden": hidden.detach(), "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}

        for index, model_dir in enumerate(model_dirs):  # one pair of processes for every model: they start slowly
            torch.save(forward_and_backward(AutoModelForCausalLM.from_pretrained(model_dir)), f"{out}.{index}.{rank}")
        # the update's shuffle: each rank's own random stream (seeded apart here), one generator on both
        torch.manual_seed(100 + rank)
        torch.save(torch.randperm(16, generator=sp.shared_generator(torch.device("cpu"))), f"{out}.shuffle.{rank}")
        if fail_on_rank is not None:  # then one rank's layer raises inside a forward
            model = AutoModelForCausalLM.from_pretrained(model_dirs[0])
            if fail_on_rank == rank:
                def broken(*args, **kwargs):
                    raise RuntimeError("layer broke on rank 1")
                model.model.layers[1].mlp.forward = broken
            Path(f"{out}.{rank}.failing_forward").write_text(str(time.time()))
            forward_and_backward(model)
    except Exception as error:  # what the parent checks: every rank ended with an error
        Path(f"{out}.{rank}.error").write_text(f"{type(error).__name__}: {error}")
        raise
    finally:
        dist.destroy_process_group()


def spawn(model_dirs: list[Path], out: Path, fail_on_rank: int | None = None) -> mp.ProcessContext:
    context = mp.start_processes(sequence_parallel_worker, args=(free_port(), [str(path) for path in model_dirs], str(out), fail_on_rank),
                                 nprocs=2, join=False, start_method="spawn")
    return context


def join_within(context: mp.ProcessContext, seconds: float, grace_period: float | None = None) -> None:
    """``context.join`` until every process ended (raising for the first that failed), failing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5, grace_period=grace_period):
        assert time.monotonic() < deadline, f"the processes did not end within {seconds} s"


@pytest.fixture(scope="module")
def one_kv_head_model_dir(tmp_path_factory):
    """The tiny model with 1 key/value head (4 query heads): fewer kv heads than k = 2."""
    from lit_grpo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-one-kv-head"), num_key_value_heads=1)


def test_ulysses_forward_and_gradients_equal_the_padded_forward_and_a_failure_in_one_rank_ends_every_rank(
        tiny_model_dir, one_kv_head_model_dir, tmp_path):
    """Two ranks (k = 2) each run the body on half of the three rows' 15 packed tokens (padded to 16);
    the gathered hidden states equal one process's padded forward, and the gradients, summed over the
    two ranks and divided by k (DDP's average), equal that forward's: every head of the tiny model's
    4 query and 2 key/value heads crossed the all-to-all. The same with 1 key/value head, which each
    rank repeats for its query heads (fewer kv heads than k). The two ranks' shuffles of the update
    agree. Then (the same processes: they start slowly) rank 1's layer raises inside a forward: rank 1
    ends with its error, and rank 0, waiting in the next all-to-all, ends with an error too (the peer
    gone or the process group's 20 s timeout), well within 120 s: nothing hangs."""
    model_dirs = [tiny_model_dir, one_kv_head_model_dir]
    context = spawn(model_dirs, tmp_path / "sp", fail_on_rank=1)
    # the first rank to end with an error, either one; the other gets 60 s to end by itself before a SIGTERM
    with pytest.raises(mp.ProcessRaisedException):
        join_within(context, 240, grace_period=60)
    for process in context.processes:  # both ended with their error (exit code 1), neither by a signal
        process.join(timeout=5)
        assert process.exitcode == 1, (process.pid, process.exitcode)
    failing_since = min(float((tmp_path / f"sp.{rank}.failing_forward").read_text()) for rank in range(2))
    assert time.time() - failing_since < 120
    assert "layer broke on rank 1" in (tmp_path / "sp.1.error").read_text()
    # rank 0 waited in a collective of the forward: its peer's crash (or the timeout) ended it
    assert (tmp_path / "sp.0.error").read_text().startswith(("RuntimeError", "DistBackendError"))
    for index, model_dir in enumerate(model_dirs):
        check_ulysses_against_padded(model_dir, [torch.load(tmp_path / f"sp.{index}.{rank}", weights_only=False) for rank in range(2)])
    # the group's ranks shuffle the union's rows alike, as the first rank's random stream (seed 100) draws
    # (the update's micro-batches must hold the same rows on both: steps_per_generation > 1)
    shuffles = [torch.load(tmp_path / f"sp.shuffle.{rank}") for rank in range(2)]
    first_rank, second_rank = (shuffle_from_stream(seed) for seed in (100, 101))
    assert torch.equal(shuffles[0], first_rank) and torch.equal(shuffles[1], first_rank)
    assert not torch.equal(first_rank, second_rank)  # rank 1's own stream would have shuffled otherwise


def shuffle_from_stream(seed: int) -> torch.Tensor:
    """What :meth:`SequenceParallel.shared_generator` draws on a rank whose random stream has ``seed``."""
    stream = torch.Generator().manual_seed(seed)  # as torch.manual_seed(seed)'s global CPU stream
    return torch.randperm(16, generator=torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=stream))))


def check_ulysses_against_padded(model_dir: Path, ranks: list[dict]) -> None:
    expected_hidden, expected_grads = padded_hidden_and_grads(str(model_dir))
    for result in ranks:
        torch.testing.assert_close(result["hidden"], expected_hidden, rtol=1e-5, atol=1e-5)
    assert expected_hidden.abs().sum() > 0
    for name, expected in expected_grads.items():
        average = (ranks[0]["grads"][name] + ranks[1]["grads"][name]) / 2  # DDP's average over W = 2 ranks
        # fp32 sums in another order: within 1e-6 of the gradient's largest entry (a lost or doubled part: ~1)
        scale = float(expected.abs().max())
        torch.testing.assert_close(average, expected, rtol=1e-5, atol=1e-6 * scale, msg=lambda text, name=name: f"{name}: {text}")
    # each rank holds part of the body's gradient: neither rank alone has it
    attention = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(ranks[0]["grads"][attention], expected_grads[attention], atol=1e-6)


def hparams(**changes) -> SimpleNamespace:
    settings = {"sequence_parallel_size": 2, "max_staleness": 0, "gradient_checkpointing": False, "share_prompt_forward": "auto",
                "tools": None, "environment": None}
    return SimpleNamespace(**{**settings, **changes})


@pytest.mark.parametrize("changes, world_size, message", [
    ({}, 3, r"number of processes \(3\) must be a multiple of model.sequence_parallel_size \(2\)"),
    ({"max_staleness": 1}, 2, "model.max_staleness > 0"),
    ({"gradient_checkpointing": True}, 2, "model.gradient_checkpointing"),
    ({"share_prompt_forward": True}, 2, "model.share_prompt_forward: true"),
    ({"tools": ["math:sqrt"]}, 2, "model.tools"),
    ({"sequence_parallel_size": 0}, 2, "must be at least 1"),
    # every refusal that applies is named, not only the last
    ({"max_staleness": 1, "tools": ["math:sqrt"]}, 3, r"processes \(3\).*; model.max_staleness > 0.*; model.tools"),
])
def test_settings_that_cannot_run_are_refused_in_one_line(changes, world_size, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_settings(hparams(**changes), world_size)
    assert "\n" not in str(error.value)
    check_settings(hparams(), 4)  # fine
    check_settings(hparams(sequence_parallel_size=1, max_staleness=3), 3)  # off: nothing refused


def test_heads_that_k_does_not_divide_are_refused_naming_the_models_head_counts(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # 4 query heads, 2 key/value heads
    check_model(model, 2)
    check_model(model, 4)  # kv heads repeated
    with pytest.raises(ConfigError, match=r"num_attention_heads 4, num_key_value_heads 2"):
        check_model(model, 3)


def test_the_attention_function_refuses_to_run_outside_a_sequence_parallel_forward():
    query = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="only inside SequenceParallel.hidden_states"):
        sequence_parallel.ulysses_attention(torch.nn.Module(), query, query, query, None)
    # a sliding window, soft-capped logits or attention sinks would be ignored: refused instead
    with pytest.raises(RuntimeError, match="'lit_ulysses' cannot apply sliding_window, s_aux"):
        sequence_parallel.ulysses_attention(torch.nn.Module(), query, query, query, None, sliding_window=3, s_aux=torch.zeros(2))


def test_sliding_window_and_soft_capped_attention_are_refused_in_one_line(tiny_model_dir):
    """The Ulysses attention is full causal attention within each row: a Mistral with a 3-token
    window, or attention logits soft-capped (Gemma 2), would train on other values than the model's."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=3))
    with pytest.raises(ConfigError, match=r"^model.sequence_parallel_size 2: MistralForCausalLM has sliding-window attention, "):
        check_model(mistral, 2)
    capped = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    capped.config.attn_logit_softcapping = 50.0
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM has soft-capped attention logits \(attn_logit_softcapping 50.0\)"):
        check_model(capped, 2)


def test_forwards_without_the_fused_head_say_once_that_they_are_not_split(tiny_model_dir, monkeypatch):
    """A head not known to be linear: the log-probs come from the model's full logits, which every rank
    of the group computes whole (no sequence split, no memory saved): the log line says so, once."""
    from transformers import AutoModelForCausalLM

    import lit_grpo.models
    import lit_grpo.train.logprob_passes
    from lit_grpo.settings import (
        EvaluationSettings,
        GenerationSettings,
        LogProbSettings,
        LossSettings,
        RunSettings,
        SamplingSettings,
        ToolSettings,
        UpdateSettings,
    )
    from lit_grpo.train.logprob_passes import LogProbPasses

    monkeypatch.setattr(lit_grpo.models, "FUSED_HEAD_MODEL_TYPES", frozenset())
    messages = []
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "rank_zero_info", messages.append)
    settings = RunSettings(loss=LossSettings(max_completion_length=8), sampling=SamplingSettings(), logprobs=LogProbSettings(), generation=GenerationSettings(),
                           update=UpdateSettings(), tools=ToolSettings(), evaluation=EvaluationSettings(num_generations_eval=1))
    passes = LogProbPasses(settings, None, None, lambda: 1.0)
    passes.sequence_parallel = SimpleNamespace(size=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert passes.fused_head(model) is None and passes.fused_head(model) is None
    (message,) = messages
    assert message.endswith("; model.sequence_parallel_size 2: each rank runs these forwards whole, no sequence split, no memory saved")


def test_the_gpu_checks_shared_shuffle_part_runs_its_mechanics_on_a_gloo_group():
    """bench/gpu_check.py broadcasts the shuffle's seed over a one-process NCCL group on CUDA (no CPU
    tensors there); without CUDA it is skipped, and its mechanics run on gloo."""
    from bench import gpu_check

    assert gpu_check.sequence_parallel_seed_check("cpu") == {"skipped": "no CUDA"}
    row = gpu_check.sequence_parallel_seed_check("cpu", backend="gloo", cuda_only=False)
    assert row == {"ok": True, "backend": "gloo", "generator_device": "cpu"}
    assert not dist.is_initialized()


# --------------------------------------------------------------------------------------------------
# Training through the CLI (tests/distributed_worker.py, as test_distributed.py runs it)
# --------------------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def sp_run_dir(tmp_path_factory, tiny_model_dir):
    """test_distributed's base config (KL to a reference model, 2 iterations, dapo, batch-scaled rewards) and prompts."""
    return write_run_dir(tmp_path_factory.mktemp("sequence_parallel"), tiny_model_dir)


@pytest.fixture(scope="module")
def one_process_run(sp_run_dir):
    """One process, k = 1, on the global batch: the rows the two ranks of a k = 2 group hold together."""
    overrides = {"trainer": {"devices": 1}, "data": {"batch_size": GLOBAL_BATCH}}
    return run_worker(sp_run_dir, "sp_single", 1, overrides, "--fixed-completions")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_with_k_2_train_exactly_as_one_process_on_the_union_of_their_rows(sp_run_dir, one_process_run, strategy):
    """Two processes, ``sequence_parallel_size: 2``: each rank samples its own 2 prompts (x 4
    completions), the group trains on the union of the 16 rows, each rank running the body on half of
    every forward's packed tokens. The loss, KL, clip fractions, entropy, rewards and gradient norm of
    every step and the weights after 4 optimizer steps (AdamW at lr 0.01, dapo normaliser, KL to a
    reference model, batch-scaled rewards) equal one process with k = 1 on those 16 rows."""
    overrides = {"trainer": {"devices": 2, "strategy": STRATEGIES[strategy]}, "data": {"batch_size": GLOBAL_BATCH // 2},
                 "model": {"sequence_parallel_size": 2}}
    finished = start_worker(sp_run_dir, f"sp_{strategy}", 2, overrides, "--fixed-completions")
    assert finished.returncode == 0, finished.stderr[-6000:]
    # the forwards went through the Ulysses attention: rank 0 says so at the first one
    assert re.search(r"model.sequence_parallel_size 2: the first forward's \d+ packed tokens run \d+ on each rank",
                     finished.stdout + finished.stderr)
    two = torch.load(sp_run_dir / f"sp_{strategy}.pt", weights_only=False)
    one = one_process_run
    assert two["world_size"] == 2 and one["world_size"] == 1
    # each rank runs every micro-batch of the union: 2 generation batches x 2 iterations x 4 micro-batches
    assert one["backward_passes"] == two["backward_passes"] == 2 * 2 * 4
    assert len(one["steps"]) == len(two["steps"]) == 2
    for step, (expected, actual) in enumerate(zip(one["steps"], two["steps"])):
        assert set(COMPARED_METRICS) <= set(expected) and set(actual) == set(expected)
        # every metric but the seconds, the throughput and the CPU threads each process was given
        for name in [name for name in expected if not name.startswith(("time/", "step_time", "tokens_per_second", "cpu/"))]:
            assert actual[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), (step, name)
        # the completion tokens behind tokens_per_second: those of the W / k data-parallel groups, not k times them
        sampled_tokens = [metrics["tokens_per_second"] * metrics["step_time"] for metrics in (expected, actual)]
        assert sampled_tokens[1] == pytest.approx(sampled_tokens[0], rel=1e-4) and sampled_tokens[0] > 16, (step, sampled_tokens)
    # completions.jsonl holds each row once: the group's first rank gives its rows (the union), the other none
    lines = {name: sum(len(path.read_text().splitlines()) for path in (sp_run_dir / name).glob("**/completions.jsonl"))
             for name in ("sp_single", f"sp_{strategy}")}
    assert lines["sp_single"] == 2 * GLOBAL_BATCH * 4 and lines[f"sp_{strategy}"] == lines["sp_single"], lines  # 2 steps x 16 rows
    assert any(step["clip_ratio/region_mean"] > 0 for step in one["steps"])  # not vacuous
    assert all(step["kl"] > 0 for step in one["steps"][1:])
    # the gradients agree to float32 rounding (the Ulysses forward test above: 1e-6 of their scale); AdamW at lr
    # 0.01 turns that rounding into weight differences of ~4e-5 after 4 steps for a few entries whose gradient is
    # near 0 (as test_distributed's chunked runs), where a lost or doubled part moves ~1e-2
    for name, expected in one["state"].items():
        torch.testing.assert_close(two["state"][name], expected, rtol=1e-4, atol=1e-4, msg=lambda text, name=name: f"{name}: {text}")


def quickstart_config(tmp_path: Path, tiny_model_dir: Path, devices: int) -> list[str]:
    """The quickstart's config with ``sequence_parallel_size: 2`` and a CSV logger, for ``devices``
    processes; the command line of ``lit-grpo fit`` on it."""
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["model"].update(model_name_or_path=str(tiny_model_dir), sequence_parallel_size=2, num_generations=4,
                           micro_batch_size=4)
    config["data"].update(data_files=str(REPO / config["data"]["data_files"]), batch_size=2)
    config["trainer"].update(devices=devices, strategy="ddp", max_steps=2,
                             logger={"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    if devices == 1:
        return [sys.executable, "-m", "lit_grpo.cli", "fit", "--config", "config.yaml"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}",
            "-m", "lit_grpo.cli", "fit", "--config", "config.yaml"]


def test_lit_grpo_fit_on_two_processes_with_sequence_parallel_size_2_logs_its_steps(tiny_model_dir, tmp_path):
    """``lit-grpo fit`` of the quickstart on 2 processes with ``model.sequence_parallel_size: 2`` and a
    logger: both steps train (the forwards split over the two ranks) and their metrics are logged."""
    command = quickstart_config(tmp_path, tiny_model_dir, devices=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    finished = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert "model.sequence_parallel_size 2: the first forward's" in finished.stdout + finished.stderr
    # the CPU's default share_prompt_forward (auto: on) is off with it, and the log says so
    assert "model.share_prompt_forward auto: off with model.sequence_parallel_size 2" in finished.stdout + finished.stderr
    (metrics_file,) = (tmp_path / "runs").glob("**/metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    logged = [row for row in rows if row.get("loss")]
    assert [int(row["step"]) for row in logged] == [0, 1]
    for row in logged:
        assert math.isfinite(float(row["loss"])) and math.isfinite(float(row["reward"])), row
        assert float(row["completions/mean_length"]) > 0


def test_lit_grpo_fit_on_one_process_with_sequence_parallel_size_2_is_refused_in_one_line(tiny_model_dir, tmp_path):
    command = quickstart_config(tmp_path, tiny_model_dir, devices=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    finished = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert finished.returncode == 2, finished.stderr[-3000:]
    assert ("error: model.sequence_parallel_size 2: the number of processes (1) must be a multiple of "
            "model.sequence_parallel_size (2)") in finished.stderr
