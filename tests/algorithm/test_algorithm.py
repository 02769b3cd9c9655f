"""Unit tests for lit_grpo.algorithm (TRL 1.16 semantics).

Expected values are worked out by hand in the comments next to each literal; the reference
implementations used (torch.log_softmax, -(p log p).sum) are independent textbook forms, not a
re-run of the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.algorithm import (
    LOSS_TYPES,
    LossInputs,
    aggregate_loss,
    clip_fractions,
    clipped_surrogate_loss,
    combine_rewards,
    completion_mask_from_ids,
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    importance_ratio,
    k3_kl,
    selective_log_softmax,
)
from lit_grpo.settings import LossSettings

NAN = float("nan")
LOG2 = math.log(2.0)  # 0.693147


def loss_of(logps, old_logps, advantages, completion_mask, *, ref_logps=None, num_items_in_batch=None,
            policy_mask=None, sampling_weights=None, **settings):
    """:func:`grpo_loss` of these tensors under ``LossSettings(**settings)``."""
    inputs = LossInputs(logps, old_logps, advantages, completion_mask, ref_logps=ref_logps,
                        num_items_in_batch=num_items_in_batch, policy_mask=policy_mask, sampling_weights=sampling_weights)
    return grpo_loss(inputs, LossSettings(**settings))


def close(actual, expected, atol=1e-6, rtol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)


# ----------------------------------------------------------------------------------------------
# 1. selective_log_softmax
# ----------------------------------------------------------------------------------------------


def test_selective_log_softmax_hand_value():
    # logits [0, log 3] -> softmax [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # [1, 1, 2]
    close(selective_log_softmax(logits, torch.tensor([[1]])), [[math.log(3 / 4)]])
    close(selective_log_softmax(logits, torch.tensor([[0]])), [[math.log(1 / 4)]])
    # temperature 2: z = [0, log(3)/2] = [0, log sqrt3] -> p1 = sqrt3 / (1 + sqrt3)
    s3 = math.sqrt(3.0)
    close(selective_log_softmax(logits, torch.tensor([[1]]), temperature=2.0), [[math.log(s3 / (1 + s3))]])


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 2.0])
def test_selective_log_softmax_matches_log_softmax_gather(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 3
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    out = selective_log_softmax(logits, tokens, temperature=temperature)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    close(out, expected)


def test_selective_log_softmax_gradient_matches_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    weights = torch.randn(2, 3, generator=g)
    (selective_log_softmax(logits, tokens, temperature=0.8) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits / 0.8, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()
    close(ours, logits.grad)


def test_selective_log_softmax_bf16_rows_per_chunk_1():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 8, 1000, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 1000, (4, 8), generator=g)
    out = selective_log_softmax(logits, tokens, temperature=0.9, rows_per_chunk=1)
    assert out.dtype == torch.float32 and out.shape == (4, 8)
    # reference in float32 from the (exact) bf16 values
    expected = torch.log_softmax(logits.float() / 0.9, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    close(out, expected, atol=1e-5)


def test_selective_log_softmax_chunk_size_invariant():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 4, 13, generator=g)
    tokens = torch.randint(0, 13, (5, 4), generator=g)
    one = selective_log_softmax(logits, tokens, rows_per_chunk=1)
    three = selective_log_softmax(logits, tokens, rows_per_chunk=3)  # chunks of 3 + 2
    big = selective_log_softmax(logits, tokens, rows_per_chunk=100)
    assert torch.equal(one, three)
    close(one, big)


def test_default_chunks_fill_the_element_budget_with_whole_rows(monkeypatch):
    import lit_grpo.algorithm as algorithm

    # a real vocabulary: one row already exceeds the 2**22-element budget, so one row per chunk
    assert algorithm.rows_per_logprob_chunk(torch.empty(64, 512, 151_936, device="meta")) == 1
    # the benchmark's 101-token vocabulary: 2**22 // (32 * 101) = 1297 rows, all 64 in one chunk
    assert algorithm.rows_per_logprob_chunk(torch.empty(64, 32, 101, device="meta")) == 1297
    assert algorithm.rows_per_logprob_chunk(torch.empty(64, 32, 101, device="meta"), rows_per_chunk=3) == 3

    # a budget of 2 rows of [4, 13] (104 elements): chunks of 2 + 2 + 1, the same values and
    # gradients as row by row, and as many float32 chunk copies as chunks
    import lit_grpo.algorithm.token_logprobs as token_logprobs  # where the chunk functions read it

    monkeypatch.setattr(token_logprobs, "LOGPROB_CHUNK_ELEMENTS", 2 * 4 * 13 + 3)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 4, 13, generator=g)
    tokens = torch.randint(0, 13, (5, 4), generator=g)
    chunk_rows = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self: chunk_rows.append(self.size(0)) or real_float(self))
    by_default = logits.clone().requires_grad_()
    out = algorithm.selective_log_softmax(by_default, tokens)
    assert chunk_rows == [2, 2, 1]
    entropy = algorithm.entropy_from_logits(logits)
    assert chunk_rows == [2, 2, 1, 2, 2, 1]
    monkeypatch.setattr(torch.Tensor, "float", real_float)
    row_by_row = logits.clone().requires_grad_()
    expected = algorithm.selective_log_softmax(row_by_row, tokens, rows_per_chunk=1)
    close(out, expected)
    close(entropy, algorithm.entropy_from_logits(logits, rows_per_chunk=1))
    weights = torch.randn(5, 4, generator=g)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    close(by_default.grad, row_by_row.grad)


# ----------------------------------------------------------------------------------------------
# 2. entropy_from_logits
# ----------------------------------------------------------------------------------------------


def test_entropy_uniform_is_log_v():
    for v in (2, 7, 50):
        out = entropy_from_logits(torch.zeros(2, 3, v), temperature=0.7)
        close(out, torch.full((2, 3), math.log(v)))


def test_entropy_one_hot_ish_is_zero_and_hand_value():
    # [50, 0, 0, 0]: p ~ [1, e^-50, ...] -> H ~ 3 * 51 e^-50 ~ 0
    close(entropy_from_logits(torch.tensor([[[50.0, 0.0, 0.0, 0.0]]])), [[0.0]])
    # [0, log 3]: p = [1/4, 3/4] -> H = -(.25 log .25 + .75 log .75) = .34657 + .21576 = .56233
    close(entropy_from_logits(torch.tensor([[[0.0, math.log(3.0)]]])), [[0.562335]])


def test_entropy_matches_definition_and_has_no_grad():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 4, 9, generator=g, requires_grad=True) * 2
    p = torch.softmax(logits.detach() / 1.3, -1)
    expected = -(p * p.log()).sum(-1)
    out = entropy_from_logits(logits, temperature=1.3, rows_per_chunk=2)
    close(out, expected)
    assert out.dtype == torch.float32 and not out.requires_grad


# ----------------------------------------------------------------------------------------------
# 3. completion_mask_from_ids
# ----------------------------------------------------------------------------------------------


def test_completion_mask_single_eos():
    ids = torch.tensor(
        [
            [5, 2, 7, 2],  # EOS(2) at 1 -> keep up to and including it
            [5, 6, 7, 8],  # no EOS -> truncated, all real
            [2, 3, 4, 5],  # EOS at position 0
        ]
    )
    mask, truncated = completion_mask_from_ids(ids, 2)
    assert mask.dtype == torch.int64
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]
    mask_list, truncated_list = completion_mask_from_ids(ids, [2])
    assert torch.equal(mask, mask_list) and torch.equal(truncated, truncated_list)


def test_completion_mask_multiple_eos_ids():
    ids = torch.tensor(
        [
            [5, 9, 2, 1],  # first of {2, 9} at 1
            [5, 6, 2, 9],  # first at 2
            [1, 1, 1, 1],  # none
        ]
    )
    mask, truncated = completion_mask_from_ids(ids, [2, 9])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


# ----------------------------------------------------------------------------------------------
# 4. combine_rewards
# ----------------------------------------------------------------------------------------------


def test_combine_rewards():
    rewards = torch.tensor([[1.0, 0.5], [NAN, 2.0], [NAN, NAN], [0.0, 0.0]])
    weights = torch.tensor([2.0, -1.0])
    # row 0: 2*1 - .5 = 1.5; row 1: None skipped -> -2; row 2: all None -> NaN; row 3: 0
    close(combine_rewards(rewards, weights), [1.5, -2.0, NAN, 0.0])


# ----------------------------------------------------------------------------------------------
# 5. group_advantages
# ----------------------------------------------------------------------------------------------


def test_group_advantages_g2_and_zero_std():
    # group 0: rewards 1, 0 -> mean .5, std sqrt(.5/1) = .707107 -> A = +-.5 / (.707107 + 1e-4) = +-.707007
    # group 1: rewards 2, 2 -> std 0 -> A exactly 0, zero_std
    out = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), num_generations=2)
    close(out.advantages, [0.707007, -0.707007, 0.0, 0.0])
    assert out.advantages[2:].eq(0).all()
    close(out.group_mean, [0.5, 0.5, 2.0, 2.0])
    close(out.group_std, [0.707107, 0.707107, 0.0, 0.0])
    assert out.zero_std.tolist() == [False, False, True, True]
    close(out.zero_std.float().mean(), 0.5)  # frac_reward_zero_std


REWARDS_G3 = torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0, 4.0])
# group 0: 0 1 2 -> mean 1, squares 1 0 1 -> var 2/2 = 1, std 1
# group 1: 1 1 4 -> mean 2, squares 1 1 4 -> var 6/2 = 3, std sqrt 3 = 1.732051
# batch:   mean 9/6 = 1.5, squares 2.25 .25 .25 .25 .25 6.25 = 9.5 -> var 9.5/5 = 1.9, std 1.378405


def test_group_advantages_scale_group():
    out = group_advantages(REWARDS_G3, 3, "group")
    close(out.advantages, [-1 / 1.0001, 0.0, 1 / 1.0001, -1 / 1.732151, -1 / 1.732151, 2 / 1.732151])
    close(out.group_mean, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    close(out.group_std, [1.0, 1.0, 1.0, 1.732051, 1.732051, 1.732051])
    assert not out.zero_std.any()


def test_group_advantages_scale_batch():
    out = group_advantages(REWARDS_G3, 3, "batch")
    # centred on the GROUP mean, divided by the BATCH std + 1e-4 = 1.378505
    close(out.advantages, [x / 1.378505 for x in (-1.0, 0.0, 1.0, -1.0, -1.0, 2.0)])
    close(out.group_mean, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0])


def test_group_advantages_scale_none():
    out = group_advantages(REWARDS_G3, 3, "none")
    close(out.advantages, [-1.0, 0.0, 1.0, -1.0, -1.0, 2.0])
    close(out.group_std, [1.0, 1.0, 1.0, 1.732051, 1.732051, 1.732051])  # still logged


def test_group_advantages_nan_rewards():
    rewards = torch.tensor(
        [
            1.0, NAN, 3.0,  # valid 1, 3 -> mean 2, std sqrt((1+1)/1) = 1.414214
            NAN, NAN, NAN,  # no reward at all -> A 0, mean 0, std 0
            NAN, 5.0, NAN,  # one valid reward -> mean 5, std 0 -> A 0
        ]
    )  # fmt: skip
    out = group_advantages(rewards, 3)
    close(out.advantages, [-1 / 1.414314, 0.0, 1 / 1.414314, 0, 0, 0, 0, 0, 0])
    assert out.advantages[[1, 3, 4, 5, 6, 7, 8]].eq(0).all()
    close(out.group_mean, [2.0, 2.0, 2.0, 0, 0, 0, 5, 5, 5])
    close(out.group_std, [1.414214] * 3 + [0.0] * 6)
    assert out.zero_std.tolist() == [False] * 3 + [True] * 6


def test_group_advantages_batch_std_ignores_nan():
    # valid rewards 1, 3, 0, 2 -> mean 1.5, squares .25 2.25 2.25 .25 = 5 -> var 5/3, std 1.290994
    # group means 2 and 1 -> A = [-1, 0, 1, -1, 1, 0] / 1.291094
    out = group_advantages(torch.tensor([1.0, NAN, 3.0, 0.0, 2.0, NAN]), 3, "batch")
    close(out.advantages, [x / 1.291094 for x in (-1.0, 0.0, 1.0, -1.0, 1.0, 0.0)])


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(REWARDS_G3, 3, "std")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 2)


def test_group_advantages_equal_inexact_rewards_give_zero():
    # six 0.3s: the float32 mean is off by an ulp, yet equal rewards must give advantage exactly 0
    out = group_advantages(torch.full((6,), 0.3), 6)
    assert out.zero_std.all()
    assert out.advantages.eq(0).all()


# ----------------------------------------------------------------------------------------------
# 6. k3_kl
# ----------------------------------------------------------------------------------------------


def test_k3_kl_values():
    x = torch.tensor([[-0.3, -2.0, -5.0]])
    assert k3_kl(x, x.clone()).eq(0).all()
    # ref = log .5, logp = log .25 -> delta = log 2 -> 2 - log 2 - 1 = .306853
    close(k3_kl(torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)])), [1 - LOG2])
    # swapped: delta = -log 2 -> .5 + log 2 - 1 = .193147
    close(k3_kl(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])), [LOG2 - 0.5])


def test_k3_kl_non_negative():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 64, 32, generator=g) * 3
    assert (k3_kl(a, b) >= 0).all()


# ----------------------------------------------------------------------------------------------
# 7. importance_ratio
# ----------------------------------------------------------------------------------------------


def test_importance_ratio_token():
    logps = torch.log(torch.tensor([[0.5, 0.2]]))
    old = torch.log(torch.tensor([[0.25, 0.4]]))
    # .5/.25 = 2, .2/.4 = .5
    close(importance_ratio(logps, old, torch.ones(1, 2), "token"), [[2.0, 0.5]])


def test_importance_ratio_sequence():
    old = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    logps = torch.tensor([[0.2, -0.4, 99.0], [0.3, 0.3, 0.6], [5.0, 5.0, 5.0]])
    # row 0: mean(.2, -.4) = -.1 -> exp = .904837 (padding 99 ignored)
    # row 1: mean(.3, .3, .6) = .4 -> exp = 1.491825
    # row 2: empty mask -> 0 / clamp(0, 1) = 0 -> 1
    out = importance_ratio(logps, old, mask, "sequence")
    assert out.shape == (3, 1)
    close(out, [[0.904837], [1.491825], [1.0]])
    logps_other_padding = logps.clone()
    logps_other_padding[0, 2] = -1000.0
    close(importance_ratio(logps_other_padding, old, mask, "sequence"), out)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        importance_ratio(logps, old, mask, "segment")


# ----------------------------------------------------------------------------------------------
# 8. clipped_surrogate_loss
# ----------------------------------------------------------------------------------------------


def test_clipped_surrogate_values_and_gradient():
    ratio = torch.tensor([[1.5, 1.1, 0.5], [0.5, 1.1, 1.5]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss = clipped_surrogate_loss(ratio, adv, epsilon_low=0.2, epsilon_high=0.2)
    # A=2:  1.5 -> min(3.0, 1.2*2=2.4) = 2.4 (clipped high)   -> l = -2.4, grad 0
    #       1.1 -> min(2.2, 2.2) inside                        -> l = -2.2, grad -A = -2
    #       0.5 -> min(1.0, .8*2=1.6) = 1.0 (unclipped)        -> l = -1.0, grad -2
    # A=-1: 0.5 -> min(-.5, -.8) = -.8 (clipped low)           -> l =  .8,  grad 0
    #       1.1 -> inside                                      -> l = 1.1,  grad 1
    #       1.5 -> min(-1.5, -1.2) = -1.5 (unclipped)          -> l = 1.5,  grad 1
    close(loss, [[-2.4, -2.2, -1.0], [0.8, 1.1, 1.5]])
    loss.sum().backward()
    close(ratio.grad, [[0.0, -2.0, -2.0], [0.0, 1.0, 1.0]])


def test_clipped_surrogate_asymmetric_epsilon_high():
    ratio = torch.tensor([[1.25, 1.3], [0.75, 0.85]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss = clipped_surrogate_loss(ratio, adv, epsilon_low=0.2, epsilon_high=0.28)
    # A=1:  1.25 < 1.28 -> unclipped -1.25, grad -1;  1.3 > 1.28 -> -1.28, grad 0
    # A=-1: .75 < .8 -> min(-.75, -.8) = -.8 -> l = .8, grad 0;  .85 inside -> .85, grad 1
    close(loss, [[-1.25, -1.28], [0.8, 0.85]])
    loss.sum().backward()
    close(ratio.grad, [[-1.0, 0.0], [0.0, 1.0]])
    # the same 1.25 is clipped with the symmetric epsilon .2: l = -1.2
    close(clipped_surrogate_loss(torch.tensor([[1.25]]), torch.tensor([1.0]), 0.2, 0.2), [[-1.2]])


def test_clipped_surrogate_sequence_ratio_shape():
    out = clipped_surrogate_loss(torch.tensor([[1.5], [1.0]]), torch.tensor([1.0, 3.0]), 0.2, 0.2)
    close(out, [[-1.2], [-3.0]])


# ----------------------------------------------------------------------------------------------
# 9. clip_fractions
# ----------------------------------------------------------------------------------------------


def test_clip_fractions_hand_counted():
    ratio = torch.tensor(
        [
            [1.5, 1.1, 0.5, 1.5],  # A=+1: high at 0 (and 3, masked out)      -> high 1
            [0.5, 1.1, 1.5, 0.5],  # A=-1: low at 0 and 3                      -> low 2
            [2.0, 0.1, 1.0, 1.0],  # A=0: never clipped
        ]
    )
    adv = torch.tensor([1.0, -1.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])  # 3 + 4 + 2 = 9 real tokens
    out = clip_fractions(ratio, adv, mask, 0.2, 0.2)
    close(out.high, 1 / 9)
    close(out.low, 2 / 9)
    close(out.region, 3 / 9)
    # sequence-level ratios broadcast over the mask: row 0 ratio 1.5, A>0 -> 3 high tokens of 5
    seq_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # 5 real tokens
    seq = clip_fractions(torch.tensor([[1.5], [1.0]]), torch.tensor([1.0, 1.0]), seq_mask, 0.2, 0.2)
    close(seq.high, 3 / 5)
    close(seq.low, 0.0)


# ----------------------------------------------------------------------------------------------
# 10. aggregate_loss
# ----------------------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])  # 5 real tokens, masked sum = 1+2+4+5+6 = 18


@pytest.mark.parametrize(
    "loss_type, num_items, expected",
    [
        ("grpo", None, 3.25),  # mean((1+2)/2, (4+5+6)/3) = mean(1.5, 5)
        ("bnpo", None, 3.6),  # 18 / 5
        ("dr_grpo", None, 2.25),  # 18 / (2 sequences * max_completion_length 4)
        ("dapo", None, 3.6),  # num_items defaults to this micro-batch's 5 tokens
        ("dapo", 10, 1.8),  # 18 / 10 tokens in the whole generation batch
    ],
)
def test_aggregate_loss_types(loss_type, num_items, expected):
    out = aggregate_loss(PER_TOKEN, MASK, loss_type, max_completion_length=4, num_items_in_batch=num_items)
    assert out.dim() == 0
    close(out, expected)


def test_aggregate_loss_sequence_level_per_token_loss_broadcasts():
    per_seq = torch.tensor([[2.0], [3.0]])
    # grpo: mean(2, 3) = 2.5; bnpo: (2*2 + 3*3) / 5 = 2.6
    close(aggregate_loss(per_seq, MASK, "grpo", max_completion_length=4), 2.5)
    close(aggregate_loss(per_seq, MASK, "bnpo", max_completion_length=4), 2.6)


def test_aggregate_loss_unknown_type():
    assert {"grpo", "bnpo", "dr_grpo", "dapo"} <= set(LOSS_TYPES)
    with pytest.raises(ValueError) as excinfo:
        aggregate_loss(PER_TOKEN, MASK, "ppo", max_completion_length=4)
    message = str(excinfo.value)
    for name in ("grpo", "bnpo", "dr_grpo", "dapo", "ppo"):
        assert name in message


# ----------------------------------------------------------------------------------------------
# 11. dapo micro-batch invariance
# ----------------------------------------------------------------------------------------------


def _split_loss_and_grad(loss_type, sizes, divide_by_micro_batches):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([1, 2, 3, 4, 5, 6, 6, 6])  # micro-batch 4+4: 10 vs 23 tokens
    mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)).long()
    total_tokens = float(mask.sum())  # 33
    w = torch.tensor([0.7, -1.3, 0.4, 2.0, 0.1, -0.5], dtype=torch.float64, requires_grad=True)
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for size in sizes:
        per_token = torch.tanh(x[start : start + size] * w) + x[start : start + size] * w
        loss = aggregate_loss(
            per_token,
            mask[start : start + size],
            loss_type,
            max_completion_length=6,
            num_items_in_batch=total_tokens,
        )
        if divide_by_micro_batches:
            loss = loss / len(sizes)
        loss.backward()  # gradient accumulation
        total = total + loss.detach()
        start += size
    return total, w.grad.clone()


def test_dapo_micro_batch_invariance():
    full_loss, full_grad = _split_loss_and_grad("dapo", [8], False)
    for sizes in ([4, 4], [2, 2, 2, 2]):
        loss, grad = _split_loss_and_grad("dapo", sizes, False)
        torch.testing.assert_close(loss, full_loss)
        torch.testing.assert_close(grad, full_grad)


def test_bnpo_mean_accumulation_is_not_micro_batch_invariant():
    # why dapo exists: per-micro-batch token means averaged over micro-batches weigh the 10 tokens
    # of the first half like the 23 of the second
    full_loss, full_grad = _split_loss_and_grad("bnpo", [8], True)
    loss, grad = _split_loss_and_grad("bnpo", [4, 4], True)
    assert not torch.allclose(loss, full_loss)
    assert not torch.allclose(grad, full_grad)


# ----------------------------------------------------------------------------------------------
# 12. grpo_loss
# ----------------------------------------------------------------------------------------------

LOGPS = torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.5, 0.25, 0.5]]))
REF = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.5, 0.5, 0.25]]))
ADV = torch.tensor([1.5, -0.5])
GMASK = torch.tensor([[1, 1, 0], [1, 1, 1]])  # 5 real tokens


def test_grpo_loss_ratio_one_dapo():
    logps = LOGPS.clone().requires_grad_(True)
    out = loss_of(logps, logps.detach(), ADV, GMASK, max_completion_length=3)
    # ratio 1 -> l = -A: sum m*l = -1.5*2 + .5*3 = -1.5 -> / 5 tokens = -.3
    close(out.loss, -0.3)
    assert out.kl is None
    close(out.clip.region, 0.0)
    out.loss.backward()
    # grad = -A * m / 5: row 0 -.3, row 1 +.1
    close(logps.grad, [[-0.3, -0.3, 0.0], [0.1, 0.1, 0.1]])


def test_grpo_loss_ratio_one_grpo_type_and_num_items():
    logps = LOGPS.clone().requires_grad_(True)
    out = loss_of(logps, logps.detach(), ADV, GMASK, loss_type="grpo", max_completion_length=3)
    # sequences: -1.5 and .5 -> mean -.5; grad row 0: -1.5/(2 tok * 2 seq) = -.375, row 1: .5/(3*2) = 1/12
    close(out.loss, -0.5)
    out.loss.backward()
    close(logps.grad, [[-0.375, -0.375, 0.0], [1 / 12, 1 / 12, 1 / 12]])
    out10 = loss_of(LOGPS, LOGPS, ADV, GMASK, max_completion_length=3, num_items_in_batch=10)
    close(out10.loss, -0.15)  # -1.5 / 10


def test_grpo_loss_with_kl():
    logps = LOGPS.clone().requires_grad_(True)
    out = loss_of(
        logps, logps.detach(), ADV, GMASK, beta=0.1, ref_logps=REF, max_completion_length=3, use_bias_correction_kl=False
    )
    # delta = ref - logp: row 0: log2, -log2, (pad); row 1: 0, log2, -log2
    # k3(log2) = 1 - log2 = .306853, k3(-log2) = log2 - .5 = .193147; they sum to .5
    # masked mean kl = (.5 + 0 + .5) / 5 = .2
    close(out.kl, 0.2)
    # loss = -.3 + beta * sum(m*kl)/5 = -.3 + .1 * .2 = -.28
    close(out.loss, -0.28)
    out.loss.backward()
    # d k3 / d logp = 1 - exp(delta): row 0: -1, .5; row 1: 0, -1, .5
    # grad = (-A + .1 * (1 - exp(delta))) * m / 5
    #   row 0: (-1.5 - .1)/5 = -.32, (-1.5 + .05)/5 = -.29, 0
    #   row 1: (.5 + 0)/5 = .1, (.5 - .1)/5 = .08, (.5 + .05)/5 = .11
    close(logps.grad, [[-0.32, -0.29, 0.0], [0.1, 0.08, 0.11]])


def test_bias_corrected_kl_on_policy_keeps_the_value_and_changes_the_gradient():
    """TRL 1.16's default (DeepSeek-V3.2): the per-token KL times the ratio, which is 1 on-policy but
    differentiable: the KL's gradient becomes beta * (logp - ref) instead of beta * (1 - exp(ref - logp))."""
    logps = LOGPS.clone().requires_grad_(True)
    out = loss_of(logps, logps.detach(), ADV, GMASK, beta=0.1, ref_logps=REF, max_completion_length=3)
    close(out.kl, 0.2)  # as without the correction (test_grpo_loss_with_kl)
    close(out.loss, -0.28)
    out.loss.backward()
    # logp - ref: row 0: -log2, log2; row 1: 0, -log2, log2; grad = (-A + .1 * (logp - ref)) * m / 5
    log2 = math.log(2)
    close(logps.grad, [[(-1.5 - 0.1 * log2) / 5, (-1.5 + 0.1 * log2) / 5, 0.0], [0.1, (0.5 - 0.1 * log2) / 5, (0.5 + 0.1 * log2) / 5]])


def test_bias_corrected_kl_off_policy_weighs_each_token_by_its_ratio():
    logps = LOGPS.clone().requires_grad_(True)
    old_logps = LOGPS + torch.tensor([[math.log(2), 0.0, 0.0], [0.0, -math.log(2), 0.0]])  # ratios 1/2 and 2 there
    out = loss_of(logps, old_logps, ADV, GMASK, beta=0.1, ref_logps=REF, max_completion_length=3)
    ratio = torch.exp(LOGPS - old_logps)
    k3 = torch.exp(REF - LOGPS) - (REF - LOGPS) - 1
    # k3 per token: row 0: 1 - log2, log2 - .5; row 1: 0, 1 - log2, log2 - .5; weighted by .5, 1 / 1, 2, 1
    expected_kl = (0.5 * (1 - math.log(2)) + (math.log(2) - 0.5) + 2 * (1 - math.log(2)) + (math.log(2) - 0.5)) / 5
    close(out.kl, expected_kl)
    close(out.kl, (ratio * k3 * GMASK).sum() / 5)
    out.loss.backward()
    # d(rho * k3)/dlogp = rho * k3 + rho * (1 - exp(ref - logp)); the policy term's gradient as without KL
    plain = LOGPS.clone().requires_grad_(True)
    loss_of(plain, old_logps, ADV, GMASK, max_completion_length=3).loss.backward()
    kl_grad = 0.1 * (ratio * k3 + ratio * (1 - torch.exp(REF - LOGPS))) * GMASK / 5
    close(logps.grad, plain.grad + kl_grad)


def test_bias_corrected_kl_at_sequence_level_uses_the_sequence_ratio():
    """GSPO: one ratio per completion, exp(mean log-ratio), multiplies each of its tokens' KL (TRL)."""
    logps = LOGPS.clone().requires_grad_(True)
    old_logps = LOGPS + torch.tensor([[math.log(2), math.log(2), 0.0], [0.0, 0.0, 0.0]])  # row 0: ratio 1/2
    out = loss_of(
        logps, old_logps, ADV, GMASK, beta=0.1, ref_logps=REF, max_completion_length=3, importance_sampling_level="sequence"
    )
    # KL: row 0's two tokens sum to .5, times 1/2; row 1's to .5, times 1 -> .75 / 5 = .15
    close(out.kl, 0.15)
    # policy: row 0 (A = 1.5) min(.5 * 1.5, clip(.5) = .8 * 1.5) = .75 per token, 2 tokens: -1.5;
    # row 1 (A = -.5) ratio 1: +.5 per token, 3 tokens: 1.5; sum 0. loss = (0 + .1 * .75) / 5
    close(out.loss, 0.015)


def test_dapo_normaliser_clamps_the_token_count_before_dividing():
    from lit_grpo.algorithm import dapo_normaliser

    assert dapo_normaliser(100, world_size=2, steps_per_generation=2) == 25.0
    # fewer real tokens than world size x steps: TRL clamps the count, not the quotient
    assert dapo_normaliser(1, world_size=2, steps_per_generation=2) == 0.25
    assert dapo_normaliser(0, world_size=2, steps_per_generation=1) == 0.5
    per_token_loss, mask = torch.ones(1, 2), torch.tensor([[1, 0]])
    loss = aggregate_loss(per_token_loss, mask, "dapo", max_completion_length=2, num_items_in_batch=0.25)
    close(loss, 4.0)  # 1 real token / .25


def test_grpo_loss_beta_without_ref_raises():
    with pytest.raises(ValueError, match="ref_logps"):
        loss_of(LOGPS, LOGPS, ADV, GMASK, beta=0.1, max_completion_length=3)


def test_grpo_loss_sequence_level_importance_sampling():
    old = torch.zeros(2, 3)
    logps = torch.tensor([[0.2, -0.4, 99.0], [0.3, 0.3, 0.6]], requires_grad=True)
    mask = GMASK
    adv = torch.tensor([1.0, 1.0])
    # sequence ratios: exp(-.1) = .904837 (inside), exp(.4) = 1.491825 (> 1.2, A > 0: clipped)
    ratio = importance_ratio(logps, old, mask, "sequence")
    assert ratio.shape == (2, 1)
    assert torch.equal(ratio.expand(2, 3)[:, 0], ratio.expand(2, 3)[:, 2])
    out = loss_of(logps, old, adv, mask, importance_sampling_level="sequence", max_completion_length=3)
    # every token of a row has the same loss: row 0 -.904837 (x2 tokens), row 1 -1.2 (x3)
    # dapo: (-1.809675 - 3.6) / 5 = -1.081935
    close(out.loss, -1.081935)
    close(out.clip.high, 3 / 5)
    out.loss.backward()
    # row 0: loss = (2/5)(-rho0), d rho0 / d logp_t = rho0 * m_t / 2 -> grad = -rho0/5 = -.180967
    # row 1 clipped -> 0; padding -> 0
    close(logps.grad, [[-0.180967, -0.180967, 0.0], [0.0, 0.0, 0.0]])
    # token level on the same inputs: ratios differ per token, so the losses do too
    token = loss_of(logps.detach(), old, adv, mask, importance_sampling_level="token", max_completion_length=3)
    assert not torch.allclose(token.loss, out.loss)


def test_entropy_with_masked_logits_is_finite():
    # two tokens allowed with equal logits, two masked with -inf: entropy = log 2
    logits = torch.tensor([[[0.0, 0.0, -math.inf, -math.inf]]])
    close(entropy_from_logits(logits), [[LOG2]])


# --------------------------------------------------------------------------------------------------
# Policy losses beyond PPO's clip: delta, CISPO, SAPO; KL estimators; high-entropy tokens
# --------------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    from lit_grpo.algorithm import kl_estimate

    logp, ref = torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)])  # log r = logp - ref = -log 2
    close(kl_estimate(logp, ref, "k1"), [-LOG2])
    close(kl_estimate(logp, ref, "k2"), [0.5 * LOG2**2])
    close(kl_estimate(logp, ref, "k3"), [2 - LOG2 - 1])
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        kl_estimate(logp, ref, "k4")


def test_delta_caps_the_unclipped_term_of_negative_advantages():
    ratio = torch.tensor([[3.0], [3.0]])
    advantages = torch.tensor([-1.0, 1.0])
    # PPO: A < 0 keeps the unclipped -3 (loss 3); A > 0 is clipped at 1.2 (loss -1.2)
    close(clipped_surrogate_loss(ratio, advantages, 0.2, 0.2), [[3.0], [-1.2]])
    # delta = 2: the A < 0 token contributes at most delta * |A|
    close(clipped_surrogate_loss(ratio, advantages, 0.2, 0.2, delta=2.0), [[2.0], [-1.2]])


def test_cispo_detaches_the_clipped_weight_and_keeps_every_token():
    from lit_grpo.algorithm import cispo_loss

    logps = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old_logps = logps.detach() - torch.log(torch.tensor([[0.5, 2.0, 8.0]]))  # ratios 0.5, 2, 8
    ratio = torch.exp(logps - old_logps)
    loss = cispo_loss(ratio, torch.tensor([1.0]), logps, epsilon_max=5.0)
    close(loss, [[0.5, 4.0, 15.0]])  # -min(rho, 5) * A * logp
    loss.sum().backward()
    # d/dlogp = -sg(min(rho, 5)) * A: the token with ratio 8 still gets a (capped) gradient
    close(logps.grad, [[-0.5, -2.0, -5.0]])


def test_sapo_soft_gate_by_hand():
    from lit_grpo.algorithm import sapo_loss

    ratio = torch.tensor([[1.0], [2.0]], requires_grad=True)
    loss = sapo_loss(ratio, torch.tensor([1.0, -1.0]), temperature_pos=1.0, temperature_neg=2.0)
    sigmoid_2 = 1 / (1 + math.exp(-2.0))
    close(loss, [[-2.0], [2.0 * sigmoid_2]])  # -(4/tau) sigmoid(tau (rho - 1)) A
    loss.sum().backward()
    # at rho = 1 the gradient is the unclipped one, -A; at rho = 2 (A = -1, tau = 2) it has faded
    close(ratio.grad[0], [-1.0])
    close(ratio.grad[1], [4.0 * sigmoid_2 * (1 - sigmoid_2)])


def test_high_entropy_mask_keeps_the_top_quantile_of_real_tokens():
    from lit_grpo.algorithm import high_entropy_mask

    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    # real entropies 1..6: the median 3.5 splits them; padding (9.0) never counts
    keep = high_entropy_mask(entropy, mask, top_quantile=0.5)
    assert keep.tolist() == [[False, False, False, True], [True, True, False, False]]
    assert high_entropy_mask(entropy, mask, top_quantile=1.0).tolist() == mask.bool().tolist()
    # the threshold may come from a larger set (every rank's tokens): quantile 0.5 of 1..6 and 100, 200
    wider = torch.tensor([1.0, 2, 3, 4, 5, 6, 100, 200])
    keep = high_entropy_mask(entropy, mask, top_quantile=0.5, reference_entropies=wider)
    assert keep.tolist() == [[False, False, False, False], [True, True, False, False]]


def test_new_loss_types_in_the_registry_and_their_aggregation():
    from lit_grpo.algorithm import LOSS_TYPES

    assert {"cispo", "sapo"} <= set(LOSS_TYPES)
    # cispo normalises like dapo, sapo like grpo
    for loss_type, like in [("cispo", "dapo"), ("sapo", "grpo")]:
        close(
            aggregate_loss(PER_TOKEN, MASK, loss_type, max_completion_length=4, num_items_in_batch=7.0),
            aggregate_loss(PER_TOKEN, MASK, like, max_completion_length=4, num_items_in_batch=7.0),
        )
    # a policy mask removes tokens from the policy term but not from the normaliser
    logps = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    out_all = loss_of(logps, logps.detach(), torch.tensor([1.0]), torch.ones(1, 2), max_completion_length=2)
    out_one = loss_of(
        logps, logps.detach(), torch.tensor([1.0]), torch.ones(1, 2), max_completion_length=2,
        policy_mask=torch.tensor([[1, 0]]),
    )
    close(out_all.loss, -1.0)  # dapo: (-1 - 1) / 2 tokens
    close(out_one.loss, -0.5)  # (-1 + 0) / 2 tokens


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_rows_without_gradient_are_exactly_the_rows_whose_gradient_is_zero(loss_type, beta):
    from lit_grpo.algorithm import rows_without_gradient

    torch.manual_seed(0)
    advantages = torch.tensor([0.0, 1.2, 0.0, -0.7, 0.5])  # [5]
    loss_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])  # row 4: no token counts
    expected = [beta == 0.0, False, beta == 0.0, False, True]
    assert rows_without_gradient(advantages, loss_mask, loss_type, beta).tolist() == expected

    # the property it claims: those rows' log-probs get exactly zero gradient, the others do not
    old_logps = -torch.rand(5, 3) - 0.1
    logps = (old_logps + 0.5 * torch.randn(5, 3)).requires_grad_()  # ratios inside and outside the clip
    ref_logps = old_logps - 0.3 * torch.rand(5, 3)
    out = loss_of(
        logps, old_logps, advantages, loss_mask, loss_type=loss_type, beta=beta, ref_logps=ref_logps,
        max_completion_length=3, epsilon_high=5.0 if loss_type == "cispo" else 0.2,
    )
    (gradient,) = torch.autograd.grad(out.loss, logps)
    zero_rows = (gradient == 0).all(dim=1)
    assert zero_rows.tolist() == expected


def test_rows_without_gradient_never_assumed_for_a_registered_loss():
    from lit_grpo.algorithm import register_loss_type, rows_without_gradient

    advantages, loss_mask = torch.tensor([0.0, 1.0]), torch.tensor([[0, 0], [1, 1]])

    def entropy_bonus(ratio, advantages, logps, settings):  # an objective not proportional to A
        return -ratio * advantages.unsqueeze(-1) - 0.01 * logps

    def unmasked_sum(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
        return per_token_loss.sum()

    register_loss_type("test_bonus", objective=entropy_bonus, rows_independent=True)(LOSS_TYPES["dapo"].aggregate)
    register_loss_type("test_unmasked", rows_independent=True)(unmasked_sum)
    register_loss_type("test_not_independent")(LOSS_TYPES["dapo"].aggregate)
    try:
        assert rows_without_gradient(advantages, loss_mask, "test_bonus", 0.0).tolist() == [True, False]  # masked: yes
        assert rows_without_gradient(advantages, loss_mask, "test_unmasked", 0.0).tolist() == [True, False]  # A = 0: yes
        assert rows_without_gradient(advantages, loss_mask, "test_not_independent", 0.0).tolist() == [False, False]
        assert rows_without_gradient(torch.zeros(2), torch.ones(2, 2), "test_bonus", 0.0).tolist() == [False, False]
        assert rows_without_gradient(torch.tensor([0.0, 1.0]), torch.zeros(2, 2), "test_unmasked", 0.0).tolist() == [True, False]
    finally:
        for name in ("test_bonus", "test_unmasked", "test_not_independent"):
            del LOSS_TYPES[name]
