"""Would ``torch.compile`` of the decode steps pay off? The group sampler eager against compiled.

    python -m bench.compile_decode --threads 1 --sizes 4M 30M

For each model (``--sizes``) and mode, a fresh process (and an empty inductor cache, so the first
batch pays the whole compile) samples ``--batches`` generation batches with the group sampler
(``lit_grpo.rollout.engines.policy``), 8 quickstart prompts x G = 8, up to ``--length`` tokens, under bf16 autocast
as Lightning's ``bf16-mixed`` (``--precision fp32`` for none):

* ``eager``: the sampler as shipped;
* ``compiled``: the same, with the decode steps' forward (one token per row) through
  ``torch.compile(model.forward, dynamic=True)`` (the prompt's prefill stays eager): batch size
  (rows leave as they finish) and cache length change from step to step, so the graph is compiled
  with dynamic shapes once instead of once per shape.

Reported: the first batch (compile included), the median of the others, and how many batches the
compile takes to pay for itself (``break-even``: first-batch excess over the per-batch saving).
Writes ``bench/results/compile_decode.md`` and ``.json``.
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

from bench.harness import (
    QUICKSTART_DATA,
    REPO_DIR,
    build_models,
    command_line,
    machine_description,
    markdown_table,
    module_env,
    write_outputs,
)

MODES = ("eager", "compiled")


def sample_batches(model_dir: str, mode: str, length: int, batches: int, precision: str) -> dict:
    """The worker: ``batches`` generation batches in this process; seconds per batch and tokens."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import lit_grpo.rollout.engines.policy as generation

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in QUICKSTART_DATA.read_text().splitlines()[:8]]
    config = GenerationConfig(
        max_new_tokens=length, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if mode == "compiled":
        compiled_forward = torch.compile(model.forward, dynamic=True)
        shipped = generation.sample_groups

        class DecodeCompiled:
            """The model, with one-token forwards (the decode steps) through the compiled forward."""

            def __init__(self, model):
                self.model = model

            def __getattr__(self, name):
                return getattr(self.model, name)

            def __call__(self, **kwargs):
                forward = compiled_forward if kwargs["input_ids"].size(1) == 1 else self.model
                return forward(**kwargs)

        generation.sample_groups = lambda model, *args, **kwargs: shipped(DecodeCompiled(model), *args, **kwargs)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if precision == "bf16" else contextlib.nullcontext()
    torch.manual_seed(0)
    seconds, tokens = [], []
    for _ in range(batches):
        start = time.perf_counter()
        with autocast:
            rollout = generation.generate_completions(model, tokenizer, prompts, 8, config)
        seconds.append(time.perf_counter() - start)
        tokens.append(int(rollout.completion_mask.sum()))
    return {"seconds": seconds, "tokens": tokens}


def run_worker(model_dir: str, mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        env = module_env({**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir})  # a cold compile, as a user's first run
        command = [
            sys.executable, "-m", "bench.compile_decode", "--worker", mode, "--model-dir", model_dir, "--length", str(args.length),
            "--batches", str(args.batches), "--precision", args.precision,
        ] + (["--threads", str(args.threads)] if args.threads is not None else [])
        output = subprocess.run(command, env=env, cwd=REPO_DIR, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--sizes", nargs="+", default=["4M"], choices=["4M", "30M"])
    parser.add_argument("--length", type=int, default=32, help="max_new_tokens (completions end at EOS before it)")
    parser.add_argument("--batches", type=int, default=8, help="generation batches per run, the first one compiles")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--name", default="compile_decode")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(sample_batches(args.model_dir, args.worker, args.length, args.batches, args.precision)))
        return
    if args.batches < 2:
        parser.error("--batches must be at least 2: the first one compiles")

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        models = build_models(args.sizes, Path(directory))
        for size in args.sizes:
            runs = {}
            for mode in MODES:
                print(f"{size} {mode} ...", flush=True)
                runs[mode] = run_worker(models[size].path, mode, args)
            eager_steady = statistics.median(runs["eager"]["seconds"][1:])
            for mode, run in runs.items():
                steady = statistics.median(run["seconds"][1:])
                saving = eager_steady - steady
                excess = run["seconds"][0] - runs["eager"]["seconds"][0]
                rows.append({
                    "size": size, "mode": mode, "first_s": run["seconds"][0], "steady_s": steady,
                    "steady_range_s": [min(run["seconds"][1:]), max(run["seconds"][1:])],
                    "tokens_per_s": statistics.median(t / s for t, s in zip(run["tokens"][1:], run["seconds"][1:])),
                    "speedup": eager_steady / steady,
                    "break_even_batches": (excess / saving if saving > 0 else None) if mode != "eager" else None,
                    "seconds": run["seconds"], "tokens": run["tokens"],
                })
    machine = machine_description()
    command = command_line("compile_decode", None)

    def fmt_break_even(row):
        if row["mode"] == "eager":
            return ""
        return "never" if row["break_even_batches"] is None else f"{row['break_even_batches']:.0f}"

    markdown = "\n\n".join([
        "# torch.compile of the sampler's decode steps", f"`{command}`",
        f"Machine: {machine['cpu']}, {torch.get_num_threads()} torch threads, torch {torch.__version__}. "
        f"8 prompts x G 8, up to {args.length} tokens (EOS ends a completion), {args.precision}; {args.batches} batches per run, "
        "one fresh process and an empty inductor cache per run. `steady s`: median of batches 2 onwards (min-max); "
        "`break-even`: batches until the compile's first-batch excess is paid back by the per-batch saving.",
        markdown_table(
            ["model", "mode", "first batch s", "steady s", "steady min-max s", "tok/s", "eager steady / this", "break-even batches"],
            [[r["size"], r["mode"], f"{r['first_s']:.1f}", f"{r['steady_s']:.3f}",
              f"{r['steady_range_s'][0]:.3f}-{r['steady_range_s'][1]:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}",
              fmt_break_even(r)] for r in rows],
        ),
    ])
    md, js = write_outputs(args.name, markdown + "\n", {"command": command, "machine": machine, "rows": rows})
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
