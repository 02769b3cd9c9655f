"""Several processes on CPU (gloo): DDP and FSDP2 (Lightning's ModelParallelStrategy) give the same
losses and the same updated weights as one process on the same global batch, and FSDP2 generation
gathers the weights once per ``generate`` call, whatever the completion lengths of each rank.

The runs go through ``tests/distributed_worker.py``: the CLI with a YAML config, launched with
``torch.distributed.run`` exactly as a user launches a multi-process run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from lit_grpo.data import PromptSampler

REPO = Path(__file__).resolve().parents[2]

WORKER = Path(__file__).resolve().parents[1] / "distributed_worker.py"

# Everything that matters for the comparison: KL to a sharded reference model (beta > 0), a
# second pass over each generation batch (old log-probs, clipping at a large learning rate),
# batch-level reward scaling (needs the rewards of every rank), micro-batches (the dapo normaliser
# counts the tokens of the whole generation batch across ranks) and gradient clipping.
BASE_CONFIG = {
    "seed_everything": 0,
    # what a user's run has: the default logger (TensorBoard), checkpoints, completions logged and saved
    "trainer": {"max_steps": 4, "accelerator": "cpu", "log_every_n_steps": 1},
    "model": {
        "num_generations": 4,
        "max_completion_length": 8,
        "num_iterations": 2,
        "micro_batch_size": 4,
        "loss_type": "dapo",
        "beta": 0.04,
        "scale_rewards": "batch",
        "max_grad_norm": 1.0,
        "log_completions_every_n_steps": 1,
        "rewards": [{"name": "char_fraction", "args": {"chars": "abcdefghijklm"}}],
    },
    "data": {"path": "json", "prompt_column": "prompt", "shuffle": True, "seed": 3},
    "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
}
GLOBAL_BATCH = 4
STRATEGIES = {
    "ddp": "ddp",
    "fsdp2": {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
    },
}
COMPARED_METRICS = ["loss", "reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean", "grad_norm"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    return write_run_dir(tmp_path_factory.mktemp("distributed"), tiny_model_dir)


def write_run_dir(path: Path, tiny_model_dir: Path) -> Path:
    """``path`` with BASE_CONFIG for the tiny model (``base.yaml``) and its 12 prompts (``prompts.jsonl``)."""
    rows = [{"prompt": f"Say {c} {i}:"} for i, c in enumerate("abcdefghijkl")]
    (path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = json.loads(json.dumps(BASE_CONFIG))
    config["model"]["model_name_or_path"] = str(tiny_model_dir)
    config["data"]["data_files"] = str(path / "prompts.jsonl")
    (path / "base.yaml").write_text(yaml.safe_dump(config))
    return path


def run_worker(run_dir: Path, name: str, processes: int, overrides: dict, *flags: str) -> dict:
    result = start_worker(run_dir, name, processes, overrides, *flags)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return torch.load(run_dir / f"{name}.pt", weights_only=False)


def start_worker(run_dir: Path, name: str, processes: int, overrides: dict, *flags: str) -> subprocess.CompletedProcess:
    # each run logs and checkpoints in its own directory, as a user's run under default_root_dir
    trainer = {"default_root_dir": str(run_dir / name), **overrides.get("trainer", {})}
    (run_dir / f"{name}.yaml").write_text(yaml.safe_dump({**overrides, "trainer": trainer}))
    out = run_dir / f"{name}.pt"
    script = [str(WORKER), "--config", "base.yaml", "--config", f"{name}.yaml", "--out", str(out), *flags]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *script]
    else:
        command = [sys.executable, *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}  # a crash shows its Python stack
    # a deadlock shows up as this timeout
    return subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)


VARIANTS = {
    "full": {},
    # LoRA: the adapter trains sharded and the reference is the sharded base model (adapter off)
    "lora": {"lora": {"r": 4, "lora_alpha": 8}},
    # the reference follows the policy after every optimizer step, shard by shard
    "ref_sync": {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
    # micro-batches of 4 rows above the token budget go forward and backward in chunks; compared
    # with the one-process run of "full" (one pass per micro-batch)
    "chunked": {"forward_token_budget": 30},
    "chunked_shared": {"forward_token_budget": 30},  # and the prompts encoded once for all chunks
    # rank 0 would give prompts their own forward and rank 1 would not: under FSDP2 (a collective per
    # forward) they must agree; compared with the one-process run of "full" (nobody shares)
    "sharing_disagrees": {},
}
# variants whose log-prob forwards run each distinct prompt once (share_prompt_forward, forced on for
# these short prompts) on both the one- and the two-process run; the others run every row's prompt
SHARED_PROMPT_VARIANTS = {"lora", "ref_sync", "chunked_shared"}
CHUNKED_VARIANTS = {"chunked", "chunked_shared"}


def variant_flags(variant: str) -> list[str]:
    if variant == "sharing_disagrees":
        return ["--fixed-completions", "--share-prompts-on-rank-0-only"]
    return ["--fixed-completions", *(["--share-prompts-always"] if variant in SHARED_PROMPT_VARIANTS else [])]


@pytest.fixture(scope="module")
def single_process_runs(run_dir):
    """One-process reference runs, by variant: started on first use, beside the test's own runs (their
    imports overlap on CI's 2 cores); ``.result()`` waits for one."""
    runs = {}

    def get(variant: str) -> Future:
        if variant not in runs:
            overrides = {"trainer": {"devices": 1}, "data": {"batch_size": GLOBAL_BATCH}, "model": VARIANTS[variant]}
            runs[variant] = beside.submit(run_worker, run_dir, f"single_{variant}", 1, overrides, *variant_flags(variant))
        return runs[variant]

    with ThreadPoolExecutor(1) as beside:
        yield get


@pytest.mark.parametrize(
    "strategy, variant",
    [
        ("ddp", "full"), ("fsdp2", "full"), ("fsdp2", "lora"), ("fsdp2", "ref_sync"),
        ("ddp", "chunked"), ("fsdp2", "chunked"), ("ddp", "chunked_shared"), ("fsdp2", "chunked_shared"),
        ("fsdp2", "sharing_disagrees"),
    ],
)
def test_two_processes_match_one_process(run_dir, single_process_runs, tiny_model_dir, strategy, variant):
    overrides = {
        "trainer": {"devices": 2, "strategy": STRATEGIES[strategy]},
        "data": {"batch_size": GLOBAL_BATCH // 2},
        "model": VARIANTS[variant],
    }
    one_run = single_process_runs("full" if variant in CHUNKED_VARIANTS | {"sharing_disagrees"} else variant)
    two = run_worker(run_dir, f"{strategy}_{variant}", 2, overrides, *variant_flags(variant))
    one = one_run.result()
    assert two["world_size"] == 2 and one["world_size"] == 1
    # 4 optimizer steps (2 generation batches x 2 iterations) over 16 rows: micro-batches of 4 rows
    # are 4 backward passes per step in one process, 2 per rank in two
    assert one["backward_passes"] == 2 * 2 * 4
    if variant in CHUNKED_VARIANTS:
        assert two["backward_passes"] > 2 * 2 * 2  # rank 0's micro-batches went backward in chunks
    else:
        assert two["backward_passes"] == 2 * 2 * 2

    # the same metrics at every step (2 generation batches, 2 optimizer steps each)
    assert len(one["steps"]) == len(two["steps"]) == 2
    for step, (expected, actual) in enumerate(zip(one["steps"], two["steps"])):
        for name in COMPARED_METRICS:
            assert actual[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), (step, name)
    # the comparison is not vacuous: rewards vary, the update clips, the KL term is active
    assert any(step["reward_std"] > 0 for step in one["steps"])
    assert any(step["clip_ratio/region_mean"] > 0 for step in one["steps"])
    assert all(step["kl"] > 0 for step in one["steps"][1:])

    # the same updated weights, which moved away from the initial ones
    from transformers import AutoModelForCausalLM

    assert one["state"].keys() == two["state"].keys()
    # chunks sum the gradient in another order; Adam (lr 0.01) turns that rounding into weight
    # differences of ~2e-5 after 4 steps, where a lost or doubled chunk would move weights by ~1e-2
    atol = 1e-4 if variant in CHUNKED_VARIANTS else 1e-5
    for name, expected in one["state"].items():
        torch.testing.assert_close(two["state"][name], expected, rtol=1e-4, atol=atol, msg=name)
    if variant == "lora":  # the adapter moved (LoRA's B starts at zero)
        adapters = [name for name in one["state"] if "lora_B" in name]
        assert adapters and max(one["state"][name].abs().max().item() for name in adapters) > 1e-3
    else:
        initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        moved = max((one["state"][name] - initial[name]).abs().max().item() for name in initial)
        assert moved > 1e-3


# beta 0 and a reward that is constant for a third of the prompts (the worker's gated reward)
GATED_MODEL = {"beta": 0.0, "rewards": [{"name": "gated"}], "micro_batch_size": 8}
GATED_FLAGS = ["--fixed-completions", "--gated-reward", "--share-prompts-always"]  # no forward-overhead threshold


@pytest.fixture(scope="module")
def single_process_run_training_every_row(run_dir):
    """One process on GATED_MODEL that trains every row: one run for both strategies' comparisons."""
    overrides = {"trainer": {"devices": 1}, "data": {"batch_size": GLOBAL_BATCH},
                 "model": {**GATED_MODEL, "skip_zero_gradient_rows": False}}
    return run_worker(run_dir, "single_every_row", 1, overrides, *GATED_FLAGS)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_rows_without_gradient_skipped_on_two_processes_match_one_process_training_every_row(
        run_dir, single_process_run_training_every_row, strategy):
    """beta 0 and a reward that is constant for a third of the prompts: those groups' rows (advantage
    0) skip the backward on each rank (FSDP2 ranks agree to leave out as many rows as each other);
    losses, statistics and weights equal one process that trains every row."""
    one = single_process_run_training_every_row
    overrides = {"trainer": {"devices": 2, "strategy": STRATEGIES[strategy]}, "data": {"batch_size": GLOBAL_BATCH // 2},
                 "model": GATED_MODEL}
    two = run_worker(run_dir, f"{strategy}_skipping", 2, overrides, *GATED_FLAGS)
    assert sum(one["skipped_rows"]) == 0 and sum(two["skipped_rows"]) > 0  # rank 0 left rows out
    assert any(step["frac_reward_zero_std"] > 0 for step in one["steps"])
    for step, (expected, actual) in enumerate(zip(one["steps"], two["steps"], strict=True)):
        for name in ["loss", "reward", "reward_std", "entropy", "clip_ratio/region_mean", "grad_norm"]:
            assert actual[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), (step, name)
    for name, expected in one["state"].items():
        torch.testing.assert_close(two["state"][name], expected, rtol=1e-4, atol=1e-4, msg=name)


def test_old_logps_pass_leaves_out_zero_advantage_rows_on_two_processes(run_dir):
    """steps_per_generation 2, beta 0 and a reward constant for a third of the prompts: each DDP rank's
    old-log-prob pass leaves out the later rows of those groups (advantage 0); FSDP2 ranks compute as
    many rows as the rank that needs most, so they run as many forwards. Losses, statistics and
    weights equal those of computing every row."""
    model = {"beta": 0.0, "rewards": [{"name": "gated"}], "steps_per_generation": 2}
    data = {"batch_size": GLOBAL_BATCH // 2}  # 8 completions per rank: mini-batches of 4 rows
    flags = ["--fixed-completions", "--gated-reward"]
    def overrides(strategy: str, skip: bool) -> dict:
        trainer = {"devices": 2, "strategy": STRATEGIES[strategy], "max_steps": 12}  # 3 generation batches
        return {"trainer": trainer, "data": data, "model": {**model, "skip_zero_gradient_rows": skip}}

    with ThreadPoolExecutor(1) as beside:  # the reference beside the two others: their imports overlap
        every_row_run = beside.submit(run_worker, run_dir, "old_logps_every_row", 2, overrides("ddp", False), *flags)
        ddp = run_worker(run_dir, "old_logps_ddp", 2, overrides("ddp", True), *flags)
        fsdp2 = run_worker(run_dir, "old_logps_fsdp2", 2, overrides("fsdp2", True), *flags)
        every_row = every_row_run.result()

    assert every_row["no_grad_rows"] == [[4, 4, 4], [4, 4, 4]]
    assert sum(map(sum, ddp["no_grad_rows"])) < 24 and ddp["no_grad_rows"][0] != ddp["no_grad_rows"][1]
    agreed = [max(counts) for counts in zip(*ddp["no_grad_rows"])]
    assert fsdp2["no_grad_rows"] == [agreed, agreed]
    assert any(step["frac_reward_zero_std"] > 0 for step in every_row["steps"])
    for run in (ddp, fsdp2):
        for step, (expected, actual) in enumerate(zip(every_row["steps"], run["steps"], strict=True)):
            for name in ["loss", "entropy", "clip_ratio/region_mean", "grad_norm"]:
                assert actual[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), (step, name)
        for name, expected in every_row["state"].items():
            torch.testing.assert_close(run["state"][name], expected, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_fsdp2_resume_from_sharded_checkpoint_continues_exactly(run_dir, variant):
    """Real sampling on 2 ranks: a run stopped after 2 generation batches and resumed from its sharded
    ``last.ckpt`` logs what an uninterrupted run logs (each rank's random state is restored). With
    LoRA the checkpoint holds only the adapter; the base weights come from the model path again.
    ``export_checkpoint`` writes the checkpoint's policy straight from its directory of shards."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from lit_grpo.run.export import export_checkpoint

    def overrides(name: str, max_steps: int) -> dict:
        return {
            "trainer": {
                "devices": 2,
                "strategy": STRATEGIES["fsdp2"],
                "max_steps": max_steps,
                "enable_checkpointing": True,
                "default_root_dir": str(run_dir / name),
                "callbacks": [
                    {
                        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                        "init_args": {"save_last": True, "save_top_k": 0, "every_n_train_steps": 2},
                    }
                ],
            },
            "model": {"temperature": 1.0, "num_iterations": 1, "steps_per_generation": 2, **VARIANTS[variant]},
            "data": {"batch_size": 2},
        }

    with ThreadPoolExecutor(1) as beside:  # the straight run beside the stopped and resumed ones: their imports overlap
        straight_run = beside.submit(run_worker, run_dir, f"straight_{variant}", 2, overrides(f"straight_{variant}", 6))
        run_worker(run_dir, f"first_half_{variant}", 2, overrides(f"resumed_{variant}", 4))
        checkpoint = run_dir / f"resumed_{variant}" / "lit-grpo" / "version_0" / "checkpoints" / "last.ckpt"
        resumed = resumed_from_sharded_checkpoint(run_dir, variant, checkpoint, overrides)
        straight = straight_run.result()
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = {key.removeprefix("state_dict.") for key in saved if key.startswith("state_dict.")}
    policy = {f"policy.{name}" for name in straight["state"]}
    adapter = {name for name in policy if "lora_" in name}
    if variant == "full":
        assert not adapter and policy <= weights
    else:
        assert adapter and weights == adapter  # no frozen base weight

    assert len(straight["steps"]) == 3 and len(resumed["steps"]) == 1
    for name in ["loss", "reward", "entropy", "completions/mean_length", "grad_norm"]:
        assert resumed["steps"][0][name] == pytest.approx(straight["steps"][2][name], rel=1e-5, abs=1e-7), name
    for name, expected in straight["state"].items():
        torch.testing.assert_close(resumed["state"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
    # `lit-grpo export` reads the directory of shards itself (base weights + adapter, merged, with LoRA);
    # the worker hands the checkpoint to Trainer.fit itself, so the resumed run has a directory of its own
    final_checkpoint = Path(resumed["log_dir"]) / "checkpoints" / "last.ckpt"
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(final_checkpoint, run_dir / f"exported_{variant}")).state_dict()
    state = resumed["state"]
    if variant == "full":
        assert exported.keys() == state.keys()
        for name, expected in state.items():
            torch.testing.assert_close(exported[name], expected, rtol=0, atol=0, msg=name)
    else:
        prefix = "base_model.model.model.layers.0.self_attn.q_proj."  # scaling: lora_alpha 8 / r 4
        merged = state[prefix + "base_layer.weight"] + 2.0 * state[prefix + "lora_B.default.weight"] @ state[prefix + "lora_A.default.weight"]
        assert state[prefix + "lora_B.default.weight"].abs().max() > 1e-3  # the adapter moved (B starts at 0)
        torch.testing.assert_close(exported["model.layers.0.self_attn.q_proj.weight"], merged, rtol=1e-6, atol=1e-7)


def resumed_from_sharded_checkpoint(run_dir: Path, variant: str, checkpoint: Path, overrides) -> dict:
    """The run resumed from the sharded ``checkpoint`` to step 6; with LoRA, first the resumes its adapter
    cannot take (other target modules, another rank), each refused naming why."""
    assert checkpoint.is_dir() and sorted(p.name for p in checkpoint.parent.iterdir()) == ["last.ckpt"]
    if variant == "lora":
        # resumed with fewer target modules: the saved adapters of the others have no place
        other_targets = overrides(f"resumed_{variant}", 6)
        other_targets["model"]["lora"] = {**VARIANTS["lora"]["lora"], "target_modules": ["q_proj", "v_proj"]}
        failed = start_worker(run_dir, "resumed_other_targets", 2, other_targets, "--ckpt-path", str(checkpoint))
        output = failed.stdout + failed.stderr
        assert failed.returncode != 0
        assert "The sharded checkpoint holds 20 weights this module does not have" in output  # 5 modules x 2 layers x A, B
        assert "mlp.down_proj.lora_A.default.weight" in output and "model.lora settings" in output
        # resumed with another rank: the load itself names the weight and both shapes
        other_rank = overrides(f"resumed_{variant}", 6)
        other_rank["model"]["lora"] = {**VARIANTS["lora"]["lora"], "r": 8}
        failed = start_worker(run_dir, "resumed_other_rank", 2, other_rank, "--ckpt-path", str(checkpoint))
        assert failed.returncode != 0
        assert "Size mismatch between saved torch.Size([4, 64]) and current: torch.Size([8, 64])" in failed.stdout + failed.stderr
    return run_worker(
        run_dir, f"second_half_{variant}", 2, overrides(f"resumed_{variant}", 6), "--ckpt-path", str(checkpoint)
    )


def test_fsdp2_generation_gathers_weights_once_and_ranks_finish_independently(run_dir):
    """Rank 0 decodes 2 tokens while rank 1 decodes 24: with per-step all-gathers rank 1 would wait
    forever for rank 0 (the worker's timeout); with the weights gathered once it finishes."""
    overrides = {"trainer": {"devices": 2, "strategy": STRATEGIES["fsdp2"]}, "data": {"batch_size": 2}}
    results = run_worker(run_dir, "generation", 2, overrides, "--generation-check")
    by_rank = {result["rank"]: result for result in results}
    assert by_rank[0]["completion_width"] == 2 and by_rank[1]["completion_width"] == 24
    for result in results:
        # one all-gather per FSDP unit (each decoder layer and the root), not one per decoding step
        assert result["fsdp_units"] == 3  # the tiny model has 2 decoder layers
        assert result["all_gathers"] == result["fsdp_units"]
        assert result["resharded"]  # weights sharded again after generate


def test_tensor_parallel_mesh_is_refused_with_the_keys_to_set():
    from lit_grpo.distributed import data_parallel_mesh

    class Dim:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

    mesh = {"data_parallel": Dim(1), "tensor_parallel": Dim(4)}
    with pytest.raises(ValueError, match=r"data_parallel_size\s+to the number of processes \(4\).*tensor_parallel_size to 1"):
        data_parallel_mesh(mesh)
    assert data_parallel_mesh({"data_parallel": Dim(4), "tensor_parallel": Dim(1)}) is not None


# ----------------------------------------------------------------------------------------------
# The prompt order does not depend on the number of processes
# ----------------------------------------------------------------------------------------------


def global_batches(num_replicas: int, **kwargs) -> list[list[int]]:
    samplers = [PromptSampler(10, 2, num_replicas=num_replicas, rank=rank, **kwargs) for rank in range(num_replicas)]
    per_rank = [list(sampler) for sampler in samplers]
    steps = len(per_rank[0]) // 2
    return [sum((indices[2 * k : 2 * k + 2] for indices in per_rank), []) for k in range(steps)]


def test_prompt_sampler_global_batches_do_not_depend_on_world_size():
    one = PromptSampler(10, 4, shuffle=True, seed=7)
    assert len(one) == 8  # 2 full global batches of 4 prompts, the last 2 prompts skipped
    order = list(one)
    two = global_batches(2, shuffle=True, seed=7)
    assert two == [order[0:4], order[4:8]]
    assert order == torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()[:8]
    # a new epoch gets a new (seeded) order; shuffle off keeps the dataset order
    one.set_epoch(1)
    assert list(one) == torch.randperm(10, generator=torch.Generator().manual_seed(8)).tolist()[:8]
    assert global_batches(2, shuffle=False, seed=0) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_prompt_sampler_refuses_fewer_prompts_than_a_global_batch():
    with pytest.raises(ValueError, match=r"3 prompts, fewer than one global batch of data.batch_size \* processes = 2 \* 2 = 4"):
        PromptSampler(3, 2, shuffle=True, seed=0, num_replicas=2, rank=0)


# ----------------------------------------------------------------------------------------------
# Sharded checkpoints replace the previous one only once complete
# ----------------------------------------------------------------------------------------------


def write_shards(contents: str, fail_after: int | None = None):
    """A stand-in for FSDP2's sharded save: a directory of shard files, optionally dying half-way."""

    def write(path: Path) -> None:
        path.mkdir()
        for rank in range(2):
            if fail_after is not None and rank >= fail_after:
                raise KeyboardInterrupt("killed while writing shards")
            (path / f"__{rank}_0.distcp").write_text(f"{contents} shard {rank}")

    return write


def read_shards(path: Path) -> list[str]:
    return sorted(file.read_text() for file in path.iterdir())


def test_sharded_checkpoint_is_replaced_only_when_complete(tmp_path):
    from lit_grpo.run.sharded_checkpoints import recover_interrupted_replace, replace_atomically

    last = tmp_path / "last.ckpt"
    no_barrier = lambda: None  # noqa: E731
    replace_atomically(last, write_shards("step 1"), True, no_barrier)
    assert read_shards(last) == ["step 1 shard 0", "step 1 shard 1"]

    # killed half-way through the next save: the previous checkpoint is intact
    with pytest.raises(KeyboardInterrupt):
        replace_atomically(last, write_shards("step 2", fail_after=1), True, no_barrier)
    assert read_shards(last) == ["step 1 shard 0", "step 1 shard 1"]
    assert (tmp_path / "last.ckpt.partial").exists()

    # the next save cleans up and replaces it; nothing else is left in the directory
    replace_atomically(last, write_shards("step 3"), True, no_barrier)
    assert read_shards(last) == ["step 3 shard 0", "step 3 shard 1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    # killed between the two renames: the previous checkpoint is put back before a load
    (tmp_path / "last.ckpt").rename(tmp_path / "last.ckpt.previous")
    recover_interrupted_replace(last)
    assert read_shards(last) == ["step 3 shard 0", "step 3 shard 1"]

    # a single-file checkpoint (save_distributed_checkpoint: false) is replaced the same way
    def write_half_then_die(path: Path) -> None:
        path.write_text("v2-half")
        raise KeyboardInterrupt("killed while writing")

    single = tmp_path / "single.ckpt"
    replace_atomically(single, lambda path: path.write_text("v1"), True, no_barrier)
    with pytest.raises(KeyboardInterrupt):
        replace_atomically(single, write_half_then_die, True, no_barrier)
    assert single.read_text() == "v1"


def test_cli_runs_lightnings_model_parallel_strategy_with_atomic_checkpoints():
    from jsonargparse import Namespace

    from lit_grpo.cli import use_atomic_model_parallel_checkpoints
    from lit_grpo.run.sharded_checkpoints import ModelParallelStrategy

    trainer = Namespace(strategy=Namespace(**STRATEGIES["fsdp2"]))
    use_atomic_model_parallel_checkpoints(trainer)
    assert trainer.strategy.class_path == "lit_grpo.run.sharded_checkpoints.ModelParallelStrategy"
    assert trainer.strategy.init_args == STRATEGIES["fsdp2"]["init_args"]
    from lightning.pytorch.strategies import ModelParallelStrategy as Lightning

    assert issubclass(ModelParallelStrategy, Lightning)
    ddp = Namespace(strategy="ddp")
    use_atomic_model_parallel_checkpoints(ddp)
    assert ddp.strategy == "ddp"


def test_validation_metrics_reduce_over_ranks_like_one_process(run_dir):
    """val/* on 2 processes, each validating half of the prompts, equal one process validating all."""
    validation = {"num_generations_eval": 4, "eval_pass_k": [1, 2, 4], "eval_success_threshold": 0.3}
    data = {"val_split": "train[:8]"}
    with ThreadPoolExecutor(1) as beside:  # the one-process run beside the two-process one: their imports overlap
        one_run = beside.submit(
            run_worker, run_dir, "validate_single", 1, {"trainer": {"devices": 1}, "data": {"batch_size": 2, **data}, "model": validation},
            "--fixed-completions", "--validate",
        )
        two = run_worker(
            run_dir, "validate_ddp", 2,
            {"trainer": {"devices": 2, "strategy": "ddp"}, "data": {"batch_size": 2, **data}, "model": validation},
            "--fixed-completions", "--validate",
        )["results"]
        one = one_run.result()["results"]
    assert set(one) == set(two) == {"val/reward", "val/mean@4", "val/pass@1", "val/pass@2", "val/pass@4"}
    for name, value in one.items():
        assert two[name] == pytest.approx(value, rel=1e-6), name
    assert 0 < one["val/pass@1"] < one["val/pass@4"] < 1  # not vacuous: some prompts pass, some do not


def two_ranks_with_a_reward_broken_on_rank_1(tmp_path: Path, tiny_model_dir: Path, subcommand: str, failure: str, *,
                                             model: dict, data: dict | None = None, trainer: dict | None = None,
                                             ) -> subprocess.CompletedProcess:
    """``lit-grpo SUBCOMMAND`` of the quickstart on 2 processes (gloo DDP) whose reward
    ``flaky.py:broken_on_rank_1`` raises ``failure`` on rank 1 (``model``: where that reward is named):
    checks that both ranks end with the reward's own ``error:`` line, that neither dies with gloo's
    'Connection closed by peer', and that nothing hangs (the timeout); the finished process for more checks."""
    (tmp_path / "flaky.py").write_text(
        "import os\n\ndef broken_on_rank_1(completions, **kwargs):\n"
        f"    if os.environ['RANK'] == '1':\n        raise ValueError({failure!r})\n"
        "    return [0.0] * len(completions)\n")
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["model"].update(model_name_or_path=str(tiny_model_dir), **model)
    config["data"].update(data_files=str(REPO / config["data"]["data_files"]), **(data or {}))
    config["trainer"].update(devices=2, strategy="ddp", **(trainer or {}))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "lit_grpo.cli", subcommand, "--config", "config.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    stopped = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)  # a hang fails here
    assert stopped.returncode != 0
    assert "Connection closed by peer" not in stopped.stderr, stopped.stderr[-3000:]
    # (two processes share one stderr pipe: a message can start right after the other's last word)
    errors = re.split(r"error: (?=Reward 'flaky)", stopped.stderr)[1:]
    assert len(errors) == 2, stopped.stderr[-3000:]  # one per rank
    for message in errors:
        assert message.startswith("Reward 'flaky.py:broken_on_rank_1'") and failure in message, message
    return stopped


def test_a_reward_that_raises_on_one_rank_stops_both_ranks_with_its_message(tiny_model_dir, tmp_path):
    """2 processes (gloo DDP), synchronous sampling, the quickstart as a user runs it (logger on): rank
    1's reward raises in the first step. Both ranks end with the reward's own error (rank 0 used to
    die in the next collective with gloo's 'Connection closed by peer' traceback), and the run that
    failed before its first step leaves no run directory."""
    two_ranks_with_a_reward_broken_on_rank_1(
        tmp_path, tiny_model_dir, "fit", "rank 1's reward broke", model={"rewards": [{"name": "flaky.py:broken_on_rank_1"}]},
        trainer={"max_steps": 2})
    assert not list((tmp_path / "runs").glob("*/version_*")), "the failed run's directory was left behind"
