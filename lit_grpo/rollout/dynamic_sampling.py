"""DAPO's dynamic sampling (``model.dynamic_sampling``): groups whose rewards are all equal carry no
signal, so more prompts are sampled to replace them (Yu et al. 2025, arXiv:2503.14476).

The functions take the :class:`~lit_grpo.train.module.GRPOModule` (its trainer, its
``_sample_and_score`` for steps 1-3) and draw further prompt batches through the fit loop's data
fetcher, so that a consumed batch counts in the data position checkpoints save.
"""

from __future__ import annotations

import torch

from lit_grpo.rollout.records import SampledGroups

__all__ = ["dynamic_sampling", "next_prompt_batch"]


def dynamic_sampling(module, sampled: SampledGroups, timings: dict[str, float]) -> tuple[SampledGroups, dict]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): drop the groups whose rewards are
    all equal (advantage 0, no gradient) and sample the next prompts of the data stream until this
    batch holds ``batch_size`` informative groups on every rank, or ``max_generation_rounds``.

    Every rank runs the same number of rounds (the stop decision is reduced over ranks) and keeps
    exactly ``batch_size`` groups, topped up with uninformative ones when the rounds run out, so
    every rank makes the same number of micro-batches and optimizer steps.
    """
    hp = module.hparams
    G = hp.num_generations
    wanted = len(sampled.prompts)
    parts = [sampled]
    rounds, seen, dropped = 1, len(sampled.prompts), int(sampled.informative_groups(G).logical_not().sum())
    while True:
        informative = sum(int(part.informative_groups(G).sum()) for part in parts)
        done = torch.tensor(float(informative >= wanted or rounds >= hp.max_generation_rounds), device=module.device)
        if float(module.trainer.strategy.reduce(done, reduce_op="min")) == 1.0:
            break
        batch = next_prompt_batch(module)
        exhausted = torch.tensor(float(batch is None), device=module.device)
        if float(module.trainer.strategy.reduce(exhausted, reduce_op="max")) == 1.0:
            break  # the epoch's data ran out on some rank: train on what there is
        part = module._sample_and_score(batch, timings)
        parts.append(part)
        rounds += 1
        seen += len(part.prompts)
        dropped += int(part.informative_groups(G).logical_not().sum())
    # informative groups first (in sampling order), then uninformative ones to fill the batch
    order = [(p, g) for p, part in enumerate(parts) for g in range(len(part.prompts)) if part.informative_groups(G)[g]]
    order += [(p, g) for p, part in enumerate(parts) for g in range(len(part.prompts)) if not part.informative_groups(G)[g]]
    selected = SampledGroups.concat([parts[p].group_slice(g, G) for p, g in order[:wanted]], module.tokenizer.pad_token_id)
    totals = module.trainer.strategy.reduce(torch.tensor([float(dropped), float(seen)], device=module.device), reduce_op="sum")
    stats = {"dropped_frac": totals[0] / totals[1].clamp(min=1.0), "rounds": torch.tensor(float(rounds))}
    return selected, stats

def next_prompt_batch(module):
    """The next batch of the training stream, or None at the end of the epoch (a consumed batch
    counts in the data position that checkpoints save)."""
    fetcher = module.trainer.fit_loop._data_fetcher
    try:
        batch, _, _ = next(fetcher)
    except StopIteration:
        return None
    finally:
        module.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
    return batch
