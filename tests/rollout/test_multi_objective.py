"""Several rewards through the rollout collector (step 3): ``model.multi_objective_aggregation``
(``sum_then_normalize``, GRPO's; ``normalize_then_sum``, GDPO's), on one process and on two, where
the advantages use the statistics of the whole batch; and ``reward_std`` as TRL 1.16 logs it (the
std of the weighted reward sums of the whole batch of every rank, under either aggregation).

The expected values are TRL 1.16's own lines (``tests/algorithm/test_trl_options.py``) or worked by hand."""

from __future__ import annotations

import math
import string
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict
from test_module import make_data, make_module, record_generation_batches
from test_trl_options import trl_nanstd, trl_normalize_then_sum

import lit_grpo.train.logprob_passes
from lit_grpo import algorithm
from lit_grpo.data import PromptBatch
from lit_grpo.rollout.collector import Collectives, RolloutCollector
from lit_grpo.rollout.records import Rollout, ScoredRollout, rollout_statistics
from lit_grpo.settings import GenerationSettings

NAN = float("nan")
G = 2
# two rewards of different scales: a fraction in [0, 1] and a count in the tens, weighted 1 and 0.5
WEIGHTS = torch.tensor([1.0, 0.5])
# rank 0's rows, then rank 1's: two groups of G on each; row 5 is unscorable (every reward None)
REWARDS_PER_FUNC = torch.tensor([
    [1.0, 10.0], [0.0, 30.0], [0.5, 20.0], [0.5, 60.0],  # rank 0
    [1.0, NAN], [NAN, NAN], [0.0, 40.0], [1.0, 40.0],  # rank 1
])
ONE_PROCESS = Collectives(all_gather=lambda tensor: tensor, reduce=lambda value, reduce_op: value, rank=lambda: 0,
                          device=lambda: torch.device("cpu"))


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32),
                               atol=atol, rtol=1e-5, equal_nan=True)


def collector_of(aggregation: str, scale_rewards: str, collectives: Collectives = ONE_PROCESS) -> RolloutCollector:
    """A collector of two weighted rewards that only groups (step 3 needs no engine and no model)."""
    hp = AttributeDict(num_generations=G, max_prompt_length=None, max_completion_length=4, chat_template_kwargs=None,
                       scale_rewards=scale_rewards, multi_objective_aggregation=aggregation, dynamic_sampling=False,
                       max_generation_rounds=4, max_staleness=0)
    scorer = SimpleNamespace(weights=WEIGHTS, names=["fraction", "count"])
    return RolloutCollector(scorer, None, None, GenerationSettings.from_hparams(hp), weights=lambda: (None, 0),
                            collectives=collectives)


def rollout_of(n: int) -> Rollout:
    """``n`` completions of 1 to 3 tokens (only their lengths are read here)."""
    lengths = torch.tensor([1 + i % 3 for i in range(n)])
    mask = (torch.arange(3) < lengths.unsqueeze(1)).long()  # [n, 3]
    return Rollout(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                   completion_ids=mask.clone(), completion_mask=mask, is_truncated=torch.zeros(n, dtype=torch.bool))


def group_rows(collector: RolloutCollector, rewards_per_func: torch.Tensor):
    prompts = [f"prompt {i}" for i in range(rewards_per_func.size(0) // G)]
    n = rewards_per_func.size(0)
    return collector.groups(PromptBatch(prompts=prompts, columns={}), rollout_of(n), [""] * n, rewards_per_func)


def scored_of(sampled) -> ScoredRollout:
    return ScoredRollout(rollout=sampled.rollout, loss_mask=sampled.rollout.completion_mask, rewards_per_func=sampled.rewards_per_func,
                         rewards=sampled.rewards, group=sampled.group, old_logps=None, ref_logps=None, num_items_in_batch=1.0,
                         timings={}, prompts=sampled.prompts)


def trl_sum_then_normalize_batch(rewards_per_func, weights):
    """TRL 1.16's ``sum_then_normalize`` branch with ``scale_rewards == "batch"``: the group mean, the batch std."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    return torch.nan_to_num((rewards - mean) / (trl_nanstd(rewards) + 1e-4), nan=0.0)


# The weighted sums r = r1 + 0.5 * r2 of every row: [6, 15, 10.5, 30.5, 1, NaN, 20, 21]; 7 scored rows,
# sum 104, mean 104/7; in sevenths, 7 r - 104 = [-62, 1, -30.5, 109.5, -97, 36, 43], whose squares sum
# to 3844 + 1 + 930.25 + 11990.25 + 9409 + 1296 + 1849 = 29319.5: the Bessel std is sqrt(29319.5 / 49 / 6).
SUMS = [6.0, 15.0, 10.5, 30.5, 1.0, NAN, 20.0, 21.0]
HAND_REWARD_STD = math.sqrt(29319.5 / 49 / 6)  # 9.9863


def test_the_weighted_sums_and_their_std_by_hand():
    assert sum(r for r in SUMS if not math.isnan(r)) == 104.0
    close(algorithm.combine_rewards(REWARDS_PER_FUNC, WEIGHTS), SUMS)
    assert sum((7 * r - 104) ** 2 for r in SUMS if not math.isnan(r)) == 29319.5


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_the_collector_aggregates_as_configured_and_logs_trls_reward_and_reward_std(aggregation):
    sampled = group_rows(collector_of(aggregation, "group"), REWARDS_PER_FUNC)

    close(sampled.rewards, SUMS)  # the plain weighted sum is the reward under either aggregation (TRL's)
    if aggregation == "normalize_then_sum":  # GDPO: TRL's normalize_then_sum line by line
        close(sampled.group.advantages, trl_normalize_then_sum(REWARDS_PER_FUNC, WEIGHTS, G), atol=1e-5)
    else:  # GRPO: groups of two sums d apart: +-(d / 2) / (d / sqrt(2) + 1e-4); group 2 = [1, NaN]: one reward, 0
        a = [(d / 2) / (d / math.sqrt(2) + 1e-4) for d in (9.0, 20.0, 1.0)]
        close(sampled.group.advantages, [-a[0], a[0], -a[1], a[1], 0.0, 0.0, -a[2], a[2]], atol=1e-6)
    # the two aggregations give different advantages for these rewards of different scales
    other = group_rows(collector_of({"sum_then_normalize": "normalize_then_sum"}.get(aggregation, "sum_then_normalize"),
                                    "group"), REWARDS_PER_FUNC)
    assert (sampled.group.advantages - other.group.advantages).abs().max() > 0.1

    metrics = rollout_statistics(scored_of(sampled), ["fraction", "count"], ONE_PROCESS.all_gather)
    assert float(metrics["reward"]) == pytest.approx(104 / 7, abs=1e-5)
    # TRL's nanstd of the weighted sums over the batch, not the mean of the groups' stds (as before)
    assert float(metrics["reward_std"]) == pytest.approx(HAND_REWARD_STD, abs=1e-4)
    assert float(metrics["reward_std"]) == pytest.approx(float(trl_nanstd(algorithm.combine_rewards(REWARDS_PER_FUNC, WEIGHTS))),
                                                         abs=1e-4)


def test_reward_std_of_fewer_than_two_scored_completions_is_zero():
    rewards_per_func = torch.tensor([[1.0, 2.0], [NAN, NAN]])  # one scored completion: TRL logs NaN
    sampled = group_rows(collector_of("sum_then_normalize", "group"), rewards_per_func)
    metrics = rollout_statistics(scored_of(sampled), ["fraction", "count"], ONE_PROCESS.all_gather)
    assert float(metrics["reward_std"]) == 0.0 and float(metrics["reward"]) == 2.0


# ----------------------------------------------------------------------------------------------
# Two ranks: each keeps its rows, the statistics are of both
# ----------------------------------------------------------------------------------------------


def two_rank_worker(rank: int, init_file: str, results: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [2, n, ...], as LightningModule.all_gather
        gathered = [torch.empty_like(tensor) for _ in range(2)]
        dist.all_gather(gathered, tensor.contiguous())
        return torch.stack(gathered)

    collectives = Collectives(all_gather=all_gather, reduce=lambda value, reduce_op: value, rank=lambda: rank,
                              device=lambda: torch.device("cpu"))
    own_rows = REWARDS_PER_FUNC[4 * rank: 4 * (rank + 1)]
    out = {}
    for aggregation, scale_rewards in [("normalize_then_sum", "group"), ("sum_then_normalize", "batch")]:
        sampled = group_rows(collector_of(aggregation, scale_rewards, collectives), own_rows)
        metrics = rollout_statistics(scored_of(sampled), ["fraction", "count"], all_gather)
        out[aggregation] = (sampled.rewards, sampled.group.advantages, float(metrics["reward_std"]), float(metrics["reward"]))
    torch.save(out, f"{results}.{rank}")
    dist.destroy_process_group()


def test_two_ranks_advantages_use_the_whole_batch_as_trl(tmp_path):
    torch.multiprocessing.spawn(two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path / "results")), nprocs=2)
    expected = {
        "normalize_then_sum": trl_normalize_then_sum(REWARDS_PER_FUNC, WEIGHTS, G),  # [8], both ranks' rows
        "sum_then_normalize": trl_sum_then_normalize_batch(REWARDS_PER_FUNC, WEIGHTS),
    }
    for rank in range(2):
        results = torch.load(tmp_path / f"results.{rank}")
        rows = slice(4 * rank, 4 * (rank + 1))
        for aggregation, (rewards, advantages, reward_std, reward) in results.items():
            close(rewards, SUMS[rows])
            close(advantages, expected[aggregation][rows], atol=1e-5)
            assert reward_std == pytest.approx(HAND_REWARD_STD, abs=1e-4)  # both ranks' rows, as on one process
            assert reward == pytest.approx(104 / 7, abs=1e-5)
    # a rank's own rows alone would give other advantages: the statistics are the batch's
    alone = trl_normalize_then_sum(REWARDS_PER_FUNC[:4], WEIGHTS, G)
    assert (alone - expected["normalize_then_sum"][:4]).abs().max() > 0.01


# ----------------------------------------------------------------------------------------------
# A run: the loss sees GDPO's advantages
# ----------------------------------------------------------------------------------------------


def test_a_gdpo_run_trains_on_trls_normalize_then_sum_advantages(tiny_model_dir, say_a_or_b_file, fast_trainer,
                                                                 monkeypatch, reward_plugin):
    def length_in_tens(completions, **kwargs):  # a reward of another scale than the fraction
        return [10.0 * len(completion) for completion in completions]

    reward_plugin(length_in_tens=length_in_tens)
    rewards = [{"name": "char_fraction", "args": {"chars": string.ascii_lowercase}}, {"name": "length_in_tens", "weight": 0.5}]
    torch.manual_seed(0)
    module = make_module(tiny_model_dir, rewards=rewards, multi_objective_aggregation="normalize_then_sum",
                         skip_zero_gradient_rows=False)  # every row through the loss
    scored_batches, loss_advantages = record_generation_batches(module), []
    original_loss = algorithm.grpo_loss

    def loss_recording(inputs, *args, **kwargs):
        loss_advantages.append(inputs.advantages.detach().clone())
        return original_loss(inputs, *args, **kwargs)

    monkeypatch.setattr(lit_grpo.train.logprob_passes.algorithm, "grpo_loss", loss_recording)
    fast_trainer(max_steps=1).fit(module, make_data(say_a_or_b_file))

    (scored,) = scored_batches
    weights = torch.tensor([1.0, 0.5])
    gdpo = trl_normalize_then_sum(scored.rewards_per_func, weights, 4)
    summed = algorithm.group_advantages(algorithm.combine_rewards(scored.rewards_per_func, weights), 4).advantages
    assert (gdpo - summed).abs().max() > 0.05  # the two aggregations differ on this batch
    close(scored.group.advantages, gdpo, atol=1e-5)
    # the loss saw exactly these (its forwards may take the rows in chunks of similar length, in another order)
    close(torch.cat(loss_advantages).sort().values, gdpo.sort().values, atol=1e-5)
