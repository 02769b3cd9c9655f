"""What one step of staleness costs on the quickstart, with each form of the staleness correction.

``configs/quickstart.yaml`` as it is (the ``lit-grpo init-tiny`` model, 300 optimizer steps, AdamW lr
3e-3, the ``lit`` sampler) at ``model.max_staleness: 0`` (synchronous) and ``1`` (each batch trained
one optimizer step after the weights that sampled it), with the importance-sampling correction of
the staleness (``model.vllm_importance_sampling_*``, :mod:`lit_grpo.algorithm.sampling_correction`) in each of
the forms compared:

- ``sequence_mask``: TRL's vLLM-mismatch default (one weight per sequence, the product of its tokens'
  ratios, set to 0 above 3);
- ``token_truncate``: one weight per token, truncated at 3;
- ``token_mask`` (cap 3): one weight per token, tokens above 3 leave the loss;
- ``token_mask`` (cap 5): AReaL's decoupled PPO, tokens whose behaviour weight
  pi_prox / pi_behav exceeds the cap leave the loss;
- ``token_mask`` in [0.125, 8]: prime-rl's token mask (both bounds), the default with staleness
  (``default``: whatever the defaults are);
- ``coupled`` (an experiment, :class:`ClipAgainstBehaviour`): PPO's clip against the behaviour policy;

plus, with ``--lr``, the same at other learning rates. The summary is the mean reward of the last 10
steps of each run (the reward of the batch trained at that step) and the mean fraction of tokens (or
sequences) the correction truncated or masked.

    python -m bench.staleness                         # 2 seeds x the variants x 300 steps (~1-2 min a run)
    python -m bench.staleness --variants sync decoupled --seeds 0 --steps 100
    python -m bench.staleness --merge staleness_a staleness_b --name staleness   # one table of earlier runs

Writes ``bench/results/staleness.json`` (every curve) and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

from bench.harness import (
    REPO_DIR,
    RESULTS_DIR,
    command_line,
    load_line,
    machine_description,
    markdown_table,
    write_outputs,
)

QUICKSTART = REPO_DIR / "configs" / "quickstart.yaml"

class ClipAgainstBehaviour(pl.Callback):
    """The ``coupled`` variant (an experiment, not a setting): each pipeline batch's ``old_logps`` are its
    behaviour log-probs, so PPO's clip acts on pi_theta / pi_behav (classic PPO on the sampling policy)
    instead of pi_theta / pi_prox, which is 1 with one optimizer step per batch; the correction's
    weights pi_old / pi_behav are then 1."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pipeline = pl_module.rollout_pipeline
        exchange = pipeline.exchange

        def exchange_clipping_against_behaviour(module, batch):
            scored, completions = exchange(module, batch)
            if scored is not None:
                scored.old_logps = scored.rollout.sampling_logps.clone()  # [N, C]
            return scored, completions

        pipeline.exchange = exchange_clipping_against_behaviour


# name -> (max_staleness, the model.* overrides)
VARIANTS: dict[str, tuple[int, dict[str, object]]] = {
    "sync": (0, {}),
    "default": (1, {}),  # whatever the defaults are at max_staleness 1
    "sequence_mask": (1, {"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0}),
    "token_truncate": (1, {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 3.0}),
    "token_mask": (1, {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 3.0}),
    "decoupled": (1, {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 5.0}),
    "prime_rl_mask": (1, {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.125,
                          "vllm_importance_sampling_clip_max": 8.0}),
    "coupled": (1, {}),  # and ClipAgainstBehaviour
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["sync", "sequence_mask", "token_truncate", "token_mask",
                                                           "decoupled", "prime_rl_mask"], choices=sorted(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", nargs="+", type=float, default=[3e-3], help="AdamW learning rates")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each with --threads threads)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--name", default="staleness", help="output file name in bench/results/")
    parser.add_argument("--merge", nargs="+", metavar="NAME", help="no run: summarise these results files as one")
    return parser.parse_args(argv)


def fit_command(model_dir: Path, variant: str, seed: int, steps: int, lr: float) -> list[str]:
    max_staleness, model = VARIANTS[variant]
    args = [sys.executable, "-m", "lit_grpo.cli", "fit", "--config", str(QUICKSTART),
            f"--seed_everything={seed}", f"--data.seed={seed}", f"--trainer.max_steps={steps}",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            f"--data.data_files={REPO_DIR / 'configs/data/quickstart.jsonl'}",
            f"--model.model_name_or_path={model_dir}", f"--model.max_staleness={max_staleness}",
            "--model.log_completions_every_n_steps=0", f"--optimizer.init_args.lr={lr}"]
    args += [f"--model.{key}={value}" for key, value in model.items()]
    if variant == "coupled":
        args.append("--trainer.callbacks+=bench.staleness.ClipAgainstBehaviour")
    return args


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def start_run(work: Path, model_dir: Path, variant: str, seed: int, steps: int, lr: float, threads: int):
    directory = work / f"{variant}-lr{lr:g}-seed{seed}"
    directory.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO_DIR),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = fit_command(model_dir, variant, seed, steps, lr)
    log = open(directory / "log.txt", "w")
    return directory, command, time.perf_counter(), subprocess.Popen(command, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish_run(directory: Path, command: list[str], started: float, process: subprocess.Popen) -> dict:
    if process.wait() != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(directory / 'log.txt').read_text()[-3000:]}")
    logged = scalars(directory / "runs" / "quickstart" / "version_0")
    rewards = [logged["reward"][step] for step in sorted(logged["reward"])]
    changed = logged.get("sampling/importance_sampling_ratio/truncated_frac", {})
    return {
        "rewards": rewards,
        "last10": statistics.fmean(rewards[-10:]),
        "changed_frac": statistics.fmean(changed.values()) if changed else None,
        "seconds": time.perf_counter() - started,
    }


def summary_markdown(steps: int, runs: list[dict], invocations: list[dict]) -> str:
    """The table of every (variant, lr): last-10 reward per seed, their mean, the mean reward over the
    whole run (the area under the curve: less noisy than the end), the fraction corrected."""
    rows = []
    keys = list(dict.fromkeys((run["variant"], run["lr"]) for run in runs))
    for variant, lr in sorted(keys, key=lambda key: (key[1], list(VARIANTS).index(key[0]))):
        mine = sorted((run for run in runs if run["variant"] == variant and run["lr"] == lr), key=lambda run: run["seed"])
        changed = [run["changed_frac"] for run in mine if run["changed_frac"] is not None]
        rows.append([variant, f"{lr:g}", ", ".join(str(run["seed"]) for run in mine),
                     " / ".join(f"{run['last10']:.3f}" for run in mine),
                     f"{statistics.fmean(run['last10'] for run in mine):.3f}",
                     f"{statistics.fmean(statistics.fmean(run['rewards']) for run in mine):.3f}",
                     f"{statistics.fmean(changed):.4f}" if changed else "-"])
    lines = [f"# One step of staleness on the quickstart ({steps} steps)", ""]
    for invocation in invocations:
        machine = invocation["machine"]
        lines.append(f"- `{invocation['command']}` on {machine['cpu']} ({machine['cores']} cores, {load_line(machine)} "
                     f"at the end), {invocation['threads']} torch thread(s) per run, {invocation['jobs']} run(s) at a time")
    lines += [
        "",
        "Per (variant, lr): the last-10 reward of each seed and their mean, the mean reward over all steps, "
        "and the mean fraction of tokens (sequences, for sequence_mask) the correction truncated or masked.",
        "",
        markdown_table(["variant", "lr", "seeds", "last-10 reward per seed", "mean", "mean over the run",
                        "truncated/masked"], rows),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:  # no run: one summary of earlier results files
        loaded = [json.loads((RESULTS_DIR / f"{name}.json").read_text()) for name in args.merge]
        runs = [run for data in loaded for run in data["runs"]]
        invocations = [invocation for data in loaded for invocation in data["invocations"]]
        data = {"steps": loaded[0]["steps"], "invocations": invocations, "runs": runs}
        write_outputs(args.name, summary_markdown(data["steps"], runs, invocations), data)
        return
    plan = [(variant, lr, seed) for lr in args.lr for variant in args.variants for seed in args.seeds]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="staleness-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "lit_grpo.cli", "init-tiny", str(work / "tiny-model")], check=True,
                       capture_output=True)
        running = []
        for variant, lr, seed in plan:
            running.append(((variant, lr, seed), start_run(work, work / "tiny-model", variant, seed, args.steps, lr, args.threads)))
            while len(running) >= args.jobs or (running and (variant, lr, seed) == plan[-1]):
                (v, l, s), started = running.pop(0)
                result = finish_run(*started)
                runs.append({"variant": v, "lr": l, "seed": s, "max_staleness": VARIANTS[v][0], "model": VARIANTS[v][1], **result})
                print(f"{v} lr {l:g} seed {s}: last-10 reward {result['last10']:.3f} ({result['seconds']:.0f} s)", flush=True)
    invocations = [{"command": command_line("staleness", argv), "machine": machine_description(),
                    "threads": args.threads, "jobs": args.jobs}]
    data = {"steps": args.steps, "invocations": invocations, "runs": runs}
    write_outputs(args.name, summary_markdown(args.steps, runs, invocations), data)


if __name__ == "__main__":
    main()
