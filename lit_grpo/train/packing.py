"""Rows packed into one sequence: the padding-free layout of a forward (``model.padding_free``).

A forward of ``n`` padded rows ``[n, L]`` (left-padded prompts, right-padded completions) spends
its compute on padding too. :func:`pack_rows` keeps only the real tokens of every row, in order, as
ONE sequence ``[1, T]`` (``T`` = the rows' real tokens) whose ``position_ids`` restart at 0 at each
row, exactly the positions the padded forward gives them
(:func:`lit_grpo.rollout.records.position_ids_from_mask`). ``cu_seqlens`` is flash attention's
variable-length layout (``[0, len_0, len_0 + len_1, ...]``, int32): the packed forward attends
within each row only, so every token sees what it saw in the padded forward.
:meth:`PackedRows.unpack` puts values of the packed tokens back in the padded layout (0 at padding).

Pure tensor code: no model, no framework.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedRows", "pack_rows", "token_budget_chunks"]


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of ``n`` padded rows ``[n, L]`` as one sequence of ``T`` tokens.

    Attributes:
        input_ids: ``[1, T]`` the rows' real tokens, row after row.
        position_ids: ``[1, T]`` each token's position in its row, skipping padding (from 0 per row).
        row_lengths: ``[n]`` real tokens per row (0 for an empty row).
        cu_seqlens: ``[n + 1]`` int32, where each row starts in the sequence, and ``T`` last.
        token_index: ``[T]`` the flat index ``row * L + column`` of each packed token in ``[n, L]``.
        shape: ``(n, L)``, the padded layout.
        max_length: the longest row's real tokens (flash attention's ``max_seqlen``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    row_lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    token_index: torch.Tensor
    shape: tuple[int, int]
    max_length: int

    @property
    def num_tokens(self) -> int:
        """``T``, the tokens that go through the model."""
        return int(self.token_index.numel())

    def positions_from(self, column: int) -> torch.Tensor:
        """``[K]`` the packed positions (indices into ``T``) of the tokens in padded columns ``>= column``."""
        return (self.token_index % self.shape[1] >= column).nonzero().squeeze(1)

    def unpack(self, values: torch.Tensor, column: int = 0) -> torch.Tensor:
        """``values [1, T, ...]`` of the packed tokens in the padded layout ``[n, L, ...]``, 0 at padding.

        With ``column > 0``, ``values [1, K, ...]`` are those of :meth:`positions_from` ``(column)``
        only and the result is ``[n, L - column, ...]`` (the columns from ``column`` on). Autograd
        flows to ``values`` (``index_copy``); the padding gets no gradient."""
        n, length = self.shape
        index = self.token_index if column == 0 else self.token_index[self.positions_from(column)]
        rows, columns = index // length, index % length - column
        flat = values[0]  # [T or K, ...]
        out = flat.new_zeros((n * (length - column), *flat.shape[1:]))
        return out.index_copy(0, rows * (length - column) + columns, flat).view(n, length - column, *flat.shape[1:])

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """``values [n, L, ...]`` in the padded layout -> ``[1, T, ...]`` at the packed tokens."""
        return values.flatten(0, 1)[self.token_index].unsqueeze(0)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack the real tokens (``attention_mask`` 1) of ``input_ids [n, L]`` into one sequence ``[1, T]``.

    Positions count each row's real tokens from 0 (a hole in the mask is skipped, as
    :func:`~lit_grpo.rollout.records.position_ids_from_mask` skips it in the padded forward)."""
    n, length = input_ids.shape
    real = attention_mask.bool()  # [n, L]
    token_index = real.flatten().nonzero().squeeze(1)  # [T], row-major: row after row, columns in order
    positions = real.long().cumsum(dim=1) - 1  # [n, L]: the real tokens' positions within their rows
    row_lengths = real.sum(dim=1)  # [n]
    cu_seqlens = torch.nn.functional.pad(row_lengths.cumsum(0), (1, 0)).to(torch.int32)  # [n + 1]
    return PackedRows(
        input_ids=input_ids.flatten()[token_index].unsqueeze(0),
        position_ids=positions.flatten()[token_index].unsqueeze(0),
        row_lengths=row_lengths,
        cu_seqlens=cu_seqlens,
        token_index=token_index,
        shape=(n, length),
        max_length=int(row_lengths.max()) if n else 0,
    )


def token_budget_chunks(row_tokens: torch.Tensor, token_budget: int | None) -> list[torch.Tensor]:
    """Rows cut into chunks for packed forwards, each of at most ``token_budget`` real tokens (a row
    over the budget alone): packed, a chunk costs its real tokens ``row_tokens [n]``, whatever the
    rows' lengths, so the rows go longest first into as few chunks as a greedy fill gives (one
    without a budget). Returns row indices ``[n_chunk]`` per chunk, together a permutation of the rows."""
    order = torch.argsort(row_tokens, descending=True, stable=True)
    if token_budget is None:
        return [order]
    chunks, current, filled = [], [], 0
    for row, tokens in zip(order.tolist(), row_tokens[order].tolist()):
        if current and filled + tokens > token_budget:
            chunks.append(current)
            current, filled = [], 0
        current.append(row)
        filled += tokens
    chunks.append(current)
    return [torch.tensor(chunk, dtype=torch.long, device=row_tokens.device) for chunk in chunks]
