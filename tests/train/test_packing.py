"""lit_grpo.train.packing: rows packed into one sequence, values by hand."""

import torch

from lit_grpo.rollout.records import position_ids_from_mask
from lit_grpo.train.packing import pack_rows

# three rows of width 5: a left-padded prompt with a right-padded completion, a full row, a short one
INPUT_IDS = torch.tensor([[0, 11, 12, 13, 0], [21, 22, 23, 24, 25], [0, 0, 31, 0, 0]])
MASK = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])


def test_pack_rows_keeps_the_real_tokens_with_positions_restarting_per_row():
    packed = pack_rows(INPUT_IDS, MASK)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24, 25, 31]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0]]
    assert packed.row_lengths.tolist() == [3, 5, 1]
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 9] and packed.cu_seqlens.dtype == torch.int32
    assert packed.token_index.tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 12]
    assert packed.shape == (3, 5) and packed.max_length == 5 and packed.num_tokens == 9


def test_positions_are_the_padded_forwards():
    # only here: rotary embeddings are relative, so the model-level tests cannot see a constant offset per row
    packed = pack_rows(INPUT_IDS, MASK)
    assert packed.position_ids[0].tolist() == position_ids_from_mask(MASK).flatten()[packed.token_index].tolist()


def test_a_hole_in_the_mask_is_skipped_as_the_padded_forward_skips_it():
    packed = pack_rows(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 0, 1, 1]]))
    assert packed.input_ids.tolist() == [[5, 7, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2]]


def test_unpack_puts_values_back_with_zeros_at_padding_and_gradient_to_the_packed_values():
    packed = pack_rows(INPUT_IDS, MASK)
    values = torch.arange(1.0, 10.0).view(1, 9, 1).repeat(1, 1, 2).requires_grad_()  # [1, T, 2]
    padded = packed.unpack(values)  # [3, 5, 2]
    assert padded[..., 0].tolist() == [[0, 1, 2, 3, 0], [4, 5, 6, 7, 8], [0, 0, 9, 0, 0]]
    (padded * torch.arange(15.0).view(3, 5, 1)).sum().backward()
    # each packed value's gradient is its padded slot's weight (row * 5 + column), twice over the last dim
    assert values.grad[0, :, 0].tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 12]


def test_unpack_from_a_column_takes_only_those_positions():
    packed = pack_rows(INPUT_IDS, MASK)
    kept = packed.positions_from(3)  # padded columns 3 and 4
    assert kept.tolist() == [2, 6, 7]  # row 0 column 3, row 1 columns 3 and 4
    values = torch.tensor([[[10.0], [20.0], [30.0]]])  # [1, K, 1]
    assert packed.unpack(values, column=3)[..., 0].tolist() == [[10, 0], [20, 30], [0, 0]]


def test_pack_is_the_inverse_of_unpack_on_the_real_tokens():
    packed = pack_rows(INPUT_IDS, MASK)
    assert packed.pack(INPUT_IDS).tolist() == packed.input_ids.tolist()
    assert torch.equal(packed.unpack(packed.pack(INPUT_IDS * MASK)), INPUT_IDS * MASK)


def test_token_budget_chunks_fill_the_budget_with_real_tokens_longest_first():
    from lit_grpo.train.packing import token_budget_chunks

    row_tokens = torch.tensor([3, 9, 4, 12, 2, 5])
    chunks = token_budget_chunks(row_tokens, 10)
    # longest first: 12 alone (over the budget), 9, then 5 + 4 (9), then 3 + 2 (5)
    assert [chunk.tolist() for chunk in chunks] == [[3], [1], [5, 2], [0, 4]]
    assert [chunk.tolist() for chunk in token_budget_chunks(row_tokens, None)] == [[3, 1, 5, 2, 0, 4]]
