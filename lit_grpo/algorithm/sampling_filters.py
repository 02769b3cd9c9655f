"""The distribution a token was sampled from, recomputed by the trainer: penalty, temperature and truncation.

A sampler does not draw from ``softmax(logits)``: it first penalises tokens already seen
(``repetition_penalty``), divides by ``temperature``, then keeps only part of the vocabulary (``top_k``,
``top_p``, ``min_p``) and renormalises over what it kept. vLLM's ``processed_logprobs`` are log-probs
of that renormalised distribution; a full-vocabulary log-softmax differs from them by ``log S``
(``S`` the kept mass) at every token, so the importance ratio of every token carries ``S`` and the
policy gradient carries ``A * grad log S`` (huggingface/trl#6789). :func:`sampling_log_softmax`
computes the log-probs of the distribution that sampled, for every backend.

Order of the steps (each engine's own: its ``sampling_filter_order``, a key of :data:`FILTER_ORDERS`):

* ``transformers`` (``generate``, and the ``lit`` sampler, which runs ``transformers``' processors):
  repetition penalty, temperature, top-k, top-p, min-p.
* ``vllm`` (``vllm/v1/sample/sampler.py``): penalties, temperature, min-p (an argmax-invariant logits
  processor), then top-k and top-p (``apply_top_k_top_p``).

Top-k and min-p keep a prefix of the tokens sorted by logit, so they commute; top-p after min-p is
another set than min-p after top-p, hence :attr:`SamplingFilters.min_p_first`. Every step keeps
the set of the ``transformers``/vLLM PyTorch reference: top-k keeps ties with the k-th logit; top-p
keeps the most likely tokens until their mass reaches ``top_p`` (at least one); min-p removes the
tokens below ``min_p`` times the largest probability.

Which support at training time (where the policy has moved since sampling): the support is
computed from the logits being scored, and the sampled token is never left out of it. On-policy
that is exactly the sampler's support (the sampled token is in it by construction), so the ratio is
1; after updates it is the support the current policy would sample from, plus the token, whose
log-prob is then finite (small) instead of ``-inf``, so PPO's clip and the importance weights see a
number (prime-rl #2601 recomputes the support from the trainer's logits the same way). Recording the
kept set at sampling time instead (DeepSeek-V3.2's "Keep Sampling Mask", arXiv:2512.02556 sec. 3.1;
vLLM #49577, prime-rl #2979) needs the engine to return it and to carry up to ``top_k`` ids per
token: neither the ``lit`` sampler nor ``generate`` nor vLLM's CPU build returns it. A boundary
token that the engine's kernels (Triton top-k/top-p on GPUs) kept and the trainer's selection did
not, or the reverse, changes the kept mass by that token's probability only.

The repetition penalty is applied as the samplers apply it: a token seen before position ``t`` (in
the prompt's real tokens, or in the completion before ``t``; left padding is not seen, as in
``transformers`` >= 5.23 and vLLM; older ``transformers`` penalise the pad id of padded rows in
``generate`` and the ``lit`` sampler, and so does the trainer then) has its logit divided by the
penalty where positive and multiplied where negative.

Memory: positions are scored a chunk at a time (``[c, V]`` float32 temporaries,
:data:`~lit_grpo.algorithm.token_logprobs.LOGPROB_CHUNK_ELEMENTS` elements); what autograd keeps per chunk is the
masked ``[c, V]`` float32 logits, as the full-vocabulary log-softmax keeps its ``[c, V]`` float32
logits (and with the repetition penalty two ``[c, V]`` boolean masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_grpo.algorithm.entropy_control import token_entropy
from lit_grpo.algorithm.token_logprobs import (
    LOGPROB_CHUNK_ELEMENTS,
    entropy_from_logits,
    rows_per_logprob_chunk,
    selective_log_softmax,
)

__all__ = ["FILTER_ORDERS", "SamplingFilters", "kept_tokens", "plain_logps_and_entropy", "sampling_log_softmax", "seen_before",
           "token_first_positions"]

# a sampler's order of the steps -> whether min-p comes before top-k and top-p (see the module's doc)
FILTER_ORDERS = {"transformers": False, "vllm": True}


@dataclass(frozen=True)
class SamplingFilters:
    """What turns a model's logits into the distribution its tokens are sampled from.

    ``top_k`` 0, ``top_p`` 1, ``min_p`` 0 (or None) and ``repetition_penalty`` 1 turn a step off;
    ``min_p_first``: min-p before top-k and top-p (vLLM) rather than after them (``transformers``);
    ``penalise_padding``: the pad ids of a row's left padding count as seen (``transformers`` < 5.23)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_p_first: bool = False
    penalise_padding: bool = False

    @classmethod
    def of_run(cls, hp, transformers_penalises_padding: bool = False) -> SamplingFilters:
        """The training sampling settings of a run (``hp``: a :class:`lit_grpo.settings.SamplingSettings`,
        or anything with the same names), in the order of its ``filter_order`` (its engine's, a key of
        :data:`FILTER_ORDERS`); ``transformers_penalises_padding``: the installed ``transformers``
        penalises left padding (< 5.23), which then holds for a sampler in ``transformers``' order (it
        runs ``transformers``' processors), never for vLLM's."""
        if hp.filter_order not in FILTER_ORDERS:
            raise ValueError(f"a sampling filter order is one of {tuple(FILTER_ORDERS)}, got {hp.filter_order!r}")
        transformers_order = hp.filter_order == "transformers"
        return cls(
            temperature=hp.temperature,
            top_k=hp.top_k or 0,
            top_p=1.0 if hp.top_p is None else hp.top_p,
            min_p=hp.min_p,
            repetition_penalty=hp.repetition_penalty or 1.0,
            min_p_first=FILTER_ORDERS[hp.filter_order],
            penalise_padding=transformers_penalises_padding and transformers_order,
        )

    @property
    def truncates(self) -> bool:
        """Whether part of the vocabulary is left out (top-k, top-p or min-p)."""
        return self.top_k > 0 or self.top_p < 1.0 or bool(self.min_p)

    @property
    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def is_plain_softmax(self) -> bool:
        """``softmax(logits / temperature)`` over the whole vocabulary."""
        return not self.truncates and not self.penalises


# ----------------------------------------------------------------------------------------------
# The steps, on one chunk of positions: logits [c, V]
# ----------------------------------------------------------------------------------------------


def top_k_kept(z: torch.Tensor, k: int) -> torch.Tensor:
    """``[c, V]`` bool: the tokens at or above the k-th largest logit (ties kept)."""
    k = min(k, z.size(-1))
    return z >= torch.topk(z, k, dim=-1).values[..., -1:]


def top_p_kept(z: torch.Tensor, top_p: float, at_most: int | None = None) -> torch.Tensor:
    """``[c, V]`` bool: nucleus of ``softmax(z)`` (``-inf`` entries already left out): the most
    likely tokens until their mass reaches ``top_p``, i.e. each token whose more likely tokens hold
    less than ``top_p`` (the reference sorts ascending and removes the tokens whose cumulative
    probability is ``<= 1 - top_p``: the same set, up to rounding at the boundary).

    Only the most likely tokens are sorted: a window of ``at_most`` (after top-k no row has more
    finite entries) or 64, four times wider until it holds ``top_p`` of every row's mass (a sort of
    the whole vocabulary costs ~7 ms per position for 32k tokens on a CPU core; the window, ~0.3)."""
    probs = z.softmax(dim=-1)  # [c, V]
    width = min(at_most or 64, z.size(-1))
    while True:
        top, order = probs.topk(width, dim=-1)  # [c, w] descending
        cumulative = top.cumsum(dim=-1)
        if width == z.size(-1) or at_most is not None or bool((cumulative[:, -1] >= top_p).all()):
            break
        width = min(4 * width, z.size(-1))
    kept_sorted = cumulative - top < top_p  # the mass of the more likely tokens
    kept_sorted[..., 0] = True
    return torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, kept_sorted)


def min_p_kept(z: torch.Tensor, min_p: float) -> torch.Tensor:
    """``[c, V]`` bool: the tokens whose probability is at least ``min_p`` times the largest."""
    probs = z.softmax(dim=-1)
    return probs >= min_p * probs.amax(dim=-1, keepdim=True)


@torch.no_grad()
def kept_tokens(z: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
    """``[c, V]`` bool: the support the sampler keeps from the tempered (and penalised) logits
    ``z [c, V]``, each filter applied to what the previous ones left, in the backend's order."""
    z = z.detach()
    steps = [("top_k", filters.top_k > 0), ("top_p", filters.top_p < 1.0)]
    min_p_step = ("min_p", bool(filters.min_p))
    steps = [min_p_step, *steps] if filters.min_p_first else [*steps, min_p_step]
    kept = torch.ones_like(z, dtype=torch.bool)
    for name, active in steps:
        if not active:
            continue
        current = z.masked_fill(~kept, float("-inf"))
        if name == "top_k":
            kept &= top_k_kept(current, filters.top_k)
        elif name == "top_p":  # after top-k: at most the kept count (k, or more on ties) to sort
            at_most = int(kept.sum(dim=-1).max()) if filters.top_k > 0 else None
            kept &= top_p_kept(current, filters.top_p, at_most)
        else:
            kept &= min_p_kept(current, filters.min_p)
    return kept


def penalised(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits [c, V]`` with the tokens ``seen [c, V]`` penalised as ``transformers`` and vLLM do:
    a positive logit divided by ``penalty``, a negative one multiplied by it."""
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


# ----------------------------------------------------------------------------------------------
# Tokens seen before each position (repetition penalty)
# ----------------------------------------------------------------------------------------------


def token_first_positions(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokens: torch.Tensor, vocab_size: int, with_padding: bool = False
) -> torch.Tensor:
    """``[B, V]`` int32: for each row and token id, the first completion position holding it, -1 if
    a real (unpadded, or any with ``with_padding``) prompt token is that id, ``T`` if neither
    (``prompt_ids/mask [B, P]``, ``tokens [B, T]``)."""
    B, T = tokens.shape
    first = torch.full((B, vocab_size + 1), T, dtype=torch.int32, device=tokens.device)  # id V: padding
    positions = torch.arange(T, dtype=torch.int32, device=tokens.device).expand(B, T)
    first.scatter_reduce_(1, tokens.long(), positions, reduce="amin")
    prompt = prompt_ids.long()
    if not with_padding:
        prompt = prompt.masked_fill(prompt_mask == 0, vocab_size)  # padding goes to the spare column
    first.scatter_(1, prompt, -1)
    return first[:, :vocab_size]


def seen_before(first_positions: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[c, V]`` bool: token ids already in row ``rows[i]``'s context before completion position
    ``steps[i]`` (``first_positions [B, V]`` from :func:`token_first_positions`)."""
    return first_positions[rows] < steps[:, None]


# ----------------------------------------------------------------------------------------------
# Log-probs and entropy
# ----------------------------------------------------------------------------------------------


def sampling_log_softmax(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    filters: SamplingFilters,
    prompt_ids: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    positions_per_chunk: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, T]`` of ``tokens [B, T]`` under the distribution ``filters`` sample from
    (and its entropy ``[B, T]`` with ``with_entropy``), from ``logits [B, T, V]`` whose position
    ``t`` predicts ``tokens[:, t]``. The entropy is a metric without gradient, unless
    ``entropy_grad`` (the entropy bonus, ``model.entropy_coef``): then it is
    :func:`~lit_grpo.algorithm.token_entropy` of the same masked logits, whose backward keeps only
    those logits (kept for the log-probs already) and two values per position.

    ``logp = z_tok - logsumexp(z over the kept tokens)``, ``z`` the penalised logits over the
    temperature; the kept set is :func:`kept_tokens` of ``z`` plus the token itself (see the module
    doc), a constant for autograd. The repetition penalty needs the rows' prompts
    (``prompt_ids/prompt_mask [B, P]``). A plain softmax (no truncation, no penalty) is exactly
    :func:`lit_grpo.algorithm.selective_log_softmax` (and :func:`~lit_grpo.algorithm.entropy_from_logits`).
    Positions go ``positions_per_chunk`` at a time (default: ``LOGPROB_CHUNK_ELEMENTS // V``).
    """
    if filters.is_plain_softmax and with_entropy and entropy_grad:
        return plain_logps_and_entropy(logits, tokens, filters.temperature)
    if filters.is_plain_softmax:
        logps = selective_log_softmax(logits, tokens, filters.temperature)
        return logps, entropy_from_logits(logits, filters.temperature) if with_entropy else None
    B, T, V = logits.shape
    if B * T == 0:
        empty = logits.new_zeros(B, T, dtype=torch.float32)
        return empty, empty.clone() if with_entropy else None
    first_positions = None
    if filters.penalises:
        if prompt_ids is None or prompt_mask is None:
            raise ValueError("the repetition penalty needs the prompts the completions continue")
        first_positions = token_first_positions(prompt_ids, prompt_mask, tokens, V, filters.penalise_padding)  # [B, V]
    flat_logits = logits.reshape(B * T, V)  # a view of the model's logits
    flat_tokens = tokens.reshape(B * T, 1)
    size = positions_per_chunk or max(1, LOGPROB_CHUNK_ELEMENTS // V)
    logps, entropies = [], []
    for start in range(0, B * T, size):
        index = torch.arange(start, min(start + size, B * T), device=logits.device)  # [c] flat positions
        z = flat_logits[start : start + size].float()  # [c, V]
        if first_positions is not None:
            z = penalised(z, seen_before(first_positions, index // T, index % T), filters.repetition_penalty)
        z = z / filters.temperature
        chunk_tokens = flat_tokens[start : start + size]  # [c, 1]
        kept = kept_tokens(z, filters).scatter_(-1, chunk_tokens, True)  # never without the sampled token
        # z plus 0 on the support and -inf off it: the addition keeps nothing for backward (a masked_fill would keep the mask)
        masked = z + torch.zeros_like(z).masked_fill_(~kept, float("-inf"))  # [c, V]
        log_normaliser = torch.logsumexp(masked, dim=-1)  # [c]
        # gathered from ``masked`` (the token is in the support: the same value), so that autograd keeps one [c, V] tensor
        logps.append(masked.gather(-1, chunk_tokens).squeeze(-1) - log_normaliser)
        if with_entropy:
            entropies.append(chunk_entropy(masked, log_normaliser, kept, entropy_grad))
    return torch.cat(logps).reshape(B, T), torch.cat(entropies).reshape(B, T) if with_entropy else None


def chunk_entropy(masked: torch.Tensor, log_normaliser: torch.Tensor, kept: torch.Tensor, entropy_grad: bool) -> torch.Tensor:
    """Entropy ``[c]`` of a chunk's filtered logits ``masked [c, V]`` (``-inf`` off the support ``kept [c, V]``,
    ``log_normaliser [c]`` their logsumexp): with its gradient (:func:`~lit_grpo.algorithm.token_entropy`,
    the entropy bonus) when ``entropy_grad``, else a metric without one."""
    if entropy_grad:
        return token_entropy(masked)  # -inf off the support counts 0
    with torch.no_grad():
        probs = torch.exp(masked.detach() - log_normaliser.detach()[:, None])
        weighted = torch.where(kept, probs * masked.detach(), torch.zeros_like(probs))
        return log_normaliser.detach() - weighted.sum(-1)


def plain_logps_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy ``[B, T]``, both with their gradient (the entropy bonus), of
    ``softmax(logits / temperature)`` from ``logits [B, T, V]``, in the row chunks of
    :func:`~lit_grpo.algorithm.selective_log_softmax`: both from one float32 copy of each chunk, the one
    tensor of its size that autograd keeps (:func:`~lit_grpo.algorithm.token_entropy` keeps it too)."""
    rows = rows_per_logprob_chunk(logits)
    logps, entropies = [], []
    for start in range(0, logits.size(0), rows):
        z = logits[start : start + rows].float() / temperature  # [b, T, V]
        token_logits = z.gather(-1, tokens[start : start + rows].unsqueeze(-1)).squeeze(-1)  # [b, T]
        logps.append(token_logits - torch.logsumexp(z, dim=-1))
        entropies.append(token_entropy(z))
    return torch.cat(logps), torch.cat(entropies)
