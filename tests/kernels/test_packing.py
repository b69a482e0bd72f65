"""cu_seqlens derived from packed position ids, on ragged edge cases."""

from __future__ import annotations

import pytest
import torch

from model_support.kernels.packing import cu_seqlens_from_position_ids, max_seqlen


def _pos(*lengths: int, pad: int = 0) -> torch.Tensor:
    parts = [torch.arange(n) for n in lengths] + [torch.full((pad,), -1)]
    return torch.cat(parts)


@pytest.mark.parametrize(
    ("lengths", "pad"),
    [
        ((3, 2, 4), 0),
        ((1, 1, 1), 0),  # length-1 sequences only
        ((5, 1, 64, 1), 0),  # length-1 between longer ones, one exactly one chunk long
        ((64,), 0),  # a single sequence of exactly one chunk
        ((7, 3), 6),  # padding at the end
        ((1,), 1),
    ],
)
def test_ragged_layouts(lengths: tuple[int, ...], pad: int) -> None:
    cu = cu_seqlens_from_position_ids(_pos(*lengths, pad=pad))
    expected = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert cu.dtype == torch.int32
    assert torch.equal(cu, expected)
    assert max_seqlen(cu) == max(lengths)


def test_batch_dim_and_device_kept() -> None:
    cu = cu_seqlens_from_position_ids(_pos(2, 3)[None])
    assert cu.tolist() == [0, 2, 5]
    assert cu.device == torch.device("cpu")


def test_first_token_starts_a_sequence_even_without_zero() -> None:
    # A row cut from the middle of a sequence (e.g. a context-parallel shard) starts a sequence.
    cu = cu_seqlens_from_position_ids(torch.tensor([5, 6, 7, 0, 1]))
    assert cu.tolist() == [0, 3, 5]


def test_all_padding_and_empty() -> None:
    assert cu_seqlens_from_position_ids(torch.full((4,), -1)).tolist() == [0]
    assert cu_seqlens_from_position_ids(torch.zeros(0, dtype=torch.long)).tolist() == [0]
    assert max_seqlen(torch.tensor([0], dtype=torch.int32)) == 0


@pytest.mark.parametrize(
    ("position_ids", "message"),
    [
        ([0, 1, -1, 0, 1], "only appear at the end"),
        ([0, 1, 3, 0], "must rise by one"),
        ([0, 1, 1], "must rise by one"),
    ],
)
def test_invalid_rows_are_refused(position_ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cu_seqlens_from_position_ids(torch.tensor(position_ids))


def test_wrong_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="one row"):
        cu_seqlens_from_position_ids(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        cu_seqlens_from_position_ids(torch.zeros(3))
