"""A first check of lit-grpo on a GPU that needs nothing from a hub.

    python -m bench.gpu_check                                  # CUDA, Qwen2.5-0.5B and 1.5B shapes (< 8 min on an H100)
    python -m bench.gpu_check --device cpu --shapes tiny       # the same checks at toy size (tests/test_bench_gpu_check.py)

It builds random-weight models with the shapes of Qwen2.5-0.5B and 1.5B (``lit_grpo.tiny``,
``architecture="qwen2"``: Qwen2's model class, the real hidden sizes, layers, heads and vocabulary,
a byte-level tokenizer and the ChatML template; saved in bf16 like hub checkpoints) and reports:

1. **Greedy agreement**: the ``lit`` sampler's greedy tokens against ``transformers``' ``generate``
   on 64 prompts, in bf16 on the device (rows equal, and tokens equal up to the first difference).
2. **A short ``lit-grpo fit``** through the CLI (``lit_grpo.cli.run_cli``) with ``bf16-mixed`` and
   the first shape: the loss of every step is finite, the weights changed, peak device memory.
3. **Decoding speed**: milliseconds per decoding step of 64 rows x 512 new tokens for each shape and
   both backends, beside the memory-bandwidth floor: the bytes one step must read (every weight
   once, plus the KV cache of every row) over the device's copy bandwidth, measured here.
4. **Training speed**: the fit's trained tokens per second of ``time/train`` beside the bf16 matmul
   floor: the step's matmul FLOPs (``bench.flops.grpo_step_flops``) at the fastest matmul rate
   measured here.

Results go to ``bench/results/gpu_check_<device>.json`` and ``.md`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.flops import ModelShape, grpo_step_flops

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_DIR = Path(__file__).resolve().parents[1]

# Qwen2.5's config.json values; "tiny" for the CPU test (the tokenizer's own vocabulary)
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=None),
}
# per device kind: (prompts in the greedy check, new tokens there, decode rows, decode new tokens,
# fit completions per prompt, fit completion length, fit steps)
SIZES = {"cuda": (64, 64, 64, 512, 8, 256, 3), "cpu": (8, 8, 4, 16, 4, 8, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=None, help="directory for gpu_check_<device>.json/.md")
    return parser.parse_args(argv)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, function):
    """``(result, seconds)`` of ``function()``, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    result = function()
    synchronize(device)
    return result, time.perf_counter() - start


def build(shape_name: str, directory: Path) -> Path:
    from lit_grpo.tiny import build_tiny_model

    return build_tiny_model(
        directory / shape_name, architecture="qwen2", dtype="bfloat16", max_position_embeddings=4096, **SHAPES[shape_name]
    )


def prompts(count: int) -> list[str]:
    """Prompts of varied lengths (left padding matters to the sampler)."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
    return [f"Question {i}: " + " ".join(words[: 3 + i % len(words)]) + "?" for i in range(count)]


def load(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


# ----------------------------------------------------------------------------------------------
# 1. Greedy agreement
# ----------------------------------------------------------------------------------------------


def greedy_agreement(model_dir: Path, device: str, num_prompts: int, new_tokens: int) -> dict:
    from transformers import GenerationConfig

    from lit_grpo.generation import generate_completions

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = load(model_dir, device, dtype)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id,
    )
    texts = prompts(num_prompts)
    rollouts = {backend: generate_completions(model, tokenizer, texts, 1, config, backend=backend) for backend in ("lit", "transformers")}
    lit, reference = (rollouts[b].completion_ids.cpu() for b in ("lit", "transformers"))
    width = max(lit.size(1), reference.size(1))
    lit, reference = (torch.nn.functional.pad(ids, (0, width - ids.size(1)), value=tokenizer.pad_token_id) for ids in (lit, reference))
    differs = lit != reference  # [rows, width]
    first_difference = torch.where(differs.any(1), differs.int().argmax(1), torch.full((lit.size(0),), width))
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "rows": lit.size(0),
        "rows_equal": int((~differs.any(1)).sum()),
        "mean_tokens_equal_before_first_difference": float(first_difference.float().mean()),
        "new_tokens": new_tokens,
    }


# ----------------------------------------------------------------------------------------------
# 2 and 4. A short fit, and its training speed
# ----------------------------------------------------------------------------------------------


def even_token_fraction(completions, completion_ids, **kwargs) -> list[float]:
    """The fraction of a completion's tokens with an even id: a reward a random model's completions
    differ in (most of a random Qwen-sized model's tokens decode to no text)."""
    return [sum(token % 2 == 0 for token in ids) / max(len(ids), 1) for ids in completion_ids]


def register_check_reward() -> None:
    from lit_grpo import plugins

    if "even_token_fraction" not in plugins.get_rewards():
        plugins.register_functions("bench.gpu_check", {"even_token_fraction": even_token_fraction})


def short_fit(model_dir: Path, device: str, directory: Path, num_generations: int, completion_length: int, steps: int) -> dict:
    import lightning.pytorch as pl
    import yaml
    from transformers import AutoModelForCausalLM

    from lit_grpo.cli import run_cli

    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "gpu" if device == "cuda" else "cpu",
            "devices": 1,
            "precision": "bf16-mixed" if device == "cuda" else "32-true",
            "max_steps": steps,
            "log_every_n_steps": 1,
            "default_root_dir": str(directory / "fit"),
            "enable_progress_bar": False,
        },
        "model": {
            "model_name_or_path": str(model_dir),
            "num_generations": num_generations,
            "max_completion_length": completion_length,
            "micro_batch_size": 2 * num_generations,
            "forward_token_budget": None if device == "cuda" else 1024,
            "rewards": [{"name": "even_token_fraction"}],
        },
        "data": {"path": "json", "data_files": str(REPO_DIR / "configs/data/quickstart.jsonl"), "batch_size": 8},
        # no weight decay: the weights move only where the policy gradient moves them
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-5, "weight_decay": 0.0}},
    }
    (directory / "fit.yaml").write_text(yaml.safe_dump(config))
    steps_seen: list[dict] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps_seen.append({name: float(value) for name, value in trainer.callback_metrics.items()})

    register_check_reward()
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cli = run_cli(["--config", str(directory / "fit.yaml")], run=False)
    cli.trainer.callbacks.append(Record())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    trained = {name: tensor.detach().float().cpu() for name, tensor in cli.model.policy.state_dict().items()}
    moved = max((trained[name] - initial[name]).abs().max().item() for name in initial)
    prompt_tokens = [len(cli.model.tokenizer(p, add_special_tokens=False).input_ids) for p in cli.datamodule.train_dataset["prompt"][:8]]
    result = {
        "precision": config["trainer"]["precision"],
        "steps": len(steps_seen),
        "losses": [step["loss"] for step in steps_seen],
        "all_losses_finite": all(math.isfinite(step["loss"]) for step in steps_seen),
        "max_weight_change": moved,
        "weights_changed": moved > 0,
        "trainable_dtypes": sorted({str(p.dtype) for p in cli.model.policy.parameters() if p.requires_grad}),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }
    # training speed of the last step (the first one compiles kernels and warms caches)
    last = steps_seen[-1]
    mean_completion = last["completions/mean_length"]
    mean_prompt = sum(prompt_tokens) / len(prompt_tokens)
    rows = [(round(mean_prompt), round(mean_completion))] * (len(prompt_tokens) * num_generations)
    trained_tokens = sum(p + c for p, c in rows)
    shape = ModelShape.from_config(cli.model.policy.config)
    training_flops = grpo_step_flops(shape, rows, num_generations, beta=0.0).training
    result.update(
        time_train_seconds=last["time/train"],
        time_generate_seconds=last["time/generate"],
        trained_tokens=trained_tokens,
        training_tokens_per_second=trained_tokens / last["time/train"],
        training_flops=training_flops,
    )
    return result


# ----------------------------------------------------------------------------------------------
# 3. Decoding speed and the memory-bandwidth floor
# ----------------------------------------------------------------------------------------------


def copy_bandwidth(device: str, gib: float) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the fastest of 5."""
    count = int(gib * 2**30 / 4)
    source = torch.empty(count, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(timed(device, lambda: target.copy_(source))[1] for _ in range(5))
    return 2 * source.numel() * 4 / best


def matmul_rate(device: str, size: int) -> float:
    """FLOP/s of a square bf16 (cuda) or float32 (cpu) matmul, the fastest of 5."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best = min(timed(device, lambda: a @ b)[1] for _ in range(5))
    return 2 * size**3 / best


def decode_speed(model_dir: Path, device: str, rows: int, new_tokens: int, bandwidth: float) -> dict:
    from transformers import GenerationConfig

    from lit_grpo.generation import generate_completions

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = load(model_dir, device, dtype)
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=model.generation_config.eos_token_id,
    )
    texts = prompts(rows)
    prompt_tokens = max(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts)
    result = {"rows": rows, "new_tokens": new_tokens, "dtype": str(dtype).removeprefix("torch.")}
    for backend in ("lit", "transformers"):
        generate_completions(model, tokenizer, texts[:2], 1, GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4}), backend=backend)
        _, seconds = timed(device, lambda: generate_completions(model, tokenizer, texts, 1, config, backend=backend))
        result[f"{backend}_ms_per_step"] = 1000 * seconds / new_tokens
    # the floor: every weight read once per step, and every row's keys and values so far
    shape = ModelShape.from_config(model.config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = shape.hidden_size // shape.num_attention_heads
    kv_bytes_per_position = 2 * shape.num_hidden_layers * shape.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8
    mean_context = prompt_tokens + new_tokens / 2
    step_bytes = weight_bytes + rows * mean_context * kv_bytes_per_position
    result.update(
        weight_gib=weight_bytes / 2**30,
        mean_kv_cache_gib=rows * mean_context * kv_bytes_per_position / 2**30,
        floor_ms_per_step=1000 * step_bytes / bandwidth,
    )
    result["lit_over_floor"] = result["lit_ms_per_step"] / result["floor_ms_per_step"]
    result["transformers_over_floor"] = result["transformers_ms_per_step"] / result["floor_ms_per_step"]
    return result


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def machine(device: str) -> dict:
    facts = {"device": device, "torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor()}
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
        facts["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return facts


def markdown(report: dict) -> str:
    lines = [f"# GPU check on {report['machine'].get('gpu', report['machine']['device'])}", "", f"`{report['command']}`", ""]
    greedy = report["greedy"]
    lines += [
        "## Greedy tokens: lit sampler vs transformers generate",
        f"{greedy['rows_equal']} of {greedy['rows']} rows equal over {greedy['new_tokens']} new tokens ({greedy['dtype']}); "
        f"on average {greedy['mean_tokens_equal_before_first_difference']:.1f} tokens equal before the first difference.",
        "",
    ]
    fit = report["fit"]
    peak = "n/a" if fit["peak_memory_gib"] is None else f"{fit['peak_memory_gib']:.2f} GiB"
    lines += [
        f"## Short fit ({report['shapes'][0]}, {fit['precision']})",
        f"{fit['steps']} steps, losses {[round(x, 4) for x in fit['losses']]} (finite: {fit['all_losses_finite']}), "
        f"largest weight change {fit['max_weight_change']:.3g}, trainable dtypes {fit['trainable_dtypes']}, peak memory {peak}.",
        f"Training: {fit['trained_tokens']} tokens in {fit['time_train_seconds']:.2f} s = {fit['training_tokens_per_second']:.0f} tokens/s; "
        f"the matmul floor at {report['matmul_tflops']:.1f} TFLOP/s allows {fit['floor_tokens_per_second']:.0f} tokens/s "
        f"({100 * fit['training_tokens_per_second'] / fit['floor_tokens_per_second']:.1f} % of it).",
        "",
        f"## Decoding ({report['copy_bandwidth_gbs']:.0f} GB/s measured copy bandwidth)",
        "| shape | rows x new tokens | lit ms/step | transformers ms/step | floor ms/step | lit / floor | transformers / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in report["decode"].items():
        lines.append(
            f"| {name} | {row['rows']} x {row['new_tokens']} | {row['lit_ms_per_step']:.2f} | {row['transformers_ms_per_step']:.2f} "
            f"| {row['floor_ms_per_step']:.3f} | {row['lit_over_floor']:.1f} | {row['transformers_over_floor']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("python -m bench.gpu_check: no CUDA device here; use --device cpu --shapes tiny")
    greedy_prompts, greedy_tokens, decode_rows, decode_tokens, fit_generations, fit_length, fit_steps = SIZES[args.device]
    start = time.perf_counter()
    report: dict = {
        "command": "python -m bench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(args.device),
        "shapes": args.shapes,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        directory = Path(tmp)
        built = {name: build(name, directory) for name in args.shapes}
        report["greedy"] = greedy_agreement(built[args.shapes[0]], args.device, greedy_prompts, greedy_tokens)
        report["fit"] = short_fit(built[args.shapes[0]], args.device, directory, fit_generations, fit_length, fit_steps)
        bandwidth = copy_bandwidth(args.device, 1.0 if args.device == "cuda" else 0.25)
        rate = matmul_rate(args.device, 8192 if args.device == "cuda" else 1024)
        report["copy_bandwidth_gbs"] = bandwidth / 1e9
        report["matmul_tflops"] = rate / 1e12
        fit = report["fit"]
        fit["floor_tokens_per_second"] = fit["trained_tokens"] / (fit["training_flops"] / rate)
        report["decode"] = {name: decode_speed(path, args.device, decode_rows, decode_tokens, bandwidth) for name, path in built.items()}
    report["seconds"] = time.perf_counter() - start
    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_check_{args.device}.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out / f"gpu_check_{args.device}.md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
