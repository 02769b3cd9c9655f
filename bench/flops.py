"""Matrix-multiply FLOPs of one GRPO step on a Llama-architecture model, and this machine's matmul rate.

The *compute floor* of a step is the matmul work the step cannot avoid, divided by the fastest
matmul rate this machine reaches at that precision: no implementation can beat it, so
``floor seconds / measured seconds`` says how close a trainer is to the hardware.

Counted (2 FLOPs per multiply-add), from the model config and the step's real token counts, with no
padding and no wasted rows:

* **generation** (KV-cached sampling): the prefill of each *distinct* prompt once (its KV cache can
  serve all G completions of its group), then one single-token forward per sampled token after the
  first (the first comes from the prefill's logits; the last sampled token needs no forward);
* **training forward + backward** of every completion: backward = 2 x forward (gradients with
  respect to inputs and to weights). The forward needs no more than sampling did: each distinct
  prompt once (the G completions of a group attend to the same prompt keys and values, and in the
  backward their gradients add up there), then every completion token but the last (whose output
  predicts nothing that is scored);
* **extra log-prob passes** without gradient, the same minimal forward: the reference model's when
  ``beta > 0``, and the sampling policy's (``old_logps``) only for the rows trained after the
  policy's first move (``steps_per_generation > 1``: all but the first optimizer step's
  ``1 / steps_per_generation`` of the rows; the first step's rows take theirs from their own
  forward, before any update). Which rows those are is random, so this counts the cheapest of them:
  the rows with the fewest tokens and the fewest, shortest prompts they can span.

A trainer that runs every row's prompt through the model, and the last completion token, executes
more than this floor (``executed/floor`` in the benchmark tables).

A forward of one token at a position with ``context`` visible keys costs

* ``2 * linear_weights`` for the q, k, v, o and MLP projections of every layer,
* ``4 * num_heads * head_dim * context`` per layer for attention (``Q K^T`` and ``softmax(.) V``),
* ``2 * hidden_size * vocab_size`` for the output head, only at positions whose logits are needed.

Not counted: the embedding lookup (a gather), norms, activations, softmax and the optimizer (all
linear in the parameter or activation count, not matmuls).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "ModelShape",
    "StepFlops",
    "forward_flops",
    "generation_flops",
    "grpo_step_flops",
    "measure_matmul_rate",
    "matmul_shapes_for",
]


@dataclass(frozen=True)
class ModelShape:
    """The parts of a Llama config that matmul FLOPs depend on."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a ``transformers`` ``LlamaConfig`` (or any config with the same field names)."""
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            vocab_size=config.vocab_size,
            head_dim=getattr(config, "head_dim", None),
        )

    @property
    def attention_width(self) -> int:
        """num_heads * head_dim: the width of queries (and of the attention output)."""
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        return self.num_attention_heads * head_dim

    @property
    def key_value_width(self) -> int:
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        return self.num_key_value_heads * head_dim

    @property
    def linear_weights_per_layer(self) -> int:
        """Weights of the q, k, v, o projections and the gate, up and down MLP projections."""
        h = self.hidden_size
        attention = h * self.attention_width * 2 + h * self.key_value_width * 2  # q, o and k, v
        mlp = 3 * h * self.intermediate_size
        return attention + mlp


def forward_flops(shape: ModelShape, num_tokens: int, sum_of_contexts: int, num_logits: int) -> int:
    """Matmul FLOPs of a forward over ``num_tokens`` tokens.

    Args:
        shape: the model.
        num_tokens: tokens that go through every layer.
        sum_of_contexts: sum over those tokens of the number of keys each attends to (causal: the
            token at 0-based position t of a sequence sees t + 1 keys).
        num_logits: positions whose output-head logits are computed.
    """
    layers = shape.num_hidden_layers
    dense = 2 * shape.linear_weights_per_layer * layers * num_tokens
    attention = 4 * shape.attention_width * layers * sum_of_contexts
    head = 2 * shape.hidden_size * shape.vocab_size * num_logits
    return dense + attention + head


def _causal_contexts(length: int) -> int:
    """Sum of keys seen by each token of a causal sequence of ``length`` tokens: 1 + 2 + ... + length."""
    return length * (length + 1) // 2


def generation_flops(
    shape: ModelShape, distinct_prompt_lengths: Iterable[int], rows: Iterable[tuple[int, int]]
) -> int:
    """KV-cached sampling: each distinct prompt prefilled once, then one single-token forward per
    sampled token after the first. The same FLOPs are the least a teacher-forced log-prob forward
    of the finished completions needs (the prompt once per group, every completion token but the last).

    Args:
        distinct_prompt_lengths: token length of each distinct prompt (each prefilled once).
        rows: ``(prompt_length, completion_length)`` of every sampled completion.
    """
    prefill = sum(forward_flops(shape, p, _causal_contexts(p), 1) for p in distinct_prompt_lengths)
    decode = 0
    for prompt_length, completion_length in rows:
        steps = max(completion_length - 1, 0)
        # the forward that samples token j + 1 (j = 1 .. c - 1) processes token j at position P + j - 1
        # and sees P + j keys; summed over j: steps * P + (1 + ... + steps)
        contexts = steps * prompt_length + steps * (steps + 1) // 2
        decode += forward_flops(shape, steps, contexts, steps)
    return prefill + decode


@dataclass(frozen=True)
class StepFlops:
    """Matmul FLOPs of one GRPO step, by phase."""

    generation: int
    training: int  # forward + backward of every completion
    logprobs: int  # extra no-gradient passes (reference, old policy)

    @property
    def total(self) -> int:
        return self.generation + self.training + self.logprobs


def grpo_step_flops(
    shape: ModelShape,
    rows: Sequence[tuple[int, int]],
    num_generations: int,
    beta: float,
    num_iterations: int = 1,
    steps_per_generation: int = 1,
) -> StepFlops:
    """Matmul FLOPs of one generation batch's GRPO step.

    Args:
        rows: ``(prompt_length, completion_length)`` per completion, G consecutive rows per prompt
            (prompt and completion lengths count real tokens only; the completion includes its EOS).
        num_generations: G; every G consecutive rows share one prompt.
        beta: KL weight; > 0 adds the reference model's forward.
        num_iterations: multiplies the training passes.
        steps_per_generation: > 1 adds the old-policy forward of the rows trained after the first
            optimizer step (see the module docstring).
    """
    if len(rows) % num_generations:
        raise ValueError(f"{len(rows)} rows do not form groups of num_generations = {num_generations}")
    distinct_prompt_lengths = [rows[i][0] for i in range(0, len(rows), num_generations)]
    forward = generation_flops(shape, distinct_prompt_lengths, rows)  # sampling and one log-prob forward alike
    # the old-policy pass: the rows after the first optimizer step, at their cheapest
    later = len(rows) - len(rows) // steps_per_generation
    cheapest_rows = sorted(rows, key=lambda row: generation_flops(shape, [], [row]))[:later]
    cheapest_prompts = sorted(distinct_prompt_lengths)[: -(-later // num_generations)]  # ceil(later / G) groups
    old_policy = generation_flops(shape, cheapest_prompts, cheapest_rows)
    return StepFlops(
        generation=forward,
        training=3 * forward * num_iterations,
        logprobs=forward * int(beta > 0) + old_policy,
    )


# ----------------------------------------------------------------------------------------------
# The machine's matmul rate
# ----------------------------------------------------------------------------------------------


def matmul_shapes_for(shape: ModelShape, num_rows: int, sequence_length: int) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` shapes the model multiplies: decoding (m = rows) and training (m = rows * length),
    through the attention projection and the MLP."""
    h, i = shape.hidden_size, shape.intermediate_size
    shapes = []
    for m in (num_rows, num_rows * sequence_length):
        shapes += [(m, h, h), (m, h, i), (m, i, h)]
    return shapes


def calls_lasting(function: Callable[[], object], seconds: float) -> int:
    """How many back-to-back calls of ``function`` last at least ``seconds`` (doubling from 1)."""
    calls = 1
    while seconds_per_call(function, calls) * calls < seconds:
        calls *= 2
    return calls


def seconds_per_call(function: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``function`` over a loop of ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls


def measure_matmul_rate(
    shapes: Sequence[tuple[int, int, int]], dtype_name: str, min_seconds: float = 0.3, repeats: int = 5
) -> dict[str, float]:
    """FLOP/s of ``torch.matmul`` at each ``(m, k, n)`` shape in ``dtype_name`` (``float32`` or
    ``bfloat16``): the fastest of ``repeats`` timings of a loop lasting ``min_seconds / repeats``
    (the fastest, not the median: the floor needs the rate the machine can reach, and other
    processes on a shared machine only ever slow a timing down).

    Returns ``{"m x k x n": flops_per_second, ..., "best": max}``.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    rates: dict[str, float] = {}
    for m, k, n in shapes:
        a = torch.randn(m, k).to(dtype)
        b = torch.randn(k, n).to(dtype)
        torch.matmul(a, b)  # warm-up (oneDNN/AMX kernel selection)
        product = lambda: torch.matmul(a, b)  # noqa: E731
        calls = calls_lasting(product, min_seconds / repeats)
        best = min(seconds_per_call(product, calls) for _ in range(repeats))
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / best
    rates["best"] = max(rates.values())
    return rates
