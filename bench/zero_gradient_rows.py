"""What ``skip_zero_gradient_rows`` buys: the training phase of one generation batch against the
number of its groups whose rewards are all equal.

With ``beta = 0`` a group of equal rewards has advantage 0 in every row, so its rows' loss terms have
exactly zero gradient (``lit_grpo.algorithm.rows_without_gradient``). lit-grpo sends those rows
forward without autograd (for the logged entropy) and skips their backward; TRL, like lit-grpo with
``skip_zero_gradient_rows: false``, trains them. How many groups that is depends on the task: few
with the benchmark's continuous reward on a random model, many with a pass/fail reward or once a
task is learnt (the quickstart ends with most groups at reward 1.0; ``frac_reward_zero_std`` logs it).

For each model size and completion length: one real generation batch (8 quickstart prompts x G = 8,
sampled by the policy, under ``--precision``), then the micro-batch forward and backward of all 64
rows (``micro_batch_size: null``, dapo, the default token budget) timed with the first ``k`` groups'
advantages set to 0, for each ``k`` in ``--zero-groups``, skipping on and off alternating,
``--repeats`` times each; the median is reported. The cost of a row's forward and backward does not
depend on its advantage's value, so setting it stands in for a group of equal rewards.

With ``--phases old_logps`` (``--steps-per-generation S``, default 2) it times instead the pass that
computes the sampling policy's log-probs of the rows trained after the policy first moves (the last
``(S - 1) / S`` of the rows in a random order): with ``skip_zero_gradient_rows`` it leaves out the
rows of the zero-advantage groups, whose old log-probs multiply into nothing.

    python -m bench.zero_gradient_rows --threads 1 --sizes 4M 30M --lengths 32 128
    python -m bench.zero_gradient_rows --threads 1 --sizes 4M 30M --lengths 32 128 --phases old_logps --name zero_gradient_rows_old_logps

Writes ``bench/results/zero_gradient_rows.md`` and ``.json`` (``--name`` changes the file name).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import (
    QUICKSTART_DATA,
    build_models,
    command_line,
    fmt,
    load_line,
    machine_description,
    markdown_table,
    steps_per_generation_problem,
    write_outputs,
)

G = 8
PROMPTS = 8


def sampled_batch(model_dir: str, length: int, precision: str):
    """A module on ``model_dir`` (beta 0, dapo) with one real generation batch of the quickstart's
    first prompts: ``(module, scored, autocast)``."""
    import lightning.pytorch as pl

    from lit_grpo.data import PromptBatch
    from lit_grpo.train.module import GRPOModule

    rows = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines()[:PROMPTS]]
    batch = PromptBatch(prompts=[row["prompt"] for row in rows], columns={"target": [row["target"] for row in rows]})
    pl.seed_everything(0, verbose=False)
    module = GRPOModule(
        model_name_or_path=model_dir, rewards=[{"name": "char_fraction"}], num_generations=G,
        max_completion_length=length, loss_type="dapo", beta=0.0, log_completions_every_n_steps=0,
        save_completions=False,
    )
    module.trainer = pl.Trainer(
        accelerator="cpu", devices=1, precision="bf16-mixed" if precision == "bf16" else "32-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module.configure_model()
    module.manual_backward = lambda loss: loss.backward()  # what Lightning's does on one CPU without a GradScaler
    autocast = module.trainer.precision_plugin.forward_context
    with autocast():
        scored, _ = module.generate_and_score(batch)
    return module, scored, autocast


def time_alternating(module, scored, zero_groups: list[int], repeats: int, run) -> list[dict]:
    """Median seconds of ``run()`` with ``skip_zero_gradient_rows`` on and off alternating, the first
    ``k`` groups' advantages set to 0 for each ``k`` in ``zero_groups`` (``--repeats`` rounds after a warm-up)."""
    import torch

    advantages = torch.linspace(-1.5, 1.5, PROMPTS * G)  # nonzero everywhere, then groups set to 0
    results = []
    for k in zero_groups:
        scored.group.advantages = advantages.clone()
        scored.group.advantages[: k * G] = 0.0
        seconds = {True: [], False: []}
        for _ in range(repeats + 1):  # the first round warms up
            for skip in (True, False):
                module.hparams.skip_zero_gradient_rows = skip
                start = time.perf_counter()
                run()
                seconds[skip].append(time.perf_counter() - start)
                module.policy.zero_grad(set_to_none=True)
        skipped, trained = statistics.median(seconds[True][1:]), statistics.median(seconds[False][1:])
        results.append({
            "zero_groups": k, "skip_s": skipped, "every_row_s": trained, "speedup": trained / skipped,
            "runs_s": {"skip": seconds[True][1:], "every_row": seconds[False][1:]},
            "completion_tokens": int(scored.rollout.completion_mask.sum()),
        })
    return results


def time_training_phase(module, scored, autocast, zero_groups: list[int], repeats: int) -> list[dict]:
    """Seconds of ``_micro_batch_backward`` over the whole generation batch."""
    import torch

    every_row = torch.arange(PROMPTS * G)

    def train():
        with autocast():
            module.logprobs.micro_batch_backward(module.policy, scored, every_row, 1.0, sync=True)

    return time_alternating(module, scored, zero_groups, repeats, train)


def time_old_logps_pass(module, scored, autocast, zero_groups: list[int], repeats: int, steps_per_generation: int) -> list[dict]:
    """Seconds of ``_sampling_policy_logps`` for the rows trained after the first of
    ``steps_per_generation`` optimizer steps."""
    import torch

    order = torch.randperm(PROMPTS * G, generator=torch.Generator().manual_seed(0))
    later_rows = order[PROMPTS * G // steps_per_generation :]

    def old_logps_pass():
        with autocast():
            module.logprobs.sampling_policy_logps(module.policy, scored, later_rows=later_rows)

    results = time_alternating(module, scored, zero_groups, repeats, old_logps_pass)
    for result in results:
        result["rows_computed"] = int((later_rows >= result["zero_groups"] * G).sum())
        result["later_rows"] = len(later_rows)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--sizes", nargs="+", default=["4M", "30M"], choices=["4M", "30M"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[32, 128], help="max_completion_length values")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--zero-groups", nargs="+", type=int, default=[0, 2, 4, 6, 8], help=f"of the {PROMPTS} groups")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per setting (after one warm-up round)")
    parser.add_argument(
        "--phases", nargs="+", default=["train"], choices=["train", "old_logps"],
        help="train: forward and backward of every row; old_logps: the old-log-prob pass before training",
    )
    parser.add_argument("--steps-per-generation", type=int, default=2, help="for the old_logps phase (at least 2)")
    parser.add_argument("--name", default="zero_gradient_rows")
    args = parser.parse_args(argv)
    if any(not 0 <= k <= PROMPTS for k in args.zero_groups):
        parser.error(f"--zero-groups values must be between 0 and {PROMPTS}")
    problem = steps_per_generation_problem(args.steps_per_generation, PROMPTS * G, minimum=2, noun="rows")  # 1: no later rows
    if problem:
        parser.error(problem)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    machine = machine_description()
    tables = {phase: [] for phase in args.phases}
    data = {"command": command_line("zero_gradient_rows", argv), "machine": machine, "args": vars(args), "results": []}
    with tempfile.TemporaryDirectory() as directory:
        models = build_models(args.sizes, Path(directory))
        for size in args.sizes:
            for length in args.lengths:
                print(f"{size}, L = {length} ...", flush=True)
                module, scored, autocast = sampled_batch(models[size].path, length, args.precision)
                for phase in args.phases:
                    if phase == "train":
                        results = time_training_phase(module, scored, autocast, args.zero_groups, args.repeats)
                    else:
                        results = time_old_logps_pass(module, scored, autocast, args.zero_groups, args.repeats, args.steps_per_generation)
                    data["results"].append({"size": size, "length": length, "phase": phase, "results": results})
                    for result in results:
                        rows = [f"{result['rows_computed']} / {result['later_rows']}"] if phase == "old_logps" else []
                        no_pass = phase == "old_logps" and result["rows_computed"] == 0
                        tables[phase].append([
                            size, str(length), str(result["completion_tokens"]), f"{result['zero_groups']} / {PROMPTS}",
                            *rows, fmt(result["every_row_s"], 3), fmt(result["skip_s"], 3),
                            "no pass" if no_pass else fmt(result["speedup"]),
                        ])
    common = ["model", "L", "completion tokens", "groups of equal rewards"]
    headers = {
        "train": [*common, "train every row s", "skip them s", "speedup"],
        "old_logps": [*common, "rows computed", "every later row s", "skip them s", "speedup"],
    }
    titles = {
        "train": f"Training phase: forward and backward of all {PROMPTS * G} rows",
        "old_logps": (
            f"Old-log-prob pass, steps_per_generation {args.steps_per_generation}: no-gradient forward of the rows "
            "trained after the first optimizer step (rows computed: with skipping)"
        ),
    }
    markdown = "\n\n".join([
        "# Groups of equal rewards (`skip_zero_gradient_rows`)",
        f"`{data['command']}`",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {args.threads or 'default'} torch threads; "
        f"{load_line(machine)}. {args.precision}, beta 0, dapo, G = {G}, {PROMPTS} prompts, one generation batch per "
        f"model and length; median of {args.repeats} alternating rounds.",
        *(f"## {titles[phase]}\n\n" + markdown_table(headers[phase], tables[phase]) for phase in args.phases),
    ])
    write_outputs(args.name, markdown, data)
    print(markdown)


if __name__ == "__main__":
    main()
