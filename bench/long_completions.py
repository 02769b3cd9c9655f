"""Peak memory of one GRPO step against completion length: lit-grpo beside TRL 1.16, and the floor.

The work (issue 53, item 4): 1 prompt (the quickstart's) x 4 completions of exactly L tokens (EOS
suppressed: ``RunSpec.fixed_length``), one optimizer step, float32 on the CPU, a small Qwen2 body
(``lit_grpo.tiny``, 4 layers, hidden 256) with an *untied* output head over Qwen's vocabulary of
151,936 tokens, the reward ``even_token_fraction``. Both trainers run it through
``bench/trainer_runs.py`` exactly as ``bench/compare_trl.py`` does (loss ``dapo``, beta 0, fused
AdamW, the whole generation batch in one micro-batch, gradient checkpointing off on both: lit-grpo's
default, set on TRL so the work is the same), with their defaults otherwise; TRL's fused LM head is
on by default.

Each measurement is its own process, and its figure is that whole process's peak resident memory
(``VmHWM``), nothing subtracted. The *floor* is measured the same way, in a process of its own that
imports what lit-grpo's does and runs the same step without any logits: the same model and fused
AdamW, a forward of the body over the same 4 rows of prompt + L tokens, a loss on the hidden states
that predict the completion (no head, so no ``[rows, tokens, vocab]`` tensor), the backward, a zero
gradient for the head (its gradient exists in training), clipping and the optimizer step: weights,
gradients, optimizer state and the body's activations.

Before each process the script estimates its peak (from the rows already measured for that trainer,
or from the model's shape) and skips, with a note, a run that would pass ``--max-gib`` or the memory
the machine has available: never start a process that could take the machine's memory from others.

    python -m bench.long_completions                      # 1k, 2k, 4k, 8k, 16k tokens where they fit
    python -m bench.long_completions --lit-commits b70e958 HEAD   # lit-grpo at two commits, side by side
    python -m bench.long_completions --lit-commits HEAD --lit-full-logits HEAD   # with and without the fused LM head

``--lit-commits`` runs lit-grpo from ``git archive`` copies of those commits (``worktree``, the
default, is the checkout as it is). Writes ``bench/results/long_completions_cpu.{md,json}``
(``--name``) after every length, so a stopped run keeps its finished rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness import (
    QUICKSTART_DATA,
    REPO_DIR,
    command_line,
    load_line,
    machine_description,
    markdown_table,
    module_env,
    run_in_subprocess,
    write_outputs,
)
from bench.trainer_runs import RunSpec

GIB = 2**30
QWEN_VOCABULARY = 151_936
WORKTREE = "worktree"
FLOOR = "floor"
TRL = "trl"


@dataclass(frozen=True)
class BodyShape:
    """The model: a Qwen2 body of ``lit_grpo.tiny`` with an untied head over ``vocab_size`` tokens."""

    vocab_size: int = QWEN_VOCABULARY
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2

    def num_parameters(self) -> int:
        """Embedding and head (untied: two matrices), and per layer attention (grouped-query, with
        Qwen2's q/k/v biases), the gated MLP and two norms; the final norm."""
        head_dim = self.hidden_size // self.num_attention_heads
        kv_width = self.num_key_value_heads * head_dim
        attention = self.hidden_size * (2 * self.hidden_size + 2 * kv_width) + self.hidden_size + 2 * kv_width
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        return 2 * self.vocab_size * self.hidden_size + self.num_hidden_layers * layer + self.hidden_size


def build_untied_model(directory: Path, shape: BodyShape, max_position_embeddings: int) -> Path:
    """Write the tiny Qwen2 model of ``shape`` to ``directory`` with its output head untied from the
    embedding (``lit_grpo.tiny`` ties them, as the quickstart's model does): a head of its own,
    drawn from seed 1 at the model's initializer range, saved with ``tie_word_embeddings`` false."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_grpo.tiny import build_tiny_model

    fields = {k: v for k, v in asdict(shape).items()}
    build_tiny_model(directory, architecture="qwen2", max_position_embeddings=max_position_embeddings, seed=0, **fields)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        head = torch.empty_like(model.lm_head.weight).normal_(std=model.config.initializer_range)
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------------------------
# The floor: the same step without any logits, in a process of its own
# ----------------------------------------------------------------------------------------------


def floor_step(model_dir: str, prompt_length: int, completion_length: int, rows: int, learning_rate: float) -> dict:
    """One optimizer step on ``rows`` rows of ``prompt_length + completion_length`` random tokens with
    no logits: the body's forward, a loss on the hidden states that predict the completion tokens,
    backward, the head's zero gradient, clipping, fused AdamW. Returns this process's peak memory."""
    import lightning.pytorch  # noqa: F401 - the libraries a lit-grpo run holds, so the floor counts them as a run does
    import torch
    from transformers import AutoModelForCausalLM

    from bench.trainer_runs import current_rss_mib, peak_rss_mib

    rss_after_imports = current_rss_mib()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0, fused=True)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(model.config.vocab_size, (rows, prompt_length + completion_length), generator=generator)
    start = time.perf_counter()
    hidden = model.model(input_ids=input_ids).last_hidden_state  # [rows, tokens, hidden]
    predicting = hidden[:, prompt_length - 1 : -1]  # [rows, completion_length, hidden]: the positions the head would read
    loss = predicting.square().mean()
    loss.backward()
    for weight in model.parameters():
        if weight.grad is None:  # the head (and nothing else): training gives it a gradient of this size
            weight.grad = torch.zeros_like(weight)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {
        "peak_rss_mib": peak_rss_mib(),
        "rss_after_imports_mib": rss_after_imports,
        "step_seconds": time.perf_counter() - start,
        "prompt_length": prompt_length,
        "completion_length": completion_length,
        "rows": rows,
    }


def run_floor(model_dir: str, prompt_length: int, completion_length: int, rows: int, learning_rate: float, threads: int | None) -> dict:
    """:func:`floor_step` in a fresh process (``python -m bench.long_completions --floor-step``)."""
    arguments = dict(model_dir=model_dir, prompt_length=prompt_length, completion_length=completion_length, rows=rows, learning_rate=learning_rate)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "floor.json"
        command = [sys.executable, "-m", "bench.long_completions", "--floor-step", json.dumps(arguments), "--floor-result", str(result_path)]
        command += ["--threads", str(threads)] if threads is not None else []
        proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp, env=module_env(dict(os.environ, PYTHONWARNINGS="ignore")))
        if proc.returncode != 0:
            raise RuntimeError(f"floor run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads(result_path.read_text())


# ----------------------------------------------------------------------------------------------
# Which code runs, and how much memory a run may take
# ----------------------------------------------------------------------------------------------


def git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=REPO_DIR, capture_output=True, text=True, check=True).stdout.strip()


FULL_LOGITS = ", full logits"  # the label's end for a run of ``--lit-full-logits``


def lit_code(revision: str, directory: Path) -> tuple[str, str | None]:
    """``(label, lit_code_dir)`` of lit-grpo at ``revision``: ``worktree`` is the checkout as it is
    (its HEAD, ``+edits`` when ``lit_grpo/`` differs from it); any other revision is extracted with
    ``git archive`` under ``directory`` and imported from there."""
    if revision == WORKTREE:
        edited = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "lit_grpo"], cwd=REPO_DIR).returncode != 0
        return f"lit-grpo {git('rev-parse', '--short', 'HEAD')}{' +edits' if edited else ''}", None
    commit = git("rev-parse", "--short", revision)
    target = directory / f"lit-grpo-{commit}"
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit, "lit_grpo"], cwd=REPO_DIR, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return f"lit-grpo {commit}", str(target)


def logits_gib(rows: int, tokens: int, vocab_size: int) -> float:
    """One float32 ``[rows, tokens, vocab]`` tensor, in GiB."""
    return rows * tokens * vocab_size * 4 / GIB


def first_guess(shape: BodyShape, rows: int, logits_copies: int) -> tuple[float, float]:
    """``(GiB at no tokens, GiB per completion token)`` of a run nothing has been measured for:
    weights, gradients and AdamW's two moments in float32 and 1.5 GiB of interpreter and libraries;
    per token, the body's saved activations (about 10 hidden-wide and 4 MLP-wide float32 vectors per
    layer and row) and ``logits_copies`` float32 rows of logits (2 for a trainer that keeps the logits
    and their log-softmax; 0 for the floor). Deliberately high: it only decides what may start."""
    base = 16 * shape.num_parameters() / GIB + 1.5
    activations = rows * shape.num_hidden_layers * (10 * shape.hidden_size + 4 * shape.intermediate_size) * 4 / GIB
    return base, activations + logits_copies * logits_gib(rows, 1, shape.vocab_size)


def estimate_peak_gib(measured: dict[int, float], length: int, base_gib: float, per_token_gib: float) -> float:
    """A run's peak at ``length`` tokens from the same trainer's measured peaks (``{length: GiB}``):
    the line through the last two, 10 % over; with one, that peak plus ``per_token_gib`` for each
    token more; with none, ``base_gib + per_token_gib * length``."""
    points = sorted(measured.items())
    if len(points) >= 2:
        (l0, p0), (l1, p1) = points[-2:]
        return 1.1 * (p1 + max(p1 - p0, 0.0) / (l1 - l0) * (length - l1))
    if len(points) == 1:
        return points[0][1] + per_token_gib * max(length - points[0][0], 0)
    return base_gib + per_token_gib * length


def available_gib() -> float:
    """``MemAvailable`` of ``/proc/meminfo``: what a new process can take without swapping others out."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return float("inf")


def skip_reason(estimate_gib: float, max_gib: float, reserve_gib: float) -> str | None:
    """Why a run estimated at ``estimate_gib`` must not start, or None."""
    if estimate_gib > max_gib:
        return f"skipped: estimated {estimate_gib:.1f} GiB, over --max-gib {max_gib:g}"
    free = available_gib()
    if estimate_gib > free - reserve_gib:
        return f"skipped: estimated {estimate_gib:.1f} GiB, {free:.1f} GiB available (keeping {reserve_gib:g} for others)"
    return None


# ----------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------


def trainer_summary(result: dict) -> dict:
    """What the table needs from a ``bench.trainer_runs`` result: peak memory and the work done."""
    step = result["steps"][0]
    return {
        "peak_rss_gib": result["peak_rss_mib"] / 1024,
        "rss_before_training_gib": result["rss_before_training_mib"] / 1024,
        "step_seconds": step["seconds"],
        "phases": step["phases"],
        "process_seconds": result["process_seconds"],
        "prompt_lengths": step["prompt_lengths"],
        "completion_lengths": step["completion_lengths"],
    }


def floor_summary(result: dict) -> dict:
    return {
        "peak_rss_gib": result["peak_rss_mib"] / 1024,
        "rss_after_imports_gib": result["rss_after_imports_mib"] / 1024,
        "step_seconds": result["step_seconds"],
        "prompt_lengths": [result["prompt_length"]] * result["rows"],
        "completion_lengths": [result["completion_length"]] * result["rows"],
    }


def measure_one(args, label: str, lit_code_dir: str | None, model_dir: str, length: int, prompt_length: int) -> dict:
    """One process: a trainer's step (``label`` is lit-grpo's or ``trl``) or the floor."""
    if label == FLOOR:
        return floor_summary(run_floor(model_dir, prompt_length, length, args.num_generations, args.learning_rate, args.threads))
    spec = RunSpec(
        trainer=TRL if label == TRL else "lit-grpo",
        model_dir=model_dir,
        data_file=str(QUICKSTART_DATA),
        steps=1,
        num_generations=args.num_generations,
        prompts_per_step=1,
        max_completion_length=length,
        fixed_length=True,
        precision="fp32",
        reward="even_token_fraction",
        learning_rate=args.learning_rate,
        threads=args.threads,
        lit_code_dir=lit_code_dir,
        lit_full_logits=label.endswith(FULL_LOGITS),
    )
    return trainer_summary(run_in_subprocess(spec, timeout=args.timeout))


def kept_runs(paths: list[Path]) -> dict[tuple[int, str], dict]:
    """The measured runs of earlier results files, by ``(completion length, label)``, each with the
    command that measured it (or its file's name); a later file's run replaces an earlier one's."""
    kept = {}
    for path in paths:
        earlier = json.loads(Path(path).read_text())
        for row in earlier["rows"]:
            for label, run in row["runs"].items():
                if "peak_rss_gib" in run:
                    kept[row["completion_length"], label] = {**run, "kept_from": earlier.get("command", Path(path).name)}
    return kept


def run_lengths(args, shape: BodyShape, model_dir: str, labels: dict[str, str | None], on_row=None, kept=None) -> list[dict]:
    """Every length, and at each every label (lit-grpo's commits, TRL, the floor) in its own process,
    unless its estimated peak is too much (a note instead) or ``kept`` (:func:`kept_runs`) has it
    already. ``on_row(rows)`` after each run."""
    rows, measured, kept = [], {label: {} for label in labels}, kept or {}
    for length in args.lengths:
        row = {"completion_length": length, "runs": {}}
        rows.append(row)
        prompt_length = args.floor_prompt_tokens  # the floor's, until a trainer's run says how long the prompt was
        for label, lit_code_dir in labels.items():
            if (length, label) in kept:
                row["runs"][label] = kept[length, label]
                measured[label][length] = row["runs"][label]["peak_rss_gib"]
                continue
            if args.no_new_runs:
                row["runs"][label] = {"skipped": "not measured (--no-new-runs: only the kept runs)"}
                continue
            base, per_token = first_guess(shape, args.num_generations, 0 if label == FLOOR else args.first_guess_logits)
            estimate = estimate_peak_gib(measured[label], length, base, per_token)
            reason = skip_reason(estimate, args.max_gib, args.reserve_gib)
            if reason is not None:
                row["runs"][label] = {"skipped": reason, "estimated_gib": estimate}
                print(f"L={length} {label}: {reason}", file=sys.stderr, flush=True)
                continue
            try:
                run = measure_one(args, label, lit_code_dir, model_dir, length, prompt_length)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                row["runs"][label] = {"failed": str(error).strip().splitlines()[-1], "estimated_gib": estimate}
                print(f"L={length} {label}: failed: {error}", file=sys.stderr, flush=True)
                continue
            run["estimated_gib"] = estimate
            run["fixed_length"] = all(n == length for n in run["completion_lengths"])
            prompt_length = run["prompt_lengths"][0]
            measured[label][length] = run["peak_rss_gib"]
            row["runs"][label] = run
            print(f"L={length} {label}: peak {run['peak_rss_gib']:.2f} GiB (estimated {estimate:.1f})", file=sys.stderr, flush=True)
            if on_row is not None:
                on_row(rows)
    return rows


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def peak(row: dict, label: str) -> float | None:
    run = row["runs"].get(label, {})
    return run.get("peak_rss_gib")


def growth_per_1k(rows: list[dict], label: str) -> float | None:
    """GiB more per 1,000 completion tokens, between the shortest and longest lengths measured."""
    points = [(row["completion_length"], peak(row, label)) for row in rows if peak(row, label) is not None]
    if len(points) < 2:
        return None
    (l0, p0), (l1, p1) = points[0], points[-1]
    return (p1 - p0) / (l1 - l0) * 1000


def cell(row: dict, label: str) -> str:
    run = row["runs"].get(label)
    if run is None:
        return ""
    if "peak_rss_gib" in run:
        return f"{run['peak_rss_gib']:.2f}" + ("" if run["fixed_length"] else " (lengths differ)")
    return "skipped" if "skipped" in run else "failed"


def results_table(rows: list[dict], labels: list[str]) -> str:
    """Lengths down, peak GiB of each label across, each lit-grpo's over TRL's; the growth per 1k tokens last."""
    lit_labels = [label for label in labels if label not in (TRL, FLOOR)]
    header = ["completion tokens", *(["floor"] if FLOOR in labels else [])]
    header += [*lit_labels, *(["TRL 1.16"] if TRL in labels else [])]
    header += [f"{label} / TRL" for label in lit_labels if TRL in labels]
    order = [*([FLOOR] if FLOOR in labels else []), *lit_labels, *([TRL] if TRL in labels else [])]
    table = []
    for row in rows:
        ratios = []
        if TRL in labels:
            for label in lit_labels:
                lit, trl = peak(row, label), peak(row, TRL)
                ratios.append(f"{lit / trl:.2f}" if lit is not None and trl is not None else "")
        table.append([f"{row['completion_length']:,}", *(cell(row, label) for label in order), *ratios])
    growth = [growth_per_1k(rows, label) for label in order]
    table.append(["GiB per 1k tokens", *(f"{g:+.2f}" if g is not None else "" for g in growth), *([""] * (len(header) - 1 - len(order)))])
    return markdown_table(header, table)


def step_seconds_cell(run: dict) -> str:
    """A run's step wall time in seconds, and its ``train`` phase's (the log-probs, loss, backward and
    optimizer step, sampling not counted) where the trainer reported it."""
    if "step_seconds" not in run:
        return ""
    train = run.get("phases", {}).get("train")
    return f"{run['step_seconds']:.1f}" + ("" if train is None else f" (train {train:.1f})")


def step_seconds_table(rows: list[dict], labels: list[str]) -> str:
    """Lengths down, each measured run's step wall time (seconds, ``step_seconds``) across."""
    header = ["completion tokens", *(f"{label} step s" for label in labels)]
    table = [[f"{row['completion_length']:,}", *(step_seconds_cell(row["runs"].get(label, {})) for label in labels)] for row in rows]
    return markdown_table(header, table)


def markdown_report(args, shape: BodyShape, labels: list[str], rows: list[dict], machine: dict, command: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    notes = [
        f"- {row['completion_length']:,} tokens, {label}: {run.get('skipped') or 'failed: ' + run['failed']}"
        for row in rows for label, run in row["runs"].items() if "peak_rss_gib" not in run
    ]
    out = [
        "# Peak memory of one GRPO step against completion length",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores (shared), {load_line(machine)} at the start. {versions}.",
        f"Model: a Qwen2 body of `lit_grpo.tiny` ({shape.num_hidden_layers} layers, hidden {shape.hidden_size}, MLP "
        f"{shape.intermediate_size}, {shape.num_attention_heads} heads / {shape.num_key_value_heads} KV heads) with an untied "
        f"head over {shape.vocab_size:,} tokens: {shape.num_parameters():,} parameters, float32.",
        f"Work: 1 quickstart prompt x {args.num_generations} completions of exactly L tokens (EOS suppressed), reward "
        "`even_token_fraction`, one optimizer step (loss `dapo`, beta 0, fused AdamW, one micro-batch, no gradient "
        "checkpointing), each trainer with its defaults otherwise (TRL's fused LM head on).",
        "",
        "Every figure is the peak resident memory (`VmHWM`, GiB) of a whole process that ran only that: setup, "
        "sampling and the step, nothing subtracted. `floor`: measured the same way, a process with the same "
        "libraries, model and optimizer running the same step with no logits at all (the body's forward over the "
        "same rows, a loss on the hidden states, backward, the head's zero gradient, the optimizer step): weights, "
        "gradients, optimizer state and the body's activations. `GiB per 1k tokens`: between the shortest and "
        "longest length measured.",
        "",
        results_table(rows, labels),
        "",
        "The step's wall time (seconds, `step_seconds`: sampling, the log-prob passes, backward and optimizer step; "
        "in brackets its `train` phase, sampling not counted; every phase in the JSON):",
        "",
        step_seconds_table(rows, labels),
        "",
    ]
    notes += [f"- {note}" for note in args.note]
    if notes:
        out += ["Notes (each process's peak is estimated first, from the rows before it, and a run over the cap is not started):", "", *notes, ""]
    kept = sorted({(label, run["kept_from"]) for row in rows for label, run in row["runs"].items() if "kept_from" in run})
    if kept:
        out += ["Kept from earlier runs of this script on this machine (`--keep-measured`): "
                + "; ".join(f"{label} from `{source}`" for label, source in kept) + ".", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384], help="completion tokens")
    parser.add_argument("--num-generations", type=int, default=4, help="completions of the one prompt")
    parser.add_argument("--vocab-size", type=int, default=QWEN_VOCABULARY)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--lit-commits", nargs="*", default=[WORKTREE],
        help=f"git revisions of lit-grpo to measure, each its own column ({WORKTREE}: the checkout as it is; none: no lit-grpo)",
    )
    parser.add_argument(
        "--keep-measured", nargs="+", type=Path, default=[],
        help="results JSON files of earlier runs: their measured (length, column) pairs are kept, not run again",
    )
    parser.add_argument(
        "--lit-full-logits", nargs="*", default=[],
        help=f"git revisions of lit-grpo ({WORKTREE} too) measured again with log-probs from the model's full logits, "
        "never the fused LM head (its output head refused), each its own column",
    )
    parser.add_argument("--no-trl", action="store_true", help="leave TRL out")
    parser.add_argument("--no-floor", action="store_true", help="leave the floor out")
    parser.add_argument("--floor-prompt-tokens", type=int, default=32, help="the floor's prompt length where no trainer ran before it")
    parser.add_argument("--no-new-runs", action="store_true", help="start no run: the table of the --keep-measured runs")
    parser.add_argument("--note", action="append", default=[], help="a sentence for the report's notes (repeatable)")
    parser.add_argument("--max-gib", type=float, default=12.0, help="never start a process estimated above this")
    parser.add_argument(
        "--first-guess-logits", type=int, default=2,
        help="float32 logits per token a trainer's first estimate counts (2: the logits and their log-softmax; "
        "0 where the trainers are known to use a fused LM head); later estimates follow the measured rows",
    )
    parser.add_argument("--reserve-gib", type=float, default=2.0, help="memory left to other processes")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--name", default="long_completions_cpu", help="output file name")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/)")
    parser.add_argument("--floor-step", default=None, help=argparse.SUPPRESS)  # internal: one floor run's arguments (JSON)
    parser.add_argument("--floor-result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.floor_step is not None:
        result = floor_step(**json.loads(args.floor_step))
        args.floor_result.write_text(json.dumps(result))
        return result
    command = command_line("long_completions", argv)
    shape = BodyShape(args.vocab_size, args.hidden_size, args.intermediate_size, args.layers)
    machine = machine_description()
    data = {"command": command, "machine": machine, "shape": asdict(shape), "num_parameters": shape.num_parameters(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="lit-grpo-long-") as tmp:
        labels = dict(lit_code(revision, Path(tmp)) for revision in args.lit_commits)
        for revision in args.lit_full_logits:
            label, lit_code_dir = lit_code(revision, Path(tmp))
            labels[label + FULL_LOGITS] = lit_code_dir
        labels.update({TRL: None} if not args.no_trl else {})
        labels.update({FLOOR: None} if not args.no_floor else {})
        data["labels"] = list(labels)
        model_dir = "" if args.no_new_runs else build_untied_model(Path(tmp) / "model", shape, max(args.lengths) + 256)

        def write(rows: list[dict]) -> None:
            data["rows"] = rows
            markdown = markdown_report(args, shape, list(labels), rows, machine, command)
            write_outputs(args.name, markdown, data, *([args.out] if args.out is not None else []))

        rows = run_lengths(args, shape, str(model_dir), labels, on_row=write, kept=kept_runs(args.keep_measured))
        write(rows)
    print(markdown_report(args, shape, list(labels), rows, machine, command))
    return data


if __name__ == "__main__":
    main()
