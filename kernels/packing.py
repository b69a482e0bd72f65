"""Sequence boundaries of packed batches, shared by the attention and Gated DeltaNet paths.

A packed batch holds several sequences back to back in one row of ``T`` tokens. Its
position ids restart at 0 where each sequence starts: ``[0 1 2 0 1 0 1 2 3]`` holds three
sequences of lengths 3, 2 and 4, so ``cu_seqlens = [0, 3, 5, 9]``.

Padding: tokens that belong to no sequence may only sit at the end of the row, and are
marked with a negative position id (``-1`` by convention). They are left out of
``cu_seqlens``: its last entry is then the number of real tokens, smaller than ``T``.
Consumers ignore tokens at and after ``cu_seqlens[-1]``
(:func:`model_support.kernels.gdn.chunk_gated_delta_rule` writes zeros there and passes
no gradient to them). Padding written with ordinary restarting position ids
(``0 1 2 ...``) is simply one more sequence; it is harmless for attention and Gated
DeltaNet, which never mix sequences, but costs its compute.
"""

from __future__ import annotations

import torch

__all__ = ["cu_seqlens_from_position_ids", "max_seqlen"]


def cu_seqlens_from_position_ids(position_ids: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """Return the int32 ``cu_seqlens`` of a packed row, on the device of ``position_ids``.

    Args:
        position_ids: shape ``[T]`` or ``[1, T]``. A sequence starts at index 0 and wherever
            the position id is 0; negative ids mark trailing padding (see the module doc).
        validate: check that padding is only at the end and that position ids rise by
            exactly one inside each sequence (one host synchronisation); raise
            ``ValueError`` otherwise.

    Returns:
        ``[N + 1]`` int32 tensor: ``cu_seqlens[i]:cu_seqlens[i + 1]`` is sequence ``i``.
    """
    if position_ids.dim() == 2:
        if position_ids.shape[0] != 1:
            raise ValueError(
                f"packed position ids have one row, got shape {tuple(position_ids.shape)}; "
                "pack the batch into [1, T] first"
            )
        position_ids = position_ids[0]
    if position_ids.dim() != 1:
        raise ValueError(f"position_ids must be [T] or [1, T], got shape {tuple(position_ids.shape)}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be an integer tensor, got {position_ids.dtype}")

    pos = position_ids.long()
    valid = pos >= 0
    n_valid = valid.sum()
    starts = pos == 0
    if pos.numel():
        starts[0] = True
    starts &= valid
    index = torch.arange(pos.numel(), device=pos.device)
    start_index = index[starts]

    if validate:
        if not bool(valid[: int(n_valid)].all()):
            raise ValueError("padding (negative position ids) may only appear at the end of the packed row")
        step_ok = starts[1:] | (pos[1:] == pos[:-1] + 1) | ~valid[1:]
        if not bool(step_ok.all()):
            bad = int(torch.nonzero(~step_ok)[0, 0]) + 1
            raise ValueError(
                f"position id {int(pos[bad])} at index {bad} follows {int(pos[bad - 1])}: inside a packed "
                "sequence position ids must rise by one, and a new sequence must start at 0"
            )

    return torch.cat([start_index, n_valid.reshape(1)]).to(torch.int32)


def max_seqlen(cu_seqlens: torch.Tensor) -> int:
    """Length of the longest sequence described by ``cu_seqlens`` (0 when there is none)."""
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
