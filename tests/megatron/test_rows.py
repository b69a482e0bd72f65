"""Row layouts from position ids, and attention block by block against the dense-mask formulation."""

from __future__ import annotations

import pytest
import torch

from model_support.core.megatron.rows import RowLayout, Segment
from tests.megatron.conftest import require_megatron


def _pos(*runs: tuple[int, int]) -> torch.Tensor:
    """Position ids of consecutive runs, each (first position, length)."""
    return torch.cat([torch.arange(first, first + n) for first, n in runs])[None]


def test_plain_packed_rows_are_one_group_per_sequence():
    rows = RowLayout.from_position_ids(_pos((0, 3), (0, 2), (0, 4)))
    assert not rows.shared
    assert [g[0] for g in rows.groups] == [Segment(0, 3, 0), Segment(3, 5, 0), Segment(5, 9, 0)]
    assert rows.cu_seqlens(torch.device("cpu")).tolist() == [0, 3, 5, 9]


def test_completions_continue_their_prompt_and_the_first_is_cut_from_it():
    # prompt 4, completions 3 and 2 (the first one's positions run on from the prompt's), then a plain sequence
    rows = RowLayout.from_position_ids(_pos((0, 7), (4, 2), (0, 3)))
    assert rows.shared
    assert rows.groups == (
        (Segment(0, 4, 0), Segment(4, 7, 4), Segment(7, 9, 4)),
        (Segment(9, 12, 0),),
    )
    assert rows.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 0, 1, 2]
    assert RowLayout.shared_prefix(4, (3, 2)).groups == rows.groups[:1]


def test_trailing_padding_is_its_own_segment_and_bad_runs_are_refused():
    rows = RowLayout.from_position_ids(torch.tensor([0, 1, 2, -1, -1]))
    assert rows.groups == ((Segment(0, 3, 0),), (Segment(3, 5, 0),))
    with pytest.raises(ValueError, match="neither starts a sequence"):
        RowLayout.from_position_ids(_pos((0, 3), (5, 2)))
    with pytest.raises(ValueError, match="padding"):
        RowLayout.from_position_ids(torch.tensor([0, -1, 1]))


@pytest.mark.parametrize("window", [None, 3])
def test_attention_by_block_equals_the_dense_mask(window: int | None):
    """The block-by-block path gives what one attention call with the row's dense [S, S] mask gives."""
    require_megatron()
    from model_support.core.megatron.spec import SDPAttention

    rows = RowLayout.from_position_ids(_pos((0, 9), (5, 3), (0, 4), (0, 6), (4, 5)))
    seq, heads, dim = rows.length, 4, 8
    attention = SDPAttention.__new__(SDPAttention)  # no megatron config needed for the core attention alone
    torch.nn.Module.__init__(attention)
    attention.scale, attention.window, attention.rows, attention.softmax_offset = dim**-0.5, None, None, None
    attention.softcap = None
    q, k, v = (torch.randn(seq, 1, heads, dim, generator=torch.Generator().manual_seed(i)) for i in range(3))
    # The dense formulation: a query sees a key of its own sequence, or of its prompt, at an earlier position.
    owner = torch.empty(seq, dtype=torch.long)
    prompt_of = torch.empty(seq, dtype=torch.long)
    for g, group in enumerate(rows.groups):
        for s, segment in enumerate(group):
            owner[segment.start : segment.end] = 100 * g + s
            prompt_of[segment.start : segment.end] = 100 * g
    pos = rows.positions
    visible = (owner[:, None] == owner[None, :]) | (prompt_of[:, None] == owner[None, :])
    distance = pos[:, None] - pos[None, :]
    visible &= distance >= 0
    if window is not None:
        visible &= distance < window
    dense = attention(q, k, v, ~visible[None, None])  # the window is in the mask, by position in the sequence
    attention.rows, attention.window = rows, window
    blocked = attention(q, k, v, None)
    torch.testing.assert_close(blocked, dense, rtol=1e-5, atol=1e-6)
