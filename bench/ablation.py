"""What each speed change of lit-grpo buys: lit-grpo with one change turned off at a time.

Same identical-work setup as ``bench/compare_trl.py`` (quickstart prompts and reward, G = 8, 8 prompts
per step, dapo, one optimizer step per generation batch), lit-grpo only. The variants run in turn
(A B C ... A B C ...) so that a slow spell of the machine hits all of them:

* ``default``: the group sampler (``generation_backend: lit``), length-chunked log-prob forwards
  (``group_by_length: true``) and prompts encoded once per group in the log-prob forwards
  (``share_prompt_forward: true``);
* ``every row runs its prompt``: ``share_prompt_forward: false``;
* ``transformers generate``: ``generation_backend: transformers`` (Hugging Face ``generate`` on the
  prompts repeated G times);
* ``one forward per micro-batch``: ``group_by_length: false`` (every row padded to the longest, and
  no chunked backward);
* ``no token budget``: ``forward_token_budget: null``: a micro-batch's chunks all stay alive until
  one backward (the memory the budget saves, and what its extra backward passes cost);
* ``token budget 4096``: the budget's default before it became 1024 (fewer, larger chunks);
* ``zero-gradient rows trained``: ``skip_zero_gradient_rows: false``: the rows of groups with equal
  rewards (advantage 0, beta 0) go backward too;
* ``none``: all off, lit-grpo as it was before these changes.

A change that has no setting to turn it off is measured against the code before it:
``--against-commit REV`` adds the variant ``default at REV``, the same settings with ``lit_grpo``
imported from that commit (the drivers in ``bench/`` stay the working tree's). ``--set KEY=VALUE``
sets a ``GRPOModule`` argument in every variant (a YAML value: ``num_iterations=2``); steps count
generation batches either way.

    python -m bench.ablation --threads 1                      # 4M, L = 128, beta 0, fp32
    python -m bench.ablation --threads 1 --size 30M --length 32 --precision bf16
    python -m bench.ablation --threads 1 --prompt-chars 120     # prompts 120 tokens longer
    python -m bench.ablation --threads 1 --variants default "token budget 4096"   # a subset
    python -m bench.ablation --threads 1 --set num_iterations=2 --variants default --against-commit 50c4a49

Writes ``bench/results/ablation.md`` and ``.json`` (``--name`` changes the file name).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

from bench.harness import (
    REPO_DIR,
    add_contention_options,
    add_work_options,
    build_models,
    command_line,
    fmt,
    load_line,
    machine_description,
    markdown_table,
    matmul_rates,
    run_measured,
    summarize_runs,
    work_label,
    work_spec,
    write_outputs,
)

VARIANTS = {
    "default": {},
    "every row runs its prompt": {"share_prompt_forward": False},
    "transformers generate": {"generation_backend": "transformers"},
    "one forward per micro-batch": {"group_by_length": False},
    "no token budget": {"forward_token_budget": None},
    "token budget 4096": {"forward_token_budget": 4096},
    "zero-gradient rows trained": {"skip_zero_gradient_rows": False},
    "none": {
        "generation_backend": "transformers", "group_by_length": False, "share_prompt_forward": False,
        "forward_token_budget": None, "skip_zero_gradient_rows": False,
    },
}
PHASES = ("generate", "logprobs", "train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_work_options(parser, length=128, precision="fp32")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of every run")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all variants")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    add_contention_options(parser)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="VARIANT",
                        help=f"the variants to run (default: all; 'default' is always run): {', '.join(VARIANTS)}")
    parser.add_argument("--set", dest="settings", nargs="+", default=[], metavar="KEY=VALUE",
                        help="GRPOModule arguments for every variant, e.g. num_iterations=2")
    parser.add_argument("--against-commit", default=None, metavar="REV",
                        help="also run the default variant with lit_grpo from this commit")
    parser.add_argument("--name", default="ablation", help="output file name in bench/results/")
    args = parser.parse_args(argv)
    args.variants = ["default"] + [variant for variant in VARIANTS if variant in args.variants and variant != "default"]
    args.settings = dict(parse_setting(setting) for setting in args.settings)
    for variant in args.variants:  # a setting must not silently undo what a variant turns off
        overlap = sorted(args.settings.keys() & VARIANTS[variant].keys())
        if overlap:
            raise SystemExit(f"--set {', '.join(overlap)} would override the variant {variant!r}, which sets it; leave that variant out")
    return args


def parse_setting(setting: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--set``, the value read as YAML (``2``, ``null``, ``false``, ``text``)."""
    key, sep, value = setting.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set takes KEY=VALUE, got {setting!r}")
    return key, yaml.safe_load(value)


def export_commit(rev: str, directory: Path) -> Path:
    """The ``lit_grpo`` package of commit ``rev`` (``git archive``) under ``directory``, for PYTHONPATH."""
    archive = directory / "lit_grpo.tar"
    try:
        subprocess.run(["git", "-C", str(REPO_DIR), "archive", "-o", str(archive), rev, "lit_grpo"], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"--against-commit {rev}: git archive failed: {error.stderr.strip()}") from None
    code_dir = directory / "against-commit"
    with tarfile.open(archive) as tar:
        tar.extractall(code_dir, filter="data")
    return code_dir


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = command_line("ablation", argv)
    machine_before = machine_description()
    start = time.perf_counter()
    variants = {variant: {**VARIANTS[variant], **args.settings} for variant in args.variants}
    code_dirs = {variant: None for variant in variants}  # None: the installed lit_grpo
    with tempfile.TemporaryDirectory(prefix="lit-grpo-bench-") as tmp:
        if args.against_commit:
            variant = f"default at {args.against_commit}"
            variants[variant] = dict(args.settings)
            code_dirs[variant] = str(export_commit(args.against_commit, Path(tmp)))
        runs: dict[str, list[dict]] = {variant: [] for variant in variants}
        model = build_models([args.size], Path(tmp))[args.size]
        rate = matmul_rates(model.shape, 64, args.length, args.threads)[args.precision]["best"]
        for repeat in range(args.repeats):
            for variant, options in variants.items():
                spec = work_spec(
                    args, "lit-grpo", model.path, Path(tmp), args.warmup + args.steps, threads=args.threads,
                    lit_options=options, lit_code_dir=code_dirs[variant],
                )
                runs[variant].append(run_measured(spec, args.warmup, args.quiet_wait, args.retries, args.min_cpu_share))
                print(f"[{repeat + 1}/{args.repeats} {(time.perf_counter() - start) / 60:5.1f} min] {variant}",
                      file=sys.stderr, flush=True)
        summaries = {variant: summarize_runs(runs[variant], args.warmup, model.shape, rate) for variant in variants}
    machine_after = machine_description()

    default_rate = summaries["default"]["tokens_per_second"]
    header = ["lit-grpo variant", "s/step", "tok/s", "default's tok/s over this", *(f"{p} s" for p in PHASES), "peak MiB"]
    table = []
    for variant, summary in summaries.items():
        phases = summary["phases_median_seconds"]
        table.append(
            [
                variant,
                fmt(summary["median_step_seconds"]),
                fmt(summary["tokens_per_second"], 0),
                fmt(default_rate / summary["tokens_per_second"]),  # > 1: the change turned off here helps
                *(fmt(phases.get(phase), 3) for phase in PHASES),
                fmt(summary["peak_rss_mib"], 0),
            ]
        )
    config = work_label(args) + "".join(f", {key}={value}" for key, value in args.settings.items())
    markdown = "\n".join(
        [
            "# What each speed change buys (lit-grpo only)",
            "",
            f"`{command}`",
            "",
            f"Machine: {machine_before['cpu']}, {machine_before['cores']} cores, {args.threads or 'default'} torch threads "
            f"per run; {load_line(machine_before)} before, {load_line(machine_after)} after. {config}; G 8, 8 prompts "
            f"per step; {args.warmup} warm-up + {args.steps} timed steps per run, {args.repeats} run(s) per variant, "
            "variants alternating. Times are medians over the timed steps of all runs of a variant.",
            "",
            markdown_table(header, table),
            "",
        ]
    )
    data = {"command": command, "machine_before": machine_before, "machine_after": machine_after, "config": config,
            "variants": variants, "summaries": summaries, "runs": runs}
    md_path, json_path = write_outputs(args.name, markdown, data)
    print(markdown)
    print(f"wrote {md_path} and {json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
