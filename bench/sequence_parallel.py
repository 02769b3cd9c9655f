"""Activation memory of one long row's trained forward with sequence parallelism (``model.sequence_parallel_size``).

One row of ``--tokens`` tokens through a random Llama body, forward and backward, on one process
(k = 1: the padded forward, SDPA) and on k processes (gloo, :class:`lit_grpo.train.sequence_parallel.SequenceParallel`:
each rank runs the body on T/k tokens, Ulysses all-to-all on the heads). Per rank it reports the bytes
autograd saves for the backward (every tensor the forward keeps, counted once per storage, through
``torch.autograd.graph.saved_tensors_hooks``: the activation memory itself), the growth of the
process's peak RSS over the forward and backward (Linux: the peak is reset through
``/proc/self/clear_refs`` first), and the seconds. The loss is a function of the gathered hidden
states ``[T, H]``, which every rank holds whole (as the LM head then runs on each rank).

    python -m bench.sequence_parallel --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.harness import command_line, fmt, load_line, machine_description, markdown_table, write_outputs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak) of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


class SavedBytes:
    """Bytes of the distinct storages autograd saves for the backward while the block runs."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def measure(rank: int, world: int, port: int, args: argparse.Namespace, model_dir: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from lit_grpo import models
    from lit_grpo.train.sequence_parallel import SequenceParallel

    dist.init_process_group("gloo", rank=rank, world_size=world)
    sequence_parallel = SequenceParallel.of_world(world)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    head = models.output_head(model)
    input_ids = torch.randint(4, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)

    def forward() -> torch.Tensor:  # [1, T, H]
        if sequence_parallel is None:
            return models.decoder_hidden_states(model, head, input_ids=input_ids, attention_mask=mask,
                                                position_ids=torch.arange(args.tokens).unsqueeze(0), use_cache=False)
        return sequence_parallel.hidden_states(model, head, input_ids=input_ids, attention_mask=mask)

    forward().float().pow(2).mean().backward()  # warm-up: allocator pools, lazy inits
    model.zero_grad(set_to_none=False)
    dist.barrier()
    saved = SavedBytes()
    before = rss_bytes("VmRSS")
    reset_peak_rss()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        hidden = forward()
    hidden.float().pow(2).mean().backward()
    seconds = time.perf_counter() - start
    row = {"rank": rank, "saved_bytes": saved.total, "peak_rss_growth_bytes": rss_bytes("VmHWM") - before, "seconds": seconds}
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        results["ranks"] = rows
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace, model_dir: str) -> list[dict]:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(measure, args=(world, free_port(), args, model_dir, results), nprocs=world, start_method="spawn")
        return list(results["ranks"])


def markdown_report(args: argparse.Namespace, runs: dict[int, list[dict]], machine: dict, command: str) -> str:
    base = runs[1][0]
    rows = []
    for k, ranks in runs.items():
        saved = max(rank["saved_bytes"] for rank in ranks)
        growth = max(rank["peak_rss_growth_bytes"] for rank in ranks)
        rows.append([str(k), fmt(saved / 2**20, 1), f"{saved / base['saved_bytes']:.2f}", fmt(growth / 2**20, 1),
                     f"{growth / base['peak_rss_growth_bytes']:.2f}", fmt(max(rank['seconds'] for rank in ranks), 2)])
    return "\n".join([
        f"# Sequence parallelism: activation memory per rank (`bench/sequence_parallel.py`)\n\n`{command}`\n",
        (f"{machine['cpu']}, {machine['cores']} cores, {load_line(machine)}, torch {machine['versions']['torch']}, "
         f"transformers {machine['versions']['transformers']}\n"),
        (f"One row of {args.tokens} tokens, forward + backward of a {args.layers}-layer random Llama (hidden {args.hidden_size}, "
         f"{args.heads} query / {args.kv_heads} key-value heads, float32, {args.threads} thread(s) per rank); k ranks on gloo, "
         "the largest rank's figures:\n"),
        markdown_table(["k", "saved for backward (MiB)", "x k = 1", "peak RSS growth (MiB)", "x k = 1", "seconds"], rows),
        "",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="the k values (processes) to run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="sequence_parallel_cpu")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from lit_grpo.tiny import build_tiny_model

    args = parse_args(argv)
    command = command_line("sequence_parallel", argv)
    machine = machine_description()
    with tempfile.TemporaryDirectory(prefix="lit-grpo-sequence-parallel-") as tmp:
        build_tiny_model(Path(tmp), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.tokens + 8)
        runs = {k: run(k, args, tmp) for k in args.sizes}
    data = {"command": command, "machine": machine, "settings": vars(args) | {"out": None}, "runs": runs}
    markdown = markdown_report(args, runs, machine, command)
    write_outputs(args.name, markdown, data, *([args.out] if args.out is not None else []))
    print(markdown)
    return data


if __name__ == "__main__":
    main()
