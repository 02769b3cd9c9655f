"""Padding through the model: padded forwards, today's length chunks and packed rows (``model.padding_free``).

Completion lengths are drawn as a reasoning run's are spread: log-normal with the median at 40 % of
``max_completion_length`` (sigma 0.6), cut at ``max_completion_length`` (the tail that hits it: the
truncated completions, about 6 % of the rows at these settings); prompts log-normal around 120
tokens (sigma 0.4, 16 to 512). For micro-batches of ``--rows`` such rows (no shared prompt: packing
applies to the forwards without one) it counts the tokens that go through the model in one forward of
the whole micro-batch (padded to its longest prompt and completion), in today's length chunks
(``group_by_length`` with the CPU's ``forward_token_budget`` of 1,024: every chunk padded to its own
longest rows), packed in chunks of at most that many real tokens (``padding_free: true`` with the
default ``group_by_length``: :func:`lit_grpo.train.packing.token_budget_chunks`) and packed as one
sequence without a budget (the real tokens only, either way); then it times one forward + backward of
each on a small random model (float32, on the CPU: ``transformers``' block-diagonal mask over each
packed sequence, whose attention scores are ``T x T``).

    python -m bench.padding_free --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import command_line, fmt, load_line, machine_description, markdown_table, write_outputs
from lit_grpo.rollout.records import FORWARD_OVERHEAD_TOKENS, Rollout, length_chunks
from lit_grpo.tiny import build_tiny_model
from lit_grpo.train.packing import token_budget_chunks

MEDIAN_FRACTION, SIGMA = 0.4, 0.6  # completion lengths: log-normal, median 40 % of the maximum
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE = 120, 0.4, (16, 512)
WAYS = ("padded", "length chunks", "packed chunks", "packed")  # "packed": one sequence, no budget


def draw_lengths(rows: int, max_completion_length: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Prompt and completion lengths of ``rows`` rows (see the module doc)."""
    def log_normal(median: float, sigma: float, low: int, high: int) -> list[int]:
        values = torch.exp(torch.randn(rows, generator=generator) * sigma) * median
        return values.round().clamp(low, high).long().tolist()

    prompts = log_normal(PROMPT_MEDIAN, PROMPT_SIGMA, *PROMPT_RANGE)
    completions = log_normal(MEDIAN_FRACTION * max_completion_length, SIGMA, 1, max_completion_length)
    return prompts, completions


def masks(prompt_lengths: list[int], completion_lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt masks ``[n, P]`` and right-padded completion masks ``[n, C]``."""
    p, c = max(prompt_lengths), max(completion_lengths)
    prompt = (torch.arange(p) >= p - torch.tensor(prompt_lengths)[:, None]).long()
    completion = (torch.arange(c) < torch.tensor(completion_lengths)[:, None]).long()
    return prompt, completion


def tokens_through_the_model(prompt_lengths: list[int], completion_lengths: list[int], budget: int) -> dict[str, int]:
    """Tokens of the micro-batch's forward each way (the last completion token is not an input)."""
    prompt_mask, completion_mask = masks(prompt_lengths, completion_lengths)
    rows = len(prompt_lengths)
    chunked = 0
    for chunk in length_chunks(prompt_mask, completion_mask, budget):
        chunked += len(chunk) * (max(prompt_lengths[r] for r in chunk.tolist()) + max(completion_lengths[r] for r in chunk.tolist()) - 1)
    return {
        "padded": rows * (max(prompt_lengths) + max(completion_lengths) - 1),
        "length chunks": chunked,
        "packed chunks": sum(prompt_lengths) + sum(completion_lengths) - rows,
        "packed": sum(prompt_lengths) + sum(completion_lengths) - rows,
        "chunks": len(length_chunks(prompt_mask, completion_mask, budget)),
        "packed_chunks": len(token_budget_chunks(torch.tensor(prompt_lengths) + torch.tensor(completion_lengths), budget)),
    }


def token_counts(args: argparse.Namespace) -> dict:
    """Mean tokens per micro-batch each way over ``--micro-batches`` draws."""
    generator = torch.Generator().manual_seed(args.seed)
    totals = {way: 0 for way in (*WAYS, "chunks", "packed_chunks")}
    truncated = 0
    for _ in range(args.micro_batches):
        prompts, completions = draw_lengths(args.rows, args.max_completion_length, generator)
        truncated += sum(length == args.max_completion_length for length in completions)
        for way, count in tokens_through_the_model(prompts, completions, args.budget).items():
            totals[way] += count
    means = {way: totals[way] / args.micro_batches for way in totals}
    means["truncated_fraction"] = truncated / (args.micro_batches * args.rows)
    return means


def timed_module(model_dir: Path, budget: int | None, device: str = "cpu", attn_implementation: str = "sdpa"):
    """The model's GRPOModule in float32 on ``device`` (shared prompts off: packing applies without them)."""
    from lit_grpo.train.module import GRPOModule

    module = GRPOModule(str(model_dir), rewards=["char_fraction"], share_prompt_forward=False, forward_token_budget=budget,
                        log_completions_every_n_steps=0, model_init_kwargs={"attn_implementation": attn_implementation})
    module.configure_model()
    module.policy.float().to(device)
    return module


def drawn_rollout(rows: int, max_completion_length: int, vocab_size: int, generator: torch.Generator, device: str = "cpu"):
    """A rollout of ``rows`` drawn rows (:func:`draw_lengths`) of random tokens, and their lengths."""
    prompts, completions = draw_lengths(rows, max_completion_length, generator)
    prompt_mask, completion_mask = masks(prompts, completions)
    prompt_ids = torch.randint(3, vocab_size, prompt_mask.shape, generator=generator) * prompt_mask
    completion_ids = torch.randint(3, vocab_size, completion_mask.shape, generator=generator) * completion_mask
    tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(rows, dtype=torch.bool))
    return Rollout(*(tensor.to(device) for tensor in tensors)), prompts, completions


def device_comparison(model_dir: Path, device: str, rows: int, max_completion_length: int, attn_implementation: str,
                      repeats: int = 3, seed: int = 0) -> dict:
    """Padded against packed forward + backward of one drawn micro-batch on ``device`` (bf16 autocast on
    CUDA), and the largest difference of their log-probs (``bench/gpu_check.py``'s part)."""
    module = timed_module(model_dir, None, device, attn_implementation)
    rollout, prompts, completions = drawn_rollout(rows, max_completion_length, module.policy.config.vocab_size,
                                                 torch.Generator().manual_seed(seed), device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        seconds = {way: forward_backward_seconds(module, rollout, way, repeats) for way in ("padded", "packed")}
        values = {}
        for way in ("padded", "packed"):
            set_way(module, way)
            with torch.no_grad():
                values[way] = module.logprobs.completion_logps(module.policy, rollout)[0]
    mask = rollout.completion_mask.bool()
    return {
        "attn_implementation": attn_implementation, "rows": rows, "max_completion_length": max_completion_length,
        "tokens": tokens_through_the_model(prompts, completions, 1024), "seconds": seconds,
        "packed_over_padded": seconds["packed"] / seconds["padded"],
        "max_abs_logp_difference": float((values["packed"][mask] - values["padded"][mask]).abs().max()),
    }


def set_way(module, way: str) -> None:
    """The module's settings for one of :data:`WAYS`."""
    settings = {"padded": dict(padding_free=False, group_by_length=False),
                "length chunks": dict(padding_free=False, group_by_length=True),
                "packed chunks": dict(padding_free=True, group_by_length=True),
                "packed": dict(padding_free=True, group_by_length=False)}[way]
    for name, value in settings.items():
        setattr(module.hparams, name, value)
    module.apply_settings()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_backward_seconds(module, rollout: Rollout, way: str, repeats: int) -> float:
    """The median time of one forward + backward of ``rollout``'s log-probs, ``way`` one of :data:`WAYS`."""
    set_way(module, way)
    device = rollout.completion_ids.device
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        module.policy.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        logps, _ = module.logprobs.completion_logps(module.policy, rollout)
        (logps * rollout.completion_mask[:, : logps.size(1)]).sum().backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def timings(args: argparse.Namespace, model_dir: Path) -> list[dict]:
    """Seconds of one forward + backward each way, on ``--timed`` drawn micro-batches."""
    module = timed_module(model_dir, args.budget)
    vocab_size = module.policy.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for _ in range(args.timed):
        rollout, prompts, completions = drawn_rollout(args.rows, args.max_completion_length, vocab_size, generator)
        row = {"tokens": tokens_through_the_model(prompts, completions, args.budget)}
        row["seconds"] = {way: forward_backward_seconds(module, rollout, way, args.repeats) for way in WAYS}
        rows.append(row)
    return rows


def markdown_report(args: argparse.Namespace, counts: dict, timed: list[dict], machine: dict, command: str) -> str:
    padded = counts["padded"]
    label = {"packed": "packed, one sequence"}
    count_rows = [[label.get(way, way), fmt(counts[way], 0), f"{100 * (1 - counts['packed'] / counts[way]):.1f} %", f"{counts[way] / padded:.2f}"]
                  for way in WAYS]
    time_rows = []
    for way in WAYS:
        seconds = [row["seconds"][way] for row in timed]
        tokens = [row["tokens"][way] for row in timed]
        time_rows.append([label.get(way, way), fmt(statistics.mean(tokens), 0), fmt(statistics.mean(seconds), 3),
                          f"{statistics.mean(seconds) / statistics.mean(row['seconds']['padded'] for row in timed):.2f}"])
    return "\n".join([
        f"# Padding through the model (`bench/padding_free.py`)\n\n`{command}`\n",
        f"{machine['cpu']}, {machine['cores']} cores, {load_line(machine)}, torch {machine['versions']['torch']}, "
        f"transformers {machine['versions']['transformers']}\n",
        f"{args.micro_batches} micro-batches of {args.rows} rows: completions log-normal, median {MEDIAN_FRACTION:.0%} of "
        f"max_completion_length {args.max_completion_length} (sigma {SIGMA}; {counts['truncated_fraction']:.1%} of the rows hit "
        f"the maximum), prompts log-normal around {PROMPT_MEDIAN} tokens; length chunks with forward_token_budget "
        f"{args.budget} ({counts['chunks']:.2f} forwards per micro-batch on average, {FORWARD_OVERHEAD_TOKENS} tokens' "
        f"overhead each in the chunking's cost); packed chunks of at most {args.budget} real tokens "
        f"({counts['packed_chunks']:.2f} forwards per micro-batch on average).\n",
        markdown_table(["forward", "tokens through the model", "of them padding", "x padded"], count_rows),
        f"\nOne forward + backward of the log-probs (median of {args.repeats}, float32, {args.threads or torch.get_num_threads()} "
        f"thread(s)) on {args.timed} drawn micro-batches, a {args.layers}-layer random Llama (hidden {args.hidden_size}):\n",
        markdown_table(["forward", "tokens", "seconds", "x padded"], time_rows),
        "",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--max-completion-length", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=1024, help="forward_token_budget of the length chunks (the CPU's)")
    parser.add_argument("--micro-batches", type=int, default=2000, help="drawn micro-batches for the token counts")
    parser.add_argument("--timed", type=int, default=3, help="drawn micro-batches timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--name", default="padding_free_cpu")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    command = command_line("padding_free", argv)
    machine = machine_description()
    counts = token_counts(args)
    with tempfile.TemporaryDirectory(prefix="lit-grpo-padding-free-") as tmp:
        model_dir = build_tiny_model(Path(tmp), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                                     num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                                     max_position_embeddings=PROMPT_RANGE[1] + args.max_completion_length + 8)
        timed = timings(args, model_dir) if args.timed else []
    data = {"command": command, "machine": machine, "settings": vars(args) | {"out": None}, "token_counts": counts, "timed": timed}
    markdown = markdown_report(args, counts, timed, machine, command) if timed else ""
    write_outputs(args.name, markdown, data, *([args.out] if args.out is not None else []))
    print(markdown)
    return data


if __name__ == "__main__":
    main()
