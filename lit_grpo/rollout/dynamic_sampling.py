"""DAPO's dynamic sampling (``model.dynamic_sampling``): groups whose rewards are all equal carry no
signal, so more prompts are sampled to replace them (Yu et al. 2025, arXiv:2503.14476).

The rollout collector (:class:`~lit_grpo.rollout.collector.RolloutCollector`) runs it after steps
1-3 of a generation batch; the further prompt batches come from the fit loop's data fetcher
(:func:`next_prompt_batch`), so that a consumed batch counts in the data position checkpoints save.
With ``model.max_staleness > 0`` the asynchronous pipeline (:mod:`lit_grpo.rollout.async_pipeline`)
runs it on the batch it is about to train, at the step that trains it: the extra rounds' prompts
are drawn then, sampled with the current weights and trained in that step, so no checkpoint ever
holds one of them in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lit_grpo.data import PromptBatch
from lit_grpo.rollout.records import SampledGroups

__all__ = ["check_data_fetcher", "dynamic_sampling", "next_prompt_batch"]


def dynamic_sampling(collector: Any, sampled: SampledGroups, timings: dict[str, float],
                     more_prompts: Callable[[], PromptBatch | None],
                     sample_and_score: Callable[[PromptBatch, dict[str, float]], SampledGroups] | None = None,
                     ) -> tuple[SampledGroups, dict]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): drop the groups whose rewards are
    all equal (advantage 0, no gradient) and sample the next prompts of the data stream
    (``more_prompts``, None at its end) with ``collector`` (a
    :class:`~lit_grpo.rollout.collector.RolloutCollector`; ``sample_and_score(batch, timings)``, when
    given, samples and scores them instead: the asynchronous pipeline's) until this batch holds
    ``batch_size`` informative groups on every rank, or ``max_generation_rounds``.

    Every rank runs the same number of rounds (the stop decision is reduced over ranks) and keeps
    exactly ``batch_size`` groups, topped up with uninformative ones when the rounds run out, so
    every rank makes the same number of micro-batches and optimizer steps.
    """
    G = collector.settings.num_generations
    sample_and_score = sample_and_score or collector.sample_and_score
    reduce, device = collector.collectives.reduce, collector.collectives.device()
    wanted = len(sampled.prompts)
    parts = [sampled]
    rounds, seen, dropped = 1, len(sampled.prompts), int(sampled.informative_groups(G).logical_not().sum())
    while True:
        informative = sum(int(part.informative_groups(G).sum()) for part in parts)
        done = torch.tensor(float(informative >= wanted or rounds >= collector.settings.max_generation_rounds), device=device)
        if float(reduce(done, "min")) == 1.0:
            break
        batch = more_prompts()
        exhausted = torch.tensor(float(batch is None), device=device)
        if float(reduce(exhausted, "max")) == 1.0:
            break  # the epoch's data ran out on some rank: train on what there is
        part = sample_and_score(batch, timings)
        parts.append(part)
        rounds += 1
        seen += len(part.prompts)
        dropped += int(part.informative_groups(G).logical_not().sum())
    # informative groups first (in sampling order), then uninformative ones to fill the batch
    order = [(p, g) for p, part in enumerate(parts) for g in range(len(part.prompts)) if part.informative_groups(G)[g]]
    order += [(p, g) for p, part in enumerate(parts) for g in range(len(part.prompts)) if not part.informative_groups(G)[g]]
    selected = SampledGroups.concat([parts[p].group_slice(g, G) for p, g in order[:wanted]], collector.tokenizer.pad_token_id)
    totals = reduce(torch.tensor([float(dropped), float(seen)], device=device), "sum")
    stats = {"dropped_frac": totals[0] / totals[1].clamp(min=1.0), "rounds": torch.tensor(float(rounds))}
    return selected, stats


def data_fetcher(trainer: pl.Trainer) -> Any:
    """The fit loop's data fetcher, or None: Lightning's public API draws no batch within a training
    step, so dynamic sampling reads this private attribute (checked at the start of training)."""
    return getattr(trainer.fit_loop, "_data_fetcher", None)


def check_data_fetcher(trainer: pl.Trainer) -> None:
    """Fail before the first step when this Lightning has no data fetcher to draw further batches from."""
    fetcher = data_fetcher(trainer)
    if not (hasattr(fetcher, "__next__") and hasattr(fetcher, "done")):
        raise RuntimeError(
            "model.dynamic_sampling draws further prompt batches through Lightning's "
            f"`trainer.fit_loop._data_fetcher`, which Lightning {pl.__version__} does not provide "
            "(lit-grpo is tested with Lightning 2.6); set model.dynamic_sampling: false or use that Lightning"
        )


def next_prompt_batch(trainer: pl.Trainer) -> PromptBatch | None:
    """The next batch of the training stream, or None at the end of the epoch (a consumed batch
    counts in the data position that checkpoints save)."""
    fetcher = data_fetcher(trainer)
    try:
        batch, _, _ = next(fetcher)
    except StopIteration:
        return None
    finally:
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    return batch
