"""The trainer's log-probs are those of the distribution that sampled (issue 49.9, huggingface/trl#6789).

With top-k, top-p, min-p or a repetition penalty the samplers draw from a penalised, truncated and
renormalised distribution; :func:`lit_grpo.algorithm.sampling_filters.sampling_log_softmax` recomputes it.
By-hand checks of each step and of the order, then the ratio ``exp(trainer - sampler)`` on-policy for
the ``lit`` sampler and for ``transformers``' ``generate`` (vLLM colocated: tests/rollout/test_vllm.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo import algorithm
from lit_grpo.algorithm.sampling_filters import SamplingFilters, kept_tokens, sampling_log_softmax
from lit_grpo.rollout.engines.lit_sampler import sample_groups
from lit_grpo.rollout.records import Rollout
from lit_grpo.train.module import GRPOModule

REWARDS = [{"name": "char_fraction", "args": {"chars": "a"}}]
TRUNCATING = dict(top_p=0.9, top_k=20, min_p=0.05)


# ----------------------------------------------------------------------------------------------
# By hand: one position at a time, in plain Python
# ----------------------------------------------------------------------------------------------


def kept_by_hand(z: list[float], top_k=0, top_p=1.0, min_p=0.0, min_p_first=False) -> set[int]:
    """The support, from the definitions: top-k the k largest, top-p the smallest set of most
    likely tokens whose renormalised mass reaches top_p, min-p at least min_p times the largest
    probability; each applied to what the previous left."""
    kept = set(range(len(z)))

    def probs(ids):
        total = sum(math.exp(z[i]) for i in ids)
        return {i: math.exp(z[i]) / total for i in ids}

    def top_k_step(ids):
        return set(sorted(ids, key=lambda i: -z[i])[:top_k])

    def top_p_step(ids):
        p, out, mass = probs(ids), set(), 0.0
        for i in sorted(ids, key=lambda i: -z[i]):
            out.add(i)
            mass += p[i]
            if mass >= top_p:
                break
        return out

    def min_p_step(ids):
        p = probs(ids)
        return {i for i in ids if p[i] >= min_p * max(p.values())}

    steps = [(top_k_step, top_k > 0), (top_p_step, top_p < 1.0)]
    steps = [(min_p_step, min_p > 0), *steps] if min_p_first else [*steps, (min_p_step, min_p > 0)]
    for step, active in steps:
        if active:
            kept = step(kept)
    return kept


def logp_by_hand(z: list[float], token: int, kept: set[int]) -> float:
    support = kept | {token}
    return z[token] - math.log(sum(math.exp(z[i]) for i in support))


def test_each_filter_and_their_order_against_a_by_hand_computation():
    """Log-probs of random tokens under top-k / top-p / min-p and their combinations, both orders,
    equal the by-hand support's log-softmax; and the orders differ where top-p meets min-p."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=generator) * 3  # [B, T, V]: peaked enough to truncate
    tokens = torch.randint(0, 40, (3, 5), generator=generator)
    temperature = 0.8
    settings = [dict(top_k=7), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=20, top_p=0.9, min_p=0.05),
                dict(top_p=0.7, min_p=0.2)]
    orders_differ = False
    for setting in settings:
        for min_p_first in (False, True):
            filters = SamplingFilters(temperature=temperature, min_p_first=min_p_first, **setting)
            logps, _ = sampling_log_softmax(logits, tokens, filters)
            for b in range(3):
                for t in range(5):
                    z = (logits[b, t].double() / temperature).tolist()
                    kept = kept_by_hand(z, min_p_first=min_p_first, **setting)
                    kept_here = set(kept_tokens(logits[b, t][None] / temperature, filters)[0].nonzero().flatten().tolist())
                    assert kept_here == kept, (setting, min_p_first, b, t)
                    assert logps[b, t].item() == pytest.approx(logp_by_hand(z, int(tokens[b, t]), kept), abs=1e-5)
        a, b = (kept_tokens(logits.flatten(0, 1) / temperature, SamplingFilters(top_p=0.7, min_p=0.2, min_p_first=first))
                for first in (False, True))
        orders_differ |= not torch.equal(a, b)
    assert orders_differ  # vLLM's order (min-p first) is another distribution than transformers'


def test_a_token_outside_the_support_is_kept_in_it_with_a_finite_logp():
    """Off-policy a sampled token may fall outside the current support: it is added to it, so its
    log-prob is z_tok - logsumexp(z over support + tok) rather than -inf; on-policy tokens are unaffected."""
    z = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0]]])
    filters = SamplingFilters(top_k=2)
    outside, _ = sampling_log_softmax(z, torch.tensor([[4]]), filters)
    inside, _ = sampling_log_softmax(z, torch.tensor([[1]]), filters)
    assert outside.item() == pytest.approx(0.0 - math.log(math.exp(4) + math.exp(3) + 1.0), abs=1e-6)
    assert inside.item() == pytest.approx(3.0 - math.log(math.exp(4) + math.exp(3)), abs=1e-6)


def test_repetition_penalty_against_a_by_hand_computation():
    """Tokens in the real prompt or earlier in the completion are penalised (positive logits divided,
    negative multiplied); left padding and later tokens are not."""
    r, T = 2.0, 0.5  # V = 6 tokens
    logits = torch.tensor([[[1.0, -1.0, 2.0, 0.5, -0.5, 3.0]] * 3])  # [1, 3, V], the same at every position
    prompt_ids, prompt_mask = torch.tensor([[5, 1]]), torch.tensor([[0, 1]])  # 5 is padding, 1 is real
    tokens = torch.tensor([[2, 3, 0]])
    logps, entropy = sampling_log_softmax(logits, tokens, SamplingFilters(temperature=T, repetition_penalty=r),
                                          prompt_ids, prompt_mask, with_entropy=True)
    seen_at = [{1}, {1, 2}, {1, 2, 3}]  # position t sees the prompt and tokens[:t]
    for t in range(3):
        z = [(v / r if v > 0 else v * r) if i in seen_at[t] else v for i, v in enumerate(logits[0, t].tolist())]
        z = [v / T for v in z]
        expected = z[int(tokens[0, t])] - math.log(sum(math.exp(v) for v in z))
        assert logps[0, t].item() == pytest.approx(expected, abs=1e-6)
        p = torch.tensor(z).softmax(0)
        assert entropy[0, t].item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-5)
    # transformers < 5.23 penalises the pad id of the left padding too (generate, the lit sampler): so then does the trainer
    with_padding, _ = sampling_log_softmax(logits, torch.tensor([[5, 5, 5]]),
                                           SamplingFilters(temperature=T, repetition_penalty=r, penalise_padding=True),
                                           prompt_ids, prompt_mask)
    z = [(v / r if v > 0 else v * r) if i in {1, 5} else v for i, v in enumerate(logits[0, 0].tolist())]
    assert with_padding[0, 0].item() == pytest.approx(z[5] / T - math.log(sum(math.exp(v / T) for v in z)), abs=1e-6)


def test_no_filter_is_exactly_the_full_vocabulary_log_softmax():
    """The quickstart's setting (no truncation, no penalty) runs today's computation: bit-identical."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 30, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 30, (2, 4), generator=generator)
    logps, entropy = sampling_log_softmax(logits, tokens, SamplingFilters(temperature=0.7), with_entropy=True)
    assert torch.equal(logps, algorithm.selective_log_softmax(logits, tokens, 0.7))
    assert torch.equal(entropy, algorithm.entropy_from_logits(logits, 0.7))


def test_gradient_is_that_of_the_renormalised_distribution_and_chunks_change_nothing():
    """d logp(tok) / d z = onehot(tok) - p_kept (0 outside the support), and scoring positions a few
    at a time gives the same values and gradient as all at once."""
    generator = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 3, 25, generator=generator) * 3).requires_grad_()
    tokens = torch.randint(0, 25, (2, 3), generator=generator)
    filters = SamplingFilters(top_p=0.8, top_k=10)
    whole, _ = sampling_log_softmax(logits, tokens, filters)
    (gradient,) = torch.autograd.grad(whole.sum(), logits)
    kept = kept_tokens(logits.detach().flatten(0, 1), filters).scatter(-1, tokens.reshape(-1, 1), True)
    p = logits.detach().flatten(0, 1).masked_fill(~kept, float("-inf")).softmax(-1)
    expected = torch.nn.functional.one_hot(tokens.reshape(-1), 25).float() - p
    torch.testing.assert_close(gradient.flatten(0, 1), expected, atol=1e-6, rtol=1e-6)
    chunked, _ = sampling_log_softmax(logits, tokens, filters, positions_per_chunk=2)
    (chunked_gradient,) = torch.autograd.grad(chunked.sum(), logits)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked_gradient, gradient)


# ----------------------------------------------------------------------------------------------
# On-policy: the trainer's log-probs equal the sampler's, for the lit sampler and generate
# ----------------------------------------------------------------------------------------------


def peaked_module(tiny_model_dir, **sampling) -> GRPOModule:
    """A module on the tiny model with weights scaled up (the random init gives almost flat logits,
    which top-p 0.9 barely truncates)."""
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=12,
                        temperature=0.9, **sampling)
    module.configure_model()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.policy.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.15)
    return module.eval()


def rollout_of(module: GRPOModule, prompt_ids, prompt_mask, completion_ids) -> Rollout:
    G = completion_ids.size(0) // prompt_ids.size(0)
    eos = module.generation_config.eos_token_id
    completion_mask, is_truncated = algorithm.completion_mask_from_ids(completion_ids, eos)
    repeat = lambda tensor: tensor.repeat_interleave(G, dim=0)  # noqa: E731
    return Rollout(repeat(prompt_ids), repeat(prompt_mask), completion_ids, completion_mask, is_truncated,
                   torch.zeros(completion_ids.size(0), dtype=torch.bool))


def assert_ratio_is_one(module: GRPOModule, rollout: Rollout, sampler_logps: torch.Tensor) -> None:
    """exp(trainer - sampler) is 1 on every completion token, and the full-vocabulary log-softmax
    (what the trainer computed before) is off by the kept mass: the check can tell."""
    trainer_logps, _ = module.logprobs.completion_logps(module.policy, rollout)
    mask = rollout.completion_mask[:, : trainer_logps.size(1)].bool()
    ratio = torch.exp(trainer_logps - sampler_logps[:, : trainer_logps.size(1)])[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    with torch.no_grad():  # the full vocabulary: every ratio is the kept mass S <= 1, on average well below
        logits = module.policy(torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
                               attention_mask=torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)).logits
        full = algorithm.selective_log_softmax(logits[:, rollout.prompt_ids.size(1) - 1 : -1], rollout.completion_ids,
                                               module.hparams.temperature)
    full_ratio = torch.exp(full[:, : trainer_logps.size(1)] - sampler_logps[:, : trainer_logps.size(1)])[mask]
    assert full_ratio.mean() < 0.97, full_ratio.mean()


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_lit_sampler_ratio_is_one_on_policy(tiny_model_dir, repetition_penalty):
    torch.manual_seed(0)
    module = peaked_module(tiny_model_dir, repetition_penalty=repetition_penalty, **TRUNCATING)
    encoded = module.tokenizer(["a:", "Say b, then c:"], return_tensors="pt", padding=True, padding_side="left",
                               add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    completions, sampler_logps = sample_groups(module.policy, prompt_ids, prompt_mask, 4, module.generation_config,
                                               return_logprobs=True)
    assert_ratio_is_one(module, rollout_of(module, prompt_ids, prompt_mask, completions), sampler_logps)


def test_transformers_generate_ratio_is_one_on_policy(tiny_model_dir):
    torch.manual_seed(0)
    module = peaked_module(tiny_model_dir, generation_backend="transformers", **TRUNCATING)
    encoded = module.tokenizer(["a:", "Say b, then c:"], return_tensors="pt", padding=True, padding_side="left",
                               add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    with torch.no_grad():
        output = module.policy.generate(
            input_ids=prompt_ids.repeat_interleave(4, 0), attention_mask=prompt_mask.repeat_interleave(4, 0),
            generation_config=module.generation_config, output_scores=True, return_dict_in_generate=True,
        )
    completions = output.sequences[:, prompt_ids.size(1):]  # [N, C]
    scores = torch.stack(output.scores, dim=1)  # [N, C, V] generate's processed scores
    sampler_logps = torch.log_softmax(scores.float(), -1).gather(-1, completions[..., None]).squeeze(-1)
    rollout = rollout_of(module, prompt_ids, prompt_mask, completions)
    assert_ratio_is_one(module, rollout, sampler_logps.masked_fill(rollout.completion_mask == 0, 0.0))


def saved_for_backward_bytes(function) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of ``function()``."""
    saved = {}

    def pack(tensor):
        saved[(tensor.data_ptr(), tensor.dtype)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(saved.values())


def test_truncation_keeps_no_more_for_backward_than_the_full_vocabulary():
    """At scale (vocab 150k, 32k-token completions) what autograd keeps is the memory of the pass:
    with truncation it is the one [c, V] float32 chunk per chunk that the full-vocabulary
    log-softmax keeps, not a second copy (the mask, the unmasked logits)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 64, 2048, generator=generator).requires_grad_()
    tokens = torch.randint(0, 2048, (2, 64), generator=generator)
    plain = saved_for_backward_bytes(lambda: sampling_log_softmax(logits, tokens, SamplingFilters(temperature=0.7)))
    truncated = saved_for_backward_bytes(
        lambda: sampling_log_softmax(logits, tokens, SamplingFilters(temperature=0.7, **TRUNCATING), positions_per_chunk=16))
    assert plain >= logits.numel() * 4
    assert truncated <= plain * 1.01, (truncated, plain)


def test_top_p_over_a_wide_nucleus_equals_the_reference_sort():
    """A flat distribution's nucleus holds hundreds of tokens (the window of sorted tokens grows past
    its first 64): the support equals that of the reference implementation (transformers' and vLLM's
    PyTorch top-p: sort ascending, remove cumulative <= 1 - top_p, keep the last)."""
    generator = torch.Generator().manual_seed(4)
    z = torch.randn(6, 1000, generator=generator) * torch.tensor([0.2, 0.5, 1.0, 2.0, 4.0, 8.0])[:, None]
    ascending, order = z.sort(dim=-1)
    removed = ascending.softmax(-1).cumsum(-1) <= 1 - 0.9
    removed[:, -1] = False
    reference = ~removed.scatter(-1, order, removed)
    kept = kept_tokens(z, SamplingFilters(top_p=0.9))
    assert kept.sum(-1)[0] > 256  # the widest row needed the whole vocabulary sorted
    assert torch.equal(kept, reference)
