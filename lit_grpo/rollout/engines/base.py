"""The interface every generation engine implements, and what they share.

A run samples with one engine (``model.generation_backend``). Before every generation the module
hands it the policy and the policy's version, the optimizer steps it has taken
(:meth:`GenerationEngine.sync_weights`); then it asks for completions of left-padded prompt ids
(:meth:`GenerationEngine.generate`). A multi-turn rollout (:mod:`lit_grpo.rollout.tools.tool_use`) calls ``generate``
once per turn, whatever the engine. Every rollout an engine returns says which weights sampled each
row (``Rollout.weight_versions``), and carries the engine's own log-probs of its tokens where it has
them (``Rollout.sampling_logps``: vLLM's, for the importance-sampling correction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from transformers import GenerationConfig

from lit_grpo.rollout.records import Rollout

__all__ = ["GenerationEngine", "agreed_failure", "agreeing_on_failure", "any_rank"]


class GenerationEngine:
    """Samples completions for the trainer: every capability its callers (the rollout collector, the
    asynchronous pipeline, the module) use is declared here, with the default of an engine that samples
    with the policy itself on the trainer's devices."""

    holds_weights: bool = False
    """The engine keeps a copy of the policy's weights of its own (vLLM), which :meth:`sync_weights`
    brings up to date, and whose seconds are logged as ``time/weight_sync``; without one (the ``lit``
    and ``transformers`` samplers) it samples with the policy itself."""

    samples_elsewhere: bool = False
    """The engine samples on other machines (``vllm_server``): :meth:`sampler` gives a sampling that any
    thread may run while the trainer trains (no collective, nothing on the trainer's devices), which
    the asynchronous pipeline (:mod:`lit_grpo.rollout.async_pipeline`) runs in its background thread."""

    sampling_filter_order: str = "transformers"
    """The order the engine's sampler turns logits into the distribution it draws from, which the trainer
    follows when it recomputes that distribution (a key of
    :data:`lit_grpo.algorithm.sampling_filters.FILTER_ORDERS`): ``"transformers"`` (the ``lit`` sampler
    and ``generate``: repetition penalty, temperature, top-k, top-p, min-p; left padding penalised as
    the installed ``transformers`` does) or ``"vllm"`` (penalties, temperature, min-p, then top-k and
    top-p; left padding never penalised)."""

    can_lose_servers: bool = False
    """The engine samples on servers the run can lose mid-run (``vllm_server``): the module then adds
    :class:`~lit_grpo.rollout.engines.server_lost.CheckpointWhenServerLost`, which writes the checkpoint
    of the previous step and stops the run when one is lost."""

    def start(self) -> None:
        """Build the engine or connect to it: called once, before the trainer builds the policy."""

    def sync_weights(self, policy: torch.nn.Module, version: int) -> float:
        """Make the engine sample with ``policy`` at ``version`` (its optimizer steps); the seconds it
        took, 0 when it already did. Every rank calls it (pushing FSDP2 shards is a collective)."""
        raise NotImplementedError

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_truncated: torch.Tensor,
                 num_generations: int, config: GenerationConfig, pad_token_id: int) -> Rollout | None:
        """``num_generations`` completions of each left-padded prompt ``[B, P]`` with the sampling
        settings of ``config`` (greedy without ``do_sample``), as a :class:`~lit_grpo.rollout.records.Rollout`
        whose rows ``i*G .. i*G+G-1`` are prompt i's. None for no prompts: a rank without prompts still
        calls it when the others do (it may take part in collectives)."""
        raise NotImplementedError

    def sampler(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_truncated: torch.Tensor,
                num_generations: int, config: GenerationConfig, pad_token_id: int,
                ) -> Callable[..., tuple[Rollout | None, Exception | None]]:
        """Only where :attr:`samples_elsewhere`: :meth:`generate` in two halves, the seed drawn now, the
        requests sent by the call returned (its argument, optional: a ``threading.Event`` that stops it),
        which returns the rollout or the failure that stopped it, never raising."""
        raise NotImplementedError(f"{type(self).__name__} samples on the trainer's devices: it has no background sampler")

    def generation_phase(self) -> AbstractContextManager:
        """Around every call of :meth:`generate` that one generation makes (a multi-turn rollout calls
        it once per turn): an engine that releases its memory between generations (vLLM's sleep mode)
        does so once, when the phase ends, not after every turn."""
        return nullcontext()

    def max_sequence_length(self) -> int | None:
        """The longest prompt + completion the engine takes (None: the model's own)."""
        return None

    def close(self) -> None:
        """Release the engine (before the trainer's process group goes)."""


def any_rank(flag: bool, device: torch.device) -> bool:
    """``flag`` or-ed over every process of the run (itself alone without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def agreed_failure(error: BaseException | None, device: torch.device) -> None:
    """Raise on every rank when ``error`` happened on any, the same class everywhere: that of the
    failure of the first rank that failed, with its message (``error`` itself where it is of that
    class). Every rank calls it at the same point, so that no rank goes on into a collective the
    failed one never reaches, and a callback that handles the class (the checkpoint of a lost
    generation server) runs on every rank. The failures are exceptions made from a message alone
    (those of :mod:`lit_grpo.errors` and :mod:`lit_grpo.rollout.engines.server_lost`)."""
    import torch.distributed as dist

    if not any_rank(error is not None, device):
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        raise error
    failures: list[tuple[type, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if error is None else (type(error), str(error)))
    kind, message = next(failure for failure in failures if failure is not None)
    if type(error) is kind:
        raise error
    raise kind(message) from error


@contextmanager
def agreeing_on_failure(device: torch.device) -> Iterator[None]:
    """Run a block every rank runs, then agree on how it ended (:func:`agreed_failure`): an exception
    on one rank is raised on every rank, with that rank's class and message, at the block's end,
    instead of leaving the others to fail in the next collective with the transport's error."""
    try:
        yield
    except Exception as error:
        agreed_failure(error, device)
        raise
    agreed_failure(None, device)
