"""A short `lit-grpo fit` on one or several processes, for tests/train/test_distributed.py.

Run directly (one process) or under ``python -m torch.distributed.run --nproc_per_node W``; the
trainer comes from a YAML config through the CLI, exactly as a user runs it. Rank 0 writes a
``torch.save`` file with the logged metrics of every step and the final full policy weights.

``--fixed-completions`` replaces sampling with a deterministic function of the prompt text: runs
with different numbers of processes then train on the same completions, so their losses and updated
weights can be compared with one process on the same global batch. (Sampling itself draws from each
rank's own random stream, so it differs between 1 and 2 processes by design.)

``--generation-check`` instead generates with real sampling under FSDP2, where rank 0 stops after 2
new tokens and rank 1 decodes 24, and records the parameter all-gathers issued during ``generate``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import zlib

import torch
import torch.distributed as dist


def fixed_generate_from_ids(model, prompt_ids, prompt_mask, prompt_truncated, num_generations, generation_config,
                            pad_token_id, backend=None, *, tokenizer):
    """Completions that depend only on (prompt, index in the group): random tokens from a generator
    seeded by both, of a seeded length; those shorter than the maximum end with EOS."""
    from lit_grpo.algorithm import completion_mask_from_ids
    from lit_grpo.rollout.records import Rollout

    max_new = generation_config.max_new_tokens
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    rows = []
    for ids, mask in zip(prompt_ids, prompt_mask):
        text = tokenizer.decode(ids[mask.bool()].tolist())
        for j in range(num_generations):
            generator = torch.Generator().manual_seed(zlib.crc32(text.encode()) * 131 + j)
            length = int(torch.randint(1, max_new + 1, (1,), generator=generator))
            tokens = [vocab[int(k)] for k in torch.randint(len(vocab), (length,), generator=generator)]
            if length < max_new:
                tokens[-1] = tokenizer.eos_token_id
            rows.append(tokens + [pad_token_id] * (max_new - length))
    completion_ids = torch.tensor(rows, device=prompt_ids.device)  # [N, C]
    completion_mask, is_truncated = completion_mask_from_ids(completion_ids, tokenizer.eos_token_id)
    return Rollout(
        prompt_ids.repeat_interleave(num_generations, 0),
        prompt_mask.repeat_interleave(num_generations, 0),
        completion_ids,
        completion_mask,
        is_truncated,
        prompt_truncated.repeat_interleave(num_generations, 0),
    ).trimmed()


def register_gated_reward() -> None:
    """``gated``: 0.5 for every completion of a prompt "Say x N:" with N a multiple of 3 (a group with
    no signal), otherwise the fraction of the completion's characters in a-m."""
    from lit_grpo import plugins

    def gated(prompts, completions, **kwargs):
        values = []
        for prompt, completion in zip(prompts, completions):
            number = int(prompt.rstrip(":").split()[-1])
            values.append(0.5 if number % 3 == 0 else sum(c in "abcdefghijklm" for c in completion) / max(len(completion), 1))
        return values

    plugins.register_functions("distributed-worker", {"gated": gated})


def full_policy_state(module) -> dict[str, torch.Tensor]:
    """Unsharded policy weights on CPU (a collective under FSDP2: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    if module.device_mesh is not None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(module.policy, options=options)
    return {name: tensor.detach().cpu().clone() for name, tensor in module.policy.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fixed-completions", action="store_true")
    parser.add_argument("--generation-check", action="store_true")
    parser.add_argument("--scripted-tools", action="store_true", help="sample with tests/scripted_policy.py")
    parser.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    parser.add_argument(
        "--share-prompts-always", action="store_true",
        help="share_prompt_forward even where it saves few tokens (the tests' prompts are short)",
    )
    parser.add_argument(
        "--share-prompts-on-rank-0-only", action="store_true",
        help="rank 0 finds sharing prompts always worth it, the other ranks never (they must agree)",
    )
    parser.add_argument("--validate", action="store_true", help="run trainer.validate and save its metrics")
    parser.add_argument(
        "--record-compute-dtype", action="store_true",
        help="record the dtype of the first attention projection's weight and input at each training forward",
    )
    parser.add_argument(
        "--gated-reward", action="store_true",
        help="register the reward `gated`: constant for prompts whose number is a multiple of 3",
    )
    args, cli_args = parser.parse_known_args()

    import lightning.pytorch as pl

    import lit_grpo.rollout.engines.policy
    import lit_grpo.train.logprob_passes
    import lit_grpo.train.module
    from lit_grpo.cli import run_cli

    if args.share_prompts_always:
        lit_grpo.train.logprob_passes.FORWARD_OVERHEAD_TOKENS = 0
    if args.share_prompts_on_rank_0_only:  # RANK: set by torch.distributed.run
        lit_grpo.train.logprob_passes.FORWARD_OVERHEAD_TOKENS = 0 if int(os.environ.get("RANK", "0")) == 0 else 10**9
    if args.gated_reward:
        register_gated_reward()

    steps: list[dict[str, float]] = []

    class RecordMetrics(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append({name: float(value) for name, value in trainer.callback_metrics.items()})

    cli = run_cli([*(arg for path in args.config for arg in ("--config", path)), *cli_args], run=False)
    cli.trainer.callbacks.append(RecordMetrics())
    module = cli.model
    if args.fixed_completions:
        lit_grpo.rollout.engines.policy.generate_from_ids = functools.partial(fixed_generate_from_ids, tokenizer=module.tokenizer)
    if args.scripted_tools:
        from scripted_policy import scripted_generate_from_ids

        lit_grpo.rollout.engines.policy.generate_from_ids = functools.partial(scripted_generate_from_ids, tokenizer=module.tokenizer)

    if args.generation_check:
        generation_check(cli, module, args.out)
        return

    if args.validate:
        results = cli.trainer.validate(module, datamodule=cli.datamodule)
        if cli.trainer.global_rank == 0:
            torch.save({"results": results[0], "world_size": cli.trainer.world_size}, args.out)
        exit_without_finalisation()
    backward_passes = []
    manual_backward = module.manual_backward
    module.manual_backward = lambda loss, *a, **kw: (backward_passes.append(1), manual_backward(loss, *a, **kw))[1]
    skipped_rows = []  # rows of this rank's micro-batches that went forward without a backward
    rows_without_gradient = module.logprobs.rows_without_gradient

    def counting_rows_without_gradient(*args, **kwargs):
        frozen = rows_without_gradient(*args, **kwargs)
        skipped_rows.append(0 if frozen is None else len(frozen))
        return frozen

    module.logprobs.rows_without_gradient = counting_rows_without_gradient
    no_grad_rows = []  # rows of this rank's no-gradient log-prob passes (old and reference log-probs)
    logps_no_grad = module.logprobs.logps_no_grad
    module.logprobs.logps_no_grad = lambda model, rollout: (no_grad_rows.append(rollout.completion_ids.size(0)), logps_no_grad(model, rollout))[1]
    compute_dtypes = set()  # (weight dtype, input dtype) of q_proj in forwards with gradient
    if args.record_compute_dtype:
        def record(layer, inputs):
            if torch.is_grad_enabled():
                compute_dtypes.add((str(layer.weight.dtype), str(inputs[0].dtype)))

        original_configure_model = module.configure_model

        def configure_model_and_record():
            original_configure_model()
            projection = next(m for name, m in module.policy.named_modules() if name.endswith("q_proj"))
            projection.register_forward_pre_hook(record)

        module.configure_model = configure_model_and_record
    cli.trainer.fit(module, datamodule=cli.datamodule, ckpt_path=args.ckpt_path)
    state = full_policy_state(module)
    no_grad_rows_per_rank = [no_grad_rows]
    if dist.is_initialized():
        no_grad_rows_per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(no_grad_rows_per_rank, no_grad_rows)
    entropy_control_per_rank = [module.logprobs.entropy_coefficient.state_dict()]  # the entropy bonus's coefficient
    if dist.is_initialized():
        entropy_control_per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(entropy_control_per_rank, module.logprobs.entropy_coefficient.state_dict())
    if cli.trainer.global_rank == 0:
        result = {
            "steps": steps, "state": state, "world_size": cli.trainer.world_size,
            "backward_passes": len(backward_passes), "skipped_rows": skipped_rows,
            "no_grad_rows": no_grad_rows_per_rank, "compute_dtypes": sorted(compute_dtypes),
            "entropy_control": entropy_control_per_rank,
            "log_dir": str(module.run_log_dir),
        }
        torch.save(result, args.out)
    exit_without_finalisation()


def exit_without_finalisation() -> None:
    """After the results are saved: leave the process group together, then skip interpreter
    finalisation. Under CPU load, torch 2.13 + gloo processes sometimes abort in a C++ thread
    destructor at interpreter shutdown ("terminate called without an active exception", no Python
    frame), after all work is done; that is not what these tests check."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def generation_check(cli, module, out: str) -> None:
    """Generate under FSDP2 with per-rank lengths; count the all-gathers issued meanwhile."""
    trainer = cli.trainer
    trainer.strategy.connect(module)
    trainer.strategy.setup_environment()  # process group and device mesh
    module.configure_model()
    rank = trainer.global_rank
    new_tokens = 2 if rank == 0 else 24  # exactly this many on each rank (EOS suppressed until then)
    module.generation_config.max_new_tokens = module.generation_config.min_new_tokens = new_tokens

    gathers = []
    original = dist.all_gather_single

    def counting_all_gather(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    dist.all_gather_single = counting_all_gather
    try:
        rollout = module.generate(["Say a:", "Say b:"])
    finally:
        dist.all_gather_single = original
    from torch.distributed.fsdp import FSDPModule

    num_units = sum(isinstance(m, FSDPModule) for m in module.policy.modules())
    # a training-style forward afterwards still works and the weights are sharded again
    sharded = all(type(p).__name__ == "DTensor" for p in module.policy.parameters())
    result = {
        "rank": rank,
        "completion_width": rollout.completion_ids.size(1),
        "all_gathers": len(gathers),
        "fsdp_units": num_units,
        "resharded": sharded,
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out)
    exit_without_finalisation()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
