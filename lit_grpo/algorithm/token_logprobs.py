"""Token log-probabilities and entropy of a model's logits, and the mask of real completion tokens.

Shapes: ``logits [B, T, V]`` whose position ``t`` predicts ``tokens[:, t]`` (already shifted),
``tokens [B, T]``; ``N`` completions of padded length ``T``.
"""

from __future__ import annotations

import torch

LOGPROB_CHUNK_ELEMENTS = 2**22  # float32 elements of one chunk's temporaries: 16 MiB


def rows_per_logprob_chunk(logits: torch.Tensor, rows_per_chunk: int | None = None) -> int:
    """How many rows of ``logits [B, T, V]`` one chunk of :func:`selective_log_softmax` and
    :func:`entropy_from_logits` takes: ``rows_per_chunk`` if given, else as many rows as fit in
    :data:`LOGPROB_CHUNK_ELEMENTS` float32 elements, and at least one. A real vocabulary fills the
    budget with one row (128 x 32k is already 4M elements); a small one would otherwise pay a few
    operator calls per row for tiny tensors (64 rows of 32 x 101 logits: 12 ms per forward and
    backward row by row, 2.6 ms in one chunk)."""
    if rows_per_chunk is not None:
        return rows_per_chunk
    return max(1, LOGPROB_CHUNK_ELEMENTS // max(1, logits.size(1) * logits.size(2)))


def selective_log_softmax(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, rows_per_chunk: int | None = None
) -> torch.Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    ``logp[i, t] = logits[i, t, tok] / temp - logsumexp(logits[i, t, :] / temp)``

    Equal to ``log_softmax(logits / temperature).gather(-1, tokens)`` but never materialises a
    float32 log-softmax larger than one chunk: rows are processed ``rows_per_chunk`` at a time
    (default: :func:`rows_per_logprob_chunk`), so the largest temporary is ``[rows_per_chunk, T, V]``.

    Args:
        logits: ``[B, T, V]`` logits whose position ``t`` predicts ``tokens[:, t]`` (already shifted).
        tokens: ``[B, T]`` token ids.
        temperature: sampling temperature the tokens were drawn with.
    Returns:
        ``[B, T]`` float32 log-probabilities.
    """
    rows_per_chunk = rows_per_logprob_chunk(logits, rows_per_chunk)
    logps = []
    for start in range(0, logits.size(0), rows_per_chunk):
        chunk = logits[start : start + rows_per_chunk].float() / temperature  # [b, T, V]
        chunk_tokens = tokens[start : start + rows_per_chunk].unsqueeze(-1)  # [b, T, 1]
        token_logits = chunk.gather(-1, chunk_tokens).squeeze(-1)  # [b, T]
        logps.append(token_logits - torch.logsumexp(chunk, dim=-1))
    return torch.cat(logps, dim=0)


@torch.no_grad()
def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, rows_per_chunk: int | None = None
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, ``[B, T, V] -> [B, T]`` float32.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` with ``z = logits / temperature``; computed in
    row chunks like :func:`selective_log_softmax`. A metric only, so no gradient.
    """
    rows_per_chunk = rows_per_logprob_chunk(logits, rows_per_chunk)
    entropies = []
    for start in range(0, logits.size(0), rows_per_chunk):
        z = logits[start : start + rows_per_chunk].float() / temperature  # [b, T, V]
        log_z = torch.logsumexp(z, dim=-1, keepdim=True)  # [b, T, 1]
        probs = torch.exp(z - log_z)
        # a -inf logit (a masked token) has probability 0 and contributes 0, not 0 * -inf = NaN
        weighted = torch.where(probs > 0, probs * z, torch.zeros_like(z))
        entropies.append(log_z.squeeze(-1) - weighted.sum(-1))
    return torch.cat(entropies, dim=0)


def completion_mask_from_ids(
    completion_ids: torch.Tensor, eos_token_id: int | list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens: everything up to and including the first EOS.

    Args:
        completion_ids: ``[N, T]`` generated tokens (whatever ``generate`` put after EOS is padding).
        eos_token_id: one id or several ids that end a completion.
    Returns:
        ``completion_mask`` ``[N, T]`` (int64, 1 on real tokens) and ``is_truncated`` ``[N]`` (bool,
        True for completions that never emitted EOS: they were cut at ``max_completion_length``).
    """
    eos_ids = torch.as_tensor(eos_token_id, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, eos_ids)  # [N, T]
    num_tokens = completion_ids.size(1)
    # index of the first EOS, or T when there is none
    first_eos = torch.where(
        is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], num_tokens, dtype=torch.long)
    )  # [N]
    positions = torch.arange(num_tokens, device=completion_ids.device).expand_as(completion_ids)
    completion_mask = (positions <= first_eos.unsqueeze(1)).long()  # [N, T]
    is_truncated = ~is_eos.any(dim=1)  # [N]
    return completion_mask, is_truncated
