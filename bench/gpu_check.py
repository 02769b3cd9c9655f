"""A first check of lit-grpo on one GPU, in one command, with nothing from a hub or a package index.

    python -m bench.gpu_check                                  # CUDA: Qwen2.5-0.5B and 1.5B shapes
    python -m bench.gpu_check --device cpu --shapes tiny       # the same checks at toy size (tests/bench/test_bench_gpu_check.py)

The models have random weights and the shapes of Qwen2.5-0.5B and 1.5B (``lit_grpo.tiny``,
``architecture="qwen2"``: Qwen2's model class, the real hidden sizes, layers, heads and vocabulary,
a byte-level tokenizer and the ChatML template). Only the first shape is written to disk (in bf16,
about 1 GB at 0.5B), for the trainers and vLLM to load; the others are built in memory. It reports:

1. **The sampler against ``generate``** on the first shape, in bf16 on CUDA: the ``lit`` sampler's
   greedy tokens against ``transformers``' ``generate`` (rows equal, tokens equal before the first
   difference; with random weights, near ties make this weak in bf16), and a measure random weights
   cannot weaken: each sampler samples (temperature 1, every completion the same length), and the
   log-prob of each sampled token under the logits the sampler computed is set against a
   teacher-forced forward of the whole sequence (max and mean absolute difference). ``generate``'s
   difference is the yardstick: bf16 with a KV cache never matches a full forward exactly.
2. **lit-grpo against TRL 1.16's ``GRPOTrainer``** (``--pairs`` pairs, alternating, each run in its own
   process: ``bench.trainer_runs``) on the first shape, the quickstart prompts, the same reward, G,
   completion length, learning rate and precision (``bf16-mixed`` / ``bf16=True``: float32 weights,
   bf16 autocast; TRL samples with ``generate``): seconds per step, completion tokens per second,
   peak GPU memory of each, and their ratios; each run's losses are finite, its weights moved and
   its trainable weights are float32.
3. **Floors**: the step's parts against what the hardware allows. Generation: every decode step
   reads every weight once and each running row's KV cache, at the copy bandwidth measured here, or
   does its matmuls at the fastest bf16 matmul rate measured here, whichever takes longer. Training:
   its matmul FLOPs (``bench.flops.grpo_step_flops``) at that rate. The part furthest from its floor
   is named.
4. **Decoding speed** for every shape and backend: milliseconds per decoding step of 64 rows x 512
   new tokens against the same generation floor.
5. With vLLM installed, the ``vllm`` backend's rows in 1, 2 (a lit-grpo run that samples with vLLM)
   and 4 (the first shape: one engine per process); without it, one line says so.
6. **Padding-free forwards** (``model.padding_free``) on the first shape: one forward + backward of 8
   rows whose completions are spread as a reasoning run's (``bench/padding_free.py``), padded against
   packed (flash attention's variable-length kernel where ``flash-attn`` is installed, else sdpa's
   block-diagonal mask), and the largest difference of their log-probs.
7. **Sequence parallelism's shared shuffle** (``model.sequence_parallel_size``): the seed broadcast over a
   one-process NCCL group, as Lightning's CUDA runs make them (NCCL takes no CPU tensors).

Results go to ``bench/results/gpu_check_<device>.json`` and ``.md`` (the GPU's name on CUDA;
``--out`` and ``--name`` elsewhere).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.flops import ModelShape, forward_flops, grpo_step_flops
from bench.harness import (
    QUICKSTART_DATA,
    RESULTS_DIR,
    command_line,
    fmt,
    markdown_table,
    per_pair_ratios,
    run_in_subprocess,
    summarize_runs,
    write_outputs,
)
from bench.trainer_runs import RunSpec

# Qwen2.5's config.json values; "tiny" for the CPU test (the tokenizer's own vocabulary; head size
# 32, the least vLLM's CPU build takes, so that its rows run at toy size too)
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=None),
}


@dataclass(frozen=True)
class Sizes:
    """How much work each part does."""

    sampler_prompts: int  # rows of the sampler checks (1 completion each)
    sampler_tokens: int  # new tokens of each
    decode_rows: int
    decode_tokens: int
    generations: int  # G of the trainer runs
    prompts_per_step: int
    completion_length: int
    warmup_steps: int  # untimed steps at the start of every trainer run
    timed_steps: int
    pairs: int  # lit-grpo / TRL runs, alternating


SIZES = {
    "cuda": Sizes(64, 64, 64, 512, generations=8, prompts_per_step=8, completion_length=256, warmup_steps=1, timed_steps=2, pairs=2),
    "cpu": Sizes(8, 8, 4, 16, generations=4, prompts_per_step=8, completion_length=8, warmup_steps=1, timed_steps=1, pairs=2),
}
# a sampler's log-prob differences are "like generate's" within this factor of generate's own (plus
# the slack, for float32, where both are ~1e-6)
LIKE_GENERATE_FACTOR, LIKE_GENERATE_SLACK = 2.0, 1e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--pairs", type=int, default=None, help="lit-grpo/TRL run pairs (default: 2)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the .json and .md")
    parser.add_argument("--name", default=None, help="file name (default: gpu_check_<the GPU's name, or cpu>)")
    return parser.parse_args(argv)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


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


def compute_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def release_memory(device: str) -> None:
    """Give the cached blocks back, so that the next part (another process) has the GPU to itself."""
    if device == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def build_checkpoint(shape_name: str, directory: Path) -> Path:
    """The shape's random model and tokenizer, saved in bf16 like hub checkpoints."""
    from lit_grpo.tiny import build_tiny_model

    return build_tiny_model(
        directory / shape_name, architecture="qwen2", dtype="bfloat16", max_position_embeddings=4096, **SHAPES[shape_name]
    )


def load(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def random_model(checkpoint: Path, shape_name: str, device: str, dtype: torch.dtype):
    """A random model of ``shape_name`` built in memory on ``device`` (no checkpoint written), with the
    configuration and the tokenizer of ``checkpoint`` otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    shape = {key: value for key, value in SHAPES[shape_name].items() if value is not None}
    config = AutoConfig.from_pretrained(checkpoint, **shape)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig.from_pretrained(checkpoint)  # both EOS ids
    return model.eval(), tokenizer


def prompts(count: int) -> list[str]:
    """Prompts of varied lengths (left padding matters to the sampler)."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
    return [f"Question {i}: " + " ".join(words[: 3 + i % len(words)]) + "?" for i in range(count)]


def sampling_config(generation_config, new_tokens: int):
    """Temperature 1 with no filter, every completion ``new_tokens`` long (EOS held back), with the EOS
    and padding ids of the model's ``generation_config``."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        pad_token_id=generation_config.pad_token_id, eos_token_id=generation_config.eos_token_id,
    )


# ----------------------------------------------------------------------------------------------
# 1. The sampler against generate
# ----------------------------------------------------------------------------------------------


def greedy_agreement(model, tokenizer, texts: list[str], new_tokens: int) -> dict:
    """The ``lit`` sampler's greedy tokens against ``generate``'s."""
    from transformers import GenerationConfig

    from lit_grpo.rollout.engines.policy import generate_completions

    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id,
    )
    rollouts = {backend: generate_completions(model, tokenizer, texts, 1, config, backend=backend) for backend in ("lit", "transformers")}
    lit, reference = (rollouts[b].completion_ids.cpu() for b in ("lit", "transformers"))
    width = max(lit.size(1), reference.size(1))
    lit, reference = (torch.nn.functional.pad(ids, (0, width - ids.size(1)), value=tokenizer.pad_token_id) for ids in (lit, reference))
    differs = lit != reference  # [rows, width]
    first_difference = torch.where(differs.any(1), differs.int().argmax(1), torch.full((lit.size(0),), width))
    return {
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "rows": lit.size(0),
        "rows_equal": int((~differs.any(1)).sum()),
        "mean_tokens_equal_before_first_difference": float(first_difference.float().mean()),
        "new_tokens": new_tokens,
    }


@torch.no_grad()
def teacher_forced_logps(model, rollout) -> torch.Tensor:
    """``[N, C]`` log-probs of the rollout's completion tokens from one forward of prompt + completion."""
    from lit_grpo.algorithm import selective_log_softmax
    from lit_grpo.rollout.records import position_ids_from_mask

    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    width = rollout.completion_ids.size(1)
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), logits_to_keep=width + 1
    ).logits[:, :-1]  # [N, C, V]: position P - 1 + t predicts completion token t
    return selective_log_softmax(logits, rollout.completion_ids)


def logprob_differences(sampler_logps: torch.Tensor, reference_logps: torch.Tensor, mask: torch.Tensor) -> dict:
    """Max and mean absolute difference over the real completion tokens."""
    difference = (sampler_logps.float() - reference_logps.float()).abs()[mask.bool()]
    return {
        "max_abs_difference": difference.max().item(),
        "mean_abs_difference": difference.mean().item(),
        "tokens": difference.numel(),
    }


@torch.no_grad()
def sampled_logprob_check(model, tokenizer, texts: list[str], new_tokens: int, backend: str) -> dict:
    """Sample one completion per prompt with ``backend`` (a name in ``lit_grpo.rollout.engines.policy.SAMPLERS``)
    and compare the log-prob of each sampled token under the logits the sampler's own forwards
    returned with a teacher-forced forward of the finished sequence.

    The sampler's logits are caught by a forward hook on the model: one call per new token (the
    prefill and every decode step but the last), every row in each (no completion may end early:
    EOS is held back), so call t's logits predicted token t."""
    from lit_grpo.algorithm import selective_log_softmax
    from lit_grpo.rollout.engines.policy import generate_completions

    calls: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, output: calls.append(output.logits[:, -1]))
    try:
        config = sampling_config(model.generation_config, new_tokens)
        rollout = generate_completions(model, tokenizer, texts, 1, config, backend=backend)
    finally:
        hook.remove()
    if len(calls) != rollout.completion_ids.size(1) or any(logits.size(0) != len(texts) for logits in calls):
        raise RuntimeError(f"{backend}: {len(calls)} forwards for {rollout.completion_ids.size(1)} new tokens of {len(texts)} rows")
    sampler_logits = torch.stack(calls, dim=1)  # [N, C, V]
    sampler_logps = selective_log_softmax(sampler_logits, rollout.completion_ids)
    return logprob_differences(sampler_logps, teacher_forced_logps(model, rollout), rollout.completion_mask)


def like_generate(row: dict, generate: dict) -> bool:
    """Whether a sampler's log-prob differences are within :data:`LIKE_GENERATE_FACTOR` of ``generate``'s."""
    return all(
        row[key] <= LIKE_GENERATE_FACTOR * generate[key] + LIKE_GENERATE_SLACK for key in ("max_abs_difference", "mean_abs_difference")
    )


def sampler_checks(checkpoint: Path, device: str, sizes: Sizes) -> dict:
    """Greedy agreement (float32 on the CPU, where it is exact) and the log-prob check (bf16)."""
    texts = prompts(sizes.sampler_prompts)
    model, tokenizer = load(checkpoint, device, compute_dtype(device))
    greedy = greedy_agreement(model, tokenizer, texts, sizes.sampler_tokens)
    model = model.to(torch.bfloat16)
    logprobs = {backend: sampled_logprob_check(model, tokenizer, texts, sizes.sampler_tokens, backend) for backend in ("lit", "transformers")}
    logprobs["lit"]["like_generate"] = like_generate(logprobs["lit"], logprobs["transformers"])
    del model
    release_memory(device)
    return {"greedy": greedy, "logprobs": logprobs, "logprob_dtype": "bfloat16", "logprob_tokens": sizes.sampler_tokens}


# ----------------------------------------------------------------------------------------------
# 2. lit-grpo against TRL
# ----------------------------------------------------------------------------------------------


def last_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def trainer_runs(model_dir: Path, device: str, sizes: Sizes, trainers: dict[str, tuple[str, dict]]) -> tuple[dict, dict]:
    """``sizes.pairs`` rounds of one run of each trainer, in turn (A B A B ...), each in its own process.
    ``trainers`` maps a label to ``(RunSpec.trainer, lit_options)``. Returns the results of each label,
    and the error of each label whose run failed (it runs no more; the others go on)."""
    runs: dict[str, list[dict]] = {label: [] for label in trainers}
    failures: dict[str, str] = {}
    for round_index in range(sizes.pairs):
        for label, (trainer, lit_options) in trainers.items():
            if label in failures:
                continue
            spec = RunSpec(
                trainer=trainer,
                model_dir=str(model_dir),
                data_file=str(QUICKSTART_DATA),
                steps=sizes.warmup_steps + sizes.timed_steps,
                num_generations=sizes.generations,
                prompts_per_step=sizes.prompts_per_step,
                max_completion_length=sizes.completion_length,
                precision="bf16" if device == "cuda" else "fp32",
                device=device,
                reward="even_token_fraction",
                lit_options=lit_options,
                record_weight_change=round_index == 0,
            )
            start = time.perf_counter()
            try:
                runs[label].append(run_in_subprocess(spec))
            except RuntimeError as error:  # the run's process failed: its stderr's tail
                failures[label] = str(error)
                runs.pop(label)
            print(f"  {label} run {round_index + 1}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return runs, failures


def training_facts(results: list[dict]) -> dict:
    """What the runs did to the model: finite losses, weights moved, trainable dtypes."""
    losses = [step["loss"] for result in results for step in result["steps"]]
    moved = [result["max_weight_change"] for result in results if result["max_weight_change"] is not None]
    return {
        "losses": losses,
        "all_losses_finite": all(loss is not None and math.isfinite(loss) for loss in losses),
        "max_weight_change": max(moved) if moved else None,
        "weights_changed": bool(moved) and max(moved) > 0,
        "trainable_dtypes": sorted({dtype for result in results for dtype in result["trainable_dtypes"] or []}),
    }


# ----------------------------------------------------------------------------------------------
# 3. Floors
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What this device was measured to do: the floors' rates."""

    copy_bytes_per_second: float
    matmul_flops_per_second: float


def copy_bandwidth(device: str, gib: float) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the fastest of 5."""
    count = int(gib * 2**30 / 4)
    source = torch.empty(count, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(timed(device, lambda: target.copy_(source))[1] for _ in range(5))
    return 2 * source.numel() * 4 / best


def matmul_rate(device: str, size: int) -> float:
    """FLOP/s of a square matmul in the compute dtype (bf16 on CUDA, float32 on the CPU), the fastest of 5."""
    a = torch.randn(size, size, device=device, dtype=compute_dtype(device))
    b = torch.randn(size, size, device=device, dtype=compute_dtype(device))
    a @ b
    best = min(timed(device, lambda: a @ b)[1] for _ in range(5))
    return 2 * size**3 / best


def weight_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of the weights every forward multiplies by: each layer's projections and the (tied) output head."""
    return (shape.linear_weights_per_layer * shape.num_hidden_layers + shape.vocab_size * shape.hidden_size) * dtype_bytes


def kv_bytes_per_position(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of keys and values one position adds to the cache, over all layers."""
    return 2 * shape.num_hidden_layers * shape.key_value_width * dtype_bytes


def generation_floor_seconds(shape: ModelShape, rows: list[tuple[int, int]], group_size: int, dtype_bytes: int, hardware: Hardware) -> float:
    """The least time sampling ``rows`` (``(prompt_length, completion_length)``, ``group_size`` rows per
    distinct prompt) can take: each distinct prompt prefilled once, then per decode step the slower of
    reading every weight and the running rows' KV caches at the copy bandwidth and doing the step's
    matmuls at the matmul rate. As :func:`bench.flops.generation_flops`, a completion of c tokens takes
    c - 1 decode steps after the prefill (the prefill's logits give the first token)."""
    weights, per_position = weight_bytes(shape, dtype_bytes), kv_bytes_per_position(shape, dtype_bytes)
    seconds = 0.0
    for prompt_length, _ in rows[::group_size]:  # the prefill: at least one pass over the weights
        flops = forward_flops(shape, prompt_length, prompt_length * (prompt_length + 1) // 2, 1)
        seconds += max(weights / hardware.copy_bytes_per_second, flops / hardware.matmul_flops_per_second)
    for step in range(1, max(length for _, length in rows)):
        running = [prompt_length for prompt_length, length in rows if length > step]
        read = weights + sum(prompt_length + step for prompt_length in running) * per_position
        flops = sum(forward_flops(shape, 1, prompt_length + step, 1) for prompt_length in running)
        seconds += max(read / hardware.copy_bytes_per_second, flops / hardware.matmul_flops_per_second)
    return seconds


# the parts of a step each trainer times (bench.trainer_runs: lit-grpo's time/* metrics; TRL's
# profiling sections, its training being the step less _prepare_inputs)
PARTS = ("generate", "weight_sync", "rewards", "logprobs", "train")


def step_parts(step: dict, trainer: str) -> dict[str, float]:
    """Seconds of each of :data:`PARTS` the trainer timed in ``step``, and ``other``: the rest of the step."""
    phases = dict(step["phases"])
    if trainer == "trl":
        phases["train"] = step["seconds"] - phases.pop("prepare_inputs")
    parts = {part: phases[part] for part in PARTS if part in phases}
    parts["other"] = step["seconds"] - sum(parts.values())
    return parts


def step_floors(step: dict, shape: ModelShape, group_size: int, dtype_bytes: int, hardware: Hardware) -> dict[str, float]:
    """The floor of each part of ``step`` that has one (generation, the log-prob passes and training)."""
    rows = list(zip(step["prompt_lengths"], step["completion_lengths"]))
    flops = grpo_step_flops(shape, rows, group_size, beta=0.0)
    return {
        "generate": generation_floor_seconds(shape, rows, group_size, dtype_bytes, hardware),
        "logprobs": flops.logprobs / hardware.matmul_flops_per_second,
        "train": flops.training / hardware.matmul_flops_per_second,
    }


def parts_against_floors(results: list[dict], warmup_steps: int, trainer: str, shape: ModelShape, group_size: int,
                         dtype_bytes: int, hardware: Hardware) -> dict:
    """Median seconds of each part over the timed steps, its floor, and how many times the floor it took;
    ``furthest``: the part with a floor that is furthest above it; training tokens per second against
    the matmul floor's."""
    steps = [step for result in results for step in result["steps"][warmup_steps:]]
    measured = [step_parts(step, trainer) for step in steps]
    floors = [step_floors(step, shape, group_size, dtype_bytes, hardware) for step in steps]
    parts = {}
    for part in measured[0]:
        seconds = statistics.median(m[part] for m in measured)
        floor = statistics.median(f[part] for f in floors) if part in floors[0] else None
        parts[part] = {"seconds": seconds, "floor_seconds": floor, "over_floor": seconds / floor if floor else None}
    trained_tokens = statistics.median(sum(step["prompt_lengths"]) + sum(step["completion_lengths"]) for step in steps)
    with_floor = [part for part in parts if parts[part]["over_floor"] is not None]
    return {
        "parts": parts,
        "furthest": max(with_floor, key=lambda part: parts[part]["over_floor"]),
        "trained_tokens": trained_tokens,
        "training_tokens_per_second": trained_tokens / parts["train"]["seconds"],
        "floor_training_tokens_per_second": trained_tokens / parts["train"]["floor_seconds"],
    }


def trainer_comparison(model_dir: Path, device: str, sizes: Sizes, trainers: dict, hardware: Hardware) -> dict:
    """Part 2 and the fit's half of part 3."""
    from transformers import AutoConfig

    shape = ModelShape.from_config(AutoConfig.from_pretrained(model_dir))
    dtype_bytes = torch.finfo(compute_dtype(device)).bits // 8
    runs, failures = trainer_runs(model_dir, device, sizes, trainers)
    summaries = {}
    for label, results in runs.items():
        summary = summarize_runs(results, sizes.warmup_steps, shape, hardware.matmul_flops_per_second)
        summary.update(training_facts(results))
        summary["floors"] = parts_against_floors(
            results, sizes.warmup_steps, trainers[label][0], shape, sizes.generations, dtype_bytes, hardware
        )
        summaries[label] = summary
    comparison = {"sizes": asdict(sizes), "summaries": summaries, "runs": runs, "failures": failures}
    if "trl" in runs and "lit-grpo" in runs:
        lit, trl = summaries["lit-grpo"], summaries["trl"]
        ratios = per_pair_ratios(runs["lit-grpo"], runs["trl"], sizes.warmup_steps)
        comparison.update(
            tokens_per_second_ratio_per_pair=ratios,
            tokens_per_second_ratio=statistics.median(ratios),
            step_seconds_ratio=trl["median_step_seconds"] / lit["median_step_seconds"],
            peak_gpu_memory_ratio=(
                lit["peak_gpu_memory_gib"] / trl["peak_gpu_memory_gib"] if lit["peak_gpu_memory_gib"] is not None else None
            ),
        )
    return comparison


# ----------------------------------------------------------------------------------------------
# 4. Decoding speed
# ----------------------------------------------------------------------------------------------


def decode_floor(model, rows: list[tuple[int, int]], hardware: Hardware) -> dict:
    """The generation floor of ``rows`` (one completion per prompt) per decoding step."""
    shape = ModelShape.from_config(model.config)
    dtype_bytes = next(model.parameters()).element_size()
    new_tokens = max(length for _, length in rows)
    return {
        "weight_gib": weight_bytes(shape, dtype_bytes) / 2**30,
        "floor_ms_per_step": 1000 * generation_floor_seconds(shape, rows, 1, dtype_bytes, hardware) / new_tokens,
    }


def decode_speed(model, tokenizer, device: str, rows: int, new_tokens: int, hardware: Hardware) -> dict:
    """Milliseconds per decoding step of ``rows`` x ``new_tokens`` for the ``lit`` and ``transformers``
    backends, and the floor."""
    from transformers import GenerationConfig

    from lit_grpo.rollout.engines.policy import generate_completions

    config = sampling_config(model.generation_config, new_tokens)
    texts = prompts(rows)
    result = {"rows": rows, "new_tokens": new_tokens, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    for backend in ("lit", "transformers"):
        warm_up = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4})
        generate_completions(model, tokenizer, texts[:2], 1, warm_up, backend=backend)
        _, seconds = timed(device, lambda backend=backend: generate_completions(model, tokenizer, texts, 1, config, backend=backend))
        result[f"{backend}_ms_per_step"] = 1000 * seconds / new_tokens
    prompt_lengths = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in texts]
    result.update(decode_floor(model, [(length, new_tokens) for length in prompt_lengths], hardware))
    return result


def decode_rows(checkpoint: Path, shape_names: list[str], device: str, sizes: Sizes, hardware: Hardware) -> dict:
    rows = {}
    for name in shape_names:
        model, tokenizer = random_model(checkpoint, name, device, compute_dtype(device))
        rows[name] = decode_speed(model, tokenizer, device, sizes.decode_rows, sizes.decode_tokens, hardware)
        del model
        release_memory(device)
    return rows


# ----------------------------------------------------------------------------------------------
# 5. vLLM
# ----------------------------------------------------------------------------------------------


def vllm_rows(checkpoint: Path, device: str, sizes: Sizes, hardware: Hardware) -> dict:
    """The ``vllm`` backend (``lit_grpo.rollout.engines.vllm_colocated.ColocatedVLLMEngine``, as a run builds it) on the first
    shape: its log-probs of its own samples against a teacher-forced forward (bf16), and its decoding
    speed (a completion may stop at EOS here: vLLM's sampler is not told to hold it back, and ms per
    step divides by the longest completion). The engine is built before the model of the forward is
    loaded, as a run builds it before its policy."""
    from transformers import AutoTokenizer, GenerationConfig

    from lit_grpo.rollout.engines.requests import tokenize_prompts
    from lit_grpo.rollout.engines.vllm_colocated import ColocatedVLLMEngine, VLLMSettings

    tokenizer, generation_config = AutoTokenizer.from_pretrained(checkpoint), GenerationConfig.from_pretrained(checkpoint)
    sampler = ColocatedVLLMEngine(str(checkpoint), torch.bfloat16, VLLMSettings(), None, sizes.decode_tokens)

    def sample(texts: list[str], new_tokens: int):
        prompt_ids, prompt_mask, truncated = tokenize_prompts(tokenizer, texts, None, device)
        config = sampling_config(generation_config, new_tokens)
        return sampler.generate(prompt_ids, prompt_mask, truncated, 1, config, tokenizer.pad_token_id)

    try:
        sample(prompts(2), 4)  # builds the engine
        model, _ = load(checkpoint, device, torch.bfloat16)
        rollout = sample(prompts(sizes.sampler_prompts), sizes.sampler_tokens)
        logprobs = logprob_differences(rollout.sampling_logps, teacher_forced_logps(model, rollout), rollout.completion_mask)
        texts = prompts(sizes.decode_rows)
        rollout, seconds = timed(device, lambda: sample(texts, sizes.decode_tokens))
        steps = rollout.completion_ids.size(1)
        lengths = rollout.completion_mask.sum(1).tolist()
        prompt_lengths = rollout.prompt_mask.sum(1).tolist()
        floor = decode_floor(model, list(zip(prompt_lengths, lengths)), hardware)["floor_ms_per_step"]
        decode = {"vllm_ms_per_step": 1000 * seconds / steps, "vllm_floor_ms_per_step": floor, "vllm_mean_new_tokens": sum(lengths) / len(lengths)}
        return {"logprobs": logprobs, "decode": decode}
    finally:
        sampler.close()
        release_memory(device)


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def machine(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    facts = {"device": device, "python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
        facts["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    for package in ("torch", "transformers", "lightning", "trl", "vllm"):
        try:
            facts[package] = version(package)
        except PackageNotFoundError:
            facts[package] = None
    return facts


def scoring_thread_devices(model_dir: Path, device: str, steps: int = 2) -> dict:
    """Issue 49.13: a one-step-off run (``max_staleness: 1``, ``steps`` optimizer steps) on ``device``;
    the devices of every tensor the asynchronous pipeline's scoring thread read or made (each batch's
    rollout and rewards) and the threads it scored in. All on the CPU, also on CUDA: the thread never
    waits for the trainer's stream (one copy per batch, made by the trainer)."""
    import threading

    import datasets
    import lightning.pytorch as pl

    from lit_grpo import GRPODataModule, GRPOModule

    devices: set[str] = set()
    threads: set[str] = set()
    module = GRPOModule(str(model_dir), rewards=[{"name": "char_fraction"}], num_generations=4, max_completion_length=8,
                        max_staleness=1, log_completions_every_n_steps=0)
    score = module.collector.score

    def recording_score(scorer, batch, rollout, k, device=None):
        completions, rewards = score(scorer, batch, rollout, k, device=device)
        if threading.current_thread() is not threading.main_thread():
            threads.add(threading.current_thread().name)
            devices.update(str(value.device) for value in [*vars(rollout).values(), rewards] if isinstance(value, torch.Tensor))
        return completions, rewards

    module.collector.score = recording_score
    rows = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines() if line.strip()][: 4 * (steps + 1)]
    data = GRPODataModule.from_data(datasets.Dataset.from_list(rows), batch_size=2, seed=0)
    with tempfile.TemporaryDirectory(prefix="gpu-check-async-") as root:
        trainer = pl.Trainer(max_steps=steps, accelerator=device, devices=1, default_root_dir=root, log_every_n_steps=1,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(module, datamodule=data)
    return {"devices": sorted(devices), "threads": sorted(threads), "cpu_only": devices == {"cpu"}}


def device_name(facts: dict) -> str:
    """``cpu``, or the GPU's name as a file name (``nvidia_h100_80gb_hbm3``)."""
    return re.sub(r"[^a-z0-9]+", "_", facts["gpu"].lower()).strip("_") if "gpu" in facts else facts["device"]


def sampler_markdown(report: dict) -> list[str]:
    samplers = report["samplers"]
    greedy, logprobs = samplers["greedy"], samplers["logprobs"]
    generate = logprobs["transformers"]
    table = [
        [name, f"{row['max_abs_difference']:.3g}", f"{row['mean_abs_difference']:.3g}",
         "the yardstick" if name == "transformers" else ("yes" if like_generate(row, generate) else "**no**")]
        for name, row in logprobs.items()
    ]
    return [
        f"## Samplers against `generate` ({report['shapes'][0]})",
        "",
        f"Greedy ({greedy['dtype']}): {greedy['rows_equal']} of {greedy['rows']} rows of the `lit` sampler equal `generate`'s "
        f"over {greedy['new_tokens']} new tokens; on average {greedy['mean_tokens_equal_before_first_difference']:.1f} tokens "
        "equal before the first difference (random weights leave near ties, which bf16 breaks either way).",
        "",
        f"Log-prob of each sampled token ({samplers['logprob_dtype']}, {greedy['rows']} rows x {samplers['logprob_tokens']} tokens, "
        "temperature 1) under the logits the sampler computed, against a teacher-forced forward of the same sequence:",
        "",
        markdown_table(["sampler", "max abs difference", "mean abs difference",
                        f"within {LIKE_GENERATE_FACTOR:g}x of generate's"], table),
        "",
    ]


def fit_markdown(report: dict) -> list[str]:
    fit = report["fit"]
    sizes, summaries = fit["sizes"], fit["summaries"]
    precision = "bf16 autocast, float32 weights" if report["machine"]["device"] == "cuda" else "float32"
    lines = [
        f"## lit-grpo against TRL's GRPOTrainer ({report['shapes'][0]}, {precision})",
        "",
        f"G = {sizes['generations']} completions of up to {sizes['completion_length']} tokens for {sizes['prompts_per_step']} "
        f"quickstart prompts per step, reward `even_token_fraction`; {sizes['pairs']} run(s) of each, alternating, each in its "
        f"own process; {sizes['warmup_steps']} warm-up step(s) per run, then {sizes['timed_steps']} timed.",
        "",
    ]
    table = []
    for label, s in summaries.items():
        peak = "n/a" if s["peak_gpu_memory_gib"] is None else f"{s['peak_gpu_memory_gib']:.2f}"
        moved = "n/a" if s["max_weight_change"] is None else f"{s['max_weight_change']:.2g}"
        table.append([label, fmt(s["median_step_seconds"]), fmt(s["tokens_per_second"], 0), peak,
                      "yes" if s["all_losses_finite"] else "**no**", moved, ", ".join(s["trainable_dtypes"])])
    lines += [markdown_table(["trainer", "s/step", "completion tok/s", "peak GPU GiB", "losses finite",
                              "largest weight change", "trainable dtypes"], table), ""]
    if "tokens_per_second_ratio" in fit:
        memory = "" if fit["peak_gpu_memory_ratio"] is None else f"; peak GPU memory lit-grpo/TRL {fit['peak_gpu_memory_ratio']:.2f}"
        pairs = ", ".join(f"{ratio:.2f}" for ratio in fit["tokens_per_second_ratio_per_pair"])
        lines += [f"lit-grpo/TRL completion tokens per second: {fit['tokens_per_second_ratio']:.2f} (per pair: {pairs}); "
                  f"TRL/lit-grpo seconds per step {fit['step_seconds_ratio']:.2f}{memory}.", ""]
    return lines


def floors_markdown(report: dict) -> list[str]:
    hardware = report["hardware"]
    lines = [
        "## Parts of a step against their floors",
        "",
        f"Measured here: copy bandwidth {hardware['copy_bytes_per_second'] / 1e9:.0f} GB/s, "
        f"matmul {hardware['matmul_flops_per_second'] / 1e12:.2f} TFLOP/s ({report['samplers']['greedy']['dtype']}). "
        "Median seconds per timed step; `other` is the step less the timed parts.",
        "",
    ]
    table = []
    for label, summary in report["fit"]["summaries"].items():
        floors = summary["floors"]
        for part, row in floors["parts"].items():
            floor = "" if row["floor_seconds"] is None else fmt(row["floor_seconds"], 3)
            over = "" if row["over_floor"] is None else f"{row['over_floor']:.1f}"
            table.append([label, part, fmt(row["seconds"], 3), floor, over])
    lines += [markdown_table(["trainer", "part", "seconds", "floor seconds", "x floor"], table), ""]
    for label, summary in report["fit"]["summaries"].items():
        floors = summary["floors"]
        furthest = floors["parts"][floors["furthest"]]
        lines.append(
            f"- {label}: furthest from its floor: `{floors['furthest']}` ({furthest['over_floor']:.1f}x). Training: "
            f"{floors['training_tokens_per_second']:.0f} tokens/s, the matmul floor allows "
            f"{floors['floor_training_tokens_per_second']:.0f} ({100 * floors['training_tokens_per_second'] / floors['floor_training_tokens_per_second']:.1f} %)."
        )
    return lines + [""]


def decode_markdown(report: dict) -> list[str]:
    backends = ["lit", "transformers"] + (["vllm"] if any("vllm_ms_per_step" in row for row in report["decode"].values()) else [])
    table = []
    for name, row in report["decode"].items():
        cells = [name, f"{row['rows']} x {row['new_tokens']}", fmt(row["floor_ms_per_step"], 3)]
        for backend in backends:
            ms = row.get(f"{backend}_ms_per_step")
            floor = row.get(f"{backend}_floor_ms_per_step", row["floor_ms_per_step"])
            cells += ["n/a", ""] if ms is None else [fmt(ms), f"{ms / floor:.1f}"]
        table.append(cells)
    header = ["shape", "rows x new tokens", "floor ms/step"] + [h for b in backends for h in (f"{b} ms/step", f"{b} / floor")]
    return ["## Decoding", "", markdown_table(header, table), ""]


def padding_free_rows(checkpoint: Path, device: str) -> dict:
    """Packed against padded forward + backward of one micro-batch (``model.padding_free``,
    ``bench.padding_free.device_comparison``) on the first shape: flash attention's variable-length
    kernel where flash-attn is installed on CUDA, else sdpa with ``transformers``' block-diagonal mask."""
    from bench.padding_free import device_comparison

    attention = "flash_attention_2" if device == "cuda" and installed("flash_attn") else "sdpa"
    rows, max_completion_length = (8, 2048) if device == "cuda" else (4, 16)
    return device_comparison(checkpoint, device, rows, max_completion_length, attention)


def padding_free_markdown(report: dict) -> list[str]:
    row = report.get("padding_free")
    if row is None:
        return []
    seconds, tokens = row["seconds"], row["tokens"]
    return [
        "## Padding-free forwards (`model.padding_free`)", "",
        f"One forward + backward of {row['rows']} rows (completions up to {row['max_completion_length']} tokens, "
        f"spread as `bench/padding_free.py` draws them), attention `{row['attn_implementation']}`:", "",
        markdown_table(["forward", "tokens", "seconds"], [["padded", str(tokens["padded"]), f"{seconds['padded']:.3f}"],
                                                          ["packed", str(tokens["packed"]), f"{seconds['packed']:.3f}"]]),
        "", f"Packed / padded time: {row['packed_over_padded']:.2f}; largest log-prob difference {row['max_abs_logp_difference']:.2e}.", "",
    ]


def markdown(report: dict) -> str:
    facts = report["machine"]
    versions = ", ".join(f"{package} {facts[package]}" for package in ("torch", "transformers", "lightning", "trl", "vllm") if facts[package])
    lines = [
        f"# GPU check on {facts.get('gpu', facts['device'])}",
        "",
        f"`{report['command']}`",
        "",
        f"Python {facts['python']}, {versions}. The check took {report['seconds']:.0f} s "
        f"({', '.join(f'{part} {seconds:.0f} s' for part, seconds in report['part_seconds'].items())}).",
        "",
    ]
    if facts["device"] == "cpu":
        lines += ["On the CPU at toy size: a smoke test of the mechanics; its numbers say nothing about a GPU.", ""]
    lines += [f"- {note}" for note in report["notes"]] + ([""] if report["notes"] else [])
    lines += sampler_markdown(report) + fit_markdown(report) + floors_markdown(report) + decode_markdown(report)
    lines += padding_free_markdown(report)
    return "\n".join(lines)


def vllm_server_push_bound(model_dir: Path, timeout: float = 30.0) -> dict:
    """Issue 49.4: a vLLM server killed in the middle of an NCCL weight push (``vllm_server`` backend)
    ends the push as a lost server within about ``timeout`` (``model.vllm_server_timeout``: the push is
    abandoned and its NCCL communicator aborted), where vLLM's broadcast alone never returns; the GPU
    then still computes. On one GPU: ``lit-grpo serve`` on a share of its memory, the trainer's policy
    beside it; a first push, then a second during which the server is killed (once the push has taken
    two tensors). Without CUDA or vLLM: ``{"skipped": why}`` (tests/rollout/test_vllm_server.py checks the same
    bound on the CPU, with gloo and a stalled push)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the NCCL push needs one"}
    if not installed("vllm"):
        return {"skipped": "vLLM is not installed"}
    import os
    import signal
    import socket
    import subprocess
    import threading

    from transformers import AutoModelForCausalLM

    from lit_grpo.rollout.engines import vllm_server
    from lit_grpo.rollout.engines.server_lost import GenerationServerLost

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).with_name("lit-grpo")), "serve", str(model_dir), "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3", "--max-model-len", "1024",
               "--enforce-eager"]
    log = tempfile.NamedTemporaryFile(prefix="gpu-check-server-", suffix=".log", delete=False)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    forward = vllm_server.WeightPush.forward
    handed = [0]

    def killing_forward(push, item):  # the server dies once the push is under way (two tensors taken)
        handed[0] += 1
        if handed[0] == 3 and server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        forward(push, item)

    result: dict = {"timeout_s": timeout}
    try:
        engine = vllm_server.VLLMServerEngine([f"http://127.0.0.1:{port}"], timeout=600)  # the server's start
        engine.start()
        engine.timeout = engine.servers[0].timeout = timeout
        policy = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda()
        result["first_push_s"] = engine.sync_weights(policy, 1)
        vllm_server.WeightPush.forward = killing_forward
        begin = time.perf_counter()
        try:
            engine.sync_weights(policy, 2)
            result["error"] = "the push to a killed server returned"
        except GenerationServerLost as error:
            result["error"] = str(error)
        result["lost_after_s"] = time.perf_counter() - begin
        computed = []
        check = threading.Thread(target=lambda: computed.append(
            float((torch.ones(1024, 1024, device="cuda") @ torch.ones(1024, 1024, device="cuda")).sum().item())), daemon=True)
        check.start()
        check.join(timeout=60)
        result["gpu_computes_after"] = computed == [1024.0 ** 3]
        result["bounded"] = result["lost_after_s"] < 2 * timeout + 60 and "returned" not in result["error"]
        engine.close()
    finally:
        vllm_server.WeightPush.forward = forward
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        result["server_log"] = log.name
    return result


def fused_head_bf16_check(device: str, tokens: int = 4096, hidden_size: int = 2048, vocab_size: int = 151936,
                          tile_tokens: int = 512, cuda_only: bool = True) -> dict:
    """The fused LM head (``fused_token_logprobs`` with a bf16 ``LinearHead``, several tiles) against the
    full bf16 logits, each as relative error to float32's log-probs, entropy and gradients; and how many
    weight-gradient products took ``add_product_in_float32``'s CUDA branch (``addmm(out_dtype=float32)``).
    Off CUDA "skipped" (``cuda_only=False``: run anyway, at a size given, for the mechanics' test)."""
    from lit_grpo.algorithm import fused_lm_head

    if device != "cuda" and cuda_only:
        return {"skipped": "no CUDA"}
    generator = torch.Generator(device).manual_seed(0)
    hidden32 = torch.randn(1, tokens, hidden_size, device=device, generator=generator)
    weight32 = torch.randn(vocab_size, hidden_size, device=device, generator=generator) / hidden_size**0.5
    ids = torch.randint(0, vocab_size, (1, tokens), device=device, generator=generator)
    grad_logps, grad_entropy = (torch.randn(1, tokens, device=device, generator=generator) for _ in range(2))

    def run(dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:  # logps, entropy, d hidden, d weight
        hidden, weight = (t.to(dtype, copy=True).requires_grad_() for t in (hidden32, weight32))
        if fused:
            logps, entropy = fused_lm_head.fused_token_logprobs(
                hidden, fused_lm_head.LinearHead(weight), ids, vocab_size, with_entropy=True,
                tile_bytes=tile_tokens * 4 * vocab_size, entropy_grad=True)
        else:  # [1, T, V] float32 logits from the product in ``dtype``, as nn.Linear in bf16 makes them
            log_probs = (hidden @ weight.T).float().log_softmax(-1)
            logps, entropy = log_probs.gather(-1, ids[..., None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)
        ((logps * grad_logps).sum() + (entropy * grad_entropy).sum()).backward()
        return [logps.detach(), entropy.detach(), hidden.grad.float(), weight.grad.float()]

    calls = []
    plain_add_product = fused_lm_head.add_product_in_float32

    def recorded(total, left, right):
        calls.append(total.device.type == "cuda" and left.dtype in (torch.float16, torch.bfloat16))
        plain_add_product(total, left, right)

    reference = run(torch.float32, fused=False)
    full = run(torch.bfloat16, fused=False)
    fused_lm_head.add_product_in_float32 = recorded
    try:
        fused = run(torch.bfloat16, fused=True)
    finally:
        fused_lm_head.add_product_in_float32 = plain_add_product
    names = ("logps", "entropy", "grad_hidden", "grad_weight")
    errors = {label: {name: float((x - r).norm() / r.norm()) for name, x, r in zip(names, values, reference)}
              for label, values in (("full_bf16", full), ("fused_bf16", fused))}
    return {"tokens": tokens, "hidden_size": hidden_size, "vocab_size": vocab_size, "tile_tokens": tile_tokens,
            "relative_error_to_float32": errors, "add_product_calls": len(calls), "add_product_cuda_bf16_branch": sum(calls),
            "max_abs_logp_difference_fused_full": float((fused[0] - full[0]).abs().max()),
            "fused_within_full": all(errors["fused_bf16"][n] <= 1.2 * errors["full_bf16"][n] + 1e-6 for n in names)}


def sequence_parallel_seed_check(device: str, backend: str = "nccl", cuda_only: bool = True) -> dict:
    """``SequenceParallel.shared_generator`` (``model.sequence_parallel_size``: the seed of the update's
    shuffle, broadcast over the group) on an NCCL group as Lightning's CUDA runs make them, which
    takes no CPU tensors: a one-process group, so one GPU suffices. Off CUDA "skipped" (``cuda_only=False``
    and ``backend="gloo"``: run anyway, for the mechanics' test; two ranks: tests/train/test_sequence_parallel.py)."""
    import torch.distributed as dist

    from lit_grpo.train.sequence_parallel import SequenceParallel

    if device != "cuda" and cuda_only:
        return {"skipped": "no CUDA"}
    if dist.is_initialized():
        return {"skipped": "a process group is already initialised in this process"}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        generator = SequenceParallel(size=1, rank=0, group=group).shared_generator(torch.device(device))
        return {"ok": True, "backend": str(dist.get_backend(group)), "generator_device": str(generator.device)}
    except Exception as error:  # noqa: BLE001 - the failure is the finding
        return {"ok": False, "error": f"{type(error).__name__}: {last_line(error)}"}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("python -m bench.gpu_check: no CUDA device here; use --device cpu --shapes tiny")
    sizes = SIZES[args.device]
    if args.pairs is not None:
        sizes = Sizes(**{**asdict(sizes), "pairs": args.pairs})
    start = time.perf_counter()
    report: dict = {"command": command_line("gpu_check", argv), "machine": machine(args.device), "shapes": args.shapes, "notes": []}
    trainers = {"lit-grpo": ("lit-grpo", {})}
    if installed("trl"):
        trainers["trl"] = ("trl", {})
    else:
        report["notes"].append("TRL is not installed (the bench extra, `pip install -e \".[bench]\"`): no TRL rows.")
    with_vllm = installed("vllm")
    if with_vllm:
        trainers["lit-grpo (vllm)"] = ("lit-grpo", {"generation_backend": "vllm"})
    else:
        report["notes"].append("vLLM is not installed: no vLLM rows.")
    part_seconds = report["part_seconds"] = {}

    def part(name: str, function):
        print(f"{name} ...", file=sys.stderr, flush=True)
        begin = time.perf_counter()
        result = function()
        part_seconds[name] = time.perf_counter() - begin
        return result

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        checkpoint = part("build", lambda: build_checkpoint(args.shapes[0], Path(tmp)))
        report["samplers"] = part("samplers", lambda: sampler_checks(checkpoint, args.device, sizes))
        hardware = part("hardware", lambda: Hardware(
            copy_bandwidth(args.device, 1.0 if args.device == "cuda" else 0.25),
            matmul_rate(args.device, 8192 if args.device == "cuda" else 1024),
        ))
        release_memory(args.device)
        report["hardware"] = asdict(hardware)
        report["fit"] = part("trainers", lambda: trainer_comparison(checkpoint, args.device, sizes, trainers, hardware))
        report["notes"] += [f"{label} failed: {last_line(error)}" for label, error in report["fit"]["failures"].items()]
        report["decode"] = part("decode", lambda: decode_rows(checkpoint, args.shapes, args.device, sizes, hardware))
        report["padding_free"] = part("padding-free", lambda: padding_free_rows(checkpoint, args.device))
        report["fused_head_bf16"] = part("fused head bf16", lambda: fused_head_bf16_check(args.device))  # addmm(out_dtype)
        report["sequence_parallel_seed"] = part("sequence-parallel seed", lambda: sequence_parallel_seed_check(args.device))
        if report["sequence_parallel_seed"].get("ok") is False:
            report["notes"].append(f"model.sequence_parallel_size's shared shuffle failed on NCCL: "
                                   f"{report['sequence_parallel_seed']['error']} (issue 53.3)")
        if args.device == "cuda":  # on the CPU: tests/rollout/test_async_rollouts.py
            report["async_scoring"] = part("async scoring", lambda: scoring_thread_devices(checkpoint, args.device))
            if not report["async_scoring"]["cpu_only"]:
                report["notes"].append(f"the asynchronous pipeline's scoring thread read tensors on "
                                       f"{report['async_scoring']['devices']}, not only the CPU (issue 49.13)")
        if with_vllm:
            try:
                vllm = part("vllm", lambda: vllm_rows(checkpoint, args.device, sizes, hardware))
            except Exception as error:  # noqa: BLE001 - an optional backend's failure is a finding, not the end of the check
                report["notes"].append(f"the vllm backend's sampler rows failed: {type(error).__name__}: {last_line(error)}")
            else:
                vllm["logprobs"]["like_generate"] = like_generate(vllm["logprobs"], report["samplers"]["logprobs"]["transformers"])
                report["samplers"]["logprobs"]["vllm"] = vllm["logprobs"]
                report["decode"][args.shapes[0]].update(vllm["decode"])
        if with_vllm and args.device == "cuda":  # on the CPU: tests/rollout/test_vllm_server.py (gloo, a stalled push)
            report["vllm_server_push"] = part("vllm server push", lambda: vllm_server_push_bound(checkpoint))
            if not report["vllm_server_push"].get("bounded"):
                report["notes"].append(f"a vLLM server killed during an NCCL weight push: {report['vllm_server_push']} (issue 49.4)")
    report["seconds"] = time.perf_counter() - start
    text = markdown(report)
    write_outputs(args.name or f"gpu_check_{device_name(report['machine'])}", text, report, args.out)
    print(text)
    return report


if __name__ == "__main__":
    main()
