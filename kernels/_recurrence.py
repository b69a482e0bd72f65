"""The sequential part of the chunked Gated DeltaNet: the state carried from chunk to chunk.

Everything inside a chunk is computed in parallel (see ``gdn.py``); what remains is, for
each sequence and chunk ``c`` in order, with ``S_c`` the state entering the chunk::

    D_c     = u_c - w_c S_c                      # the chunk's delta rows  [C, V]
    S_{c+1} = gamma_c S_c + kd_c^T D_c           # gamma_c: the chunk's total decay

This module runs that loop forward and backward (the backward is written out by hand, so
autograd records one node instead of four per chunk), either as a torch loop over chunk
index (all sequences of the batch advance together) or through the Triton kernels of
``_triton_recurrence`` (one program per sequence, head and block of value columns).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

__all__ = ["ChunkSchedule", "state_recurrence", "to_device"]


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device`` without stalling the host: a plain copy from pageable memory
    waits for the GPU's queue to drain, one from pinned memory does not."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class ChunkSchedule:
    """Where each sequence's chunks sit in the flat chunk list.

    ``offsets`` (device, int64 ``[S + 1]``): chunks ``offsets[s]:offsets[s + 1]`` belong to
    sequence ``s``; ``counts`` holds the same on the host. ``steps`` is built on first use.
    """

    offsets: torch.Tensor
    counts: tuple[int, ...]

    @classmethod
    def build(cls, chunk_counts: list[int], device: torch.device) -> ChunkSchedule:
        starts = [0, *itertools.accumulate(chunk_counts)]
        return cls(offsets=to_device(starts, device), counts=tuple(chunk_counts))

    @functools.cached_property
    def steps(self) -> tuple[tuple[torch.Tensor | None, torch.Tensor], ...]:
        """For the torch loop: per chunk index ``j``, the sequences that have a ``j``-th chunk
        (``None`` when all do) and the flat indices of those chunks."""
        device = self.offsets.device
        starts = [0, *itertools.accumulate(self.counts)]
        steps = []
        for j in range(max(self.counts, default=0)):
            active = [s for s, n in enumerate(self.counts) if n > j]
            chunks = to_device([starts[s] + j for s in active], device)
            steps.append((None if len(active) == len(self.counts) else to_device(active, device), chunks))
        return tuple(steps)


def _gather(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x[index]


def _put(x: torch.Tensor, index: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if index is None:
        return value
    x[index] = value
    return x


def _loop_forward(
    u: torch.Tensor,
    w: torch.Tensor,
    kd: torch.Tensor,
    gamma: torch.Tensor,
    s0: torch.Tensor,
    schedule: ChunkSchedule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state = s0.clone()
    d = torch.empty_like(u)
    s_start = u.new_empty(u.shape[0], u.shape[1], w.shape[-1], u.shape[-1])
    for active, chunks in schedule.steps:
        s = _gather(state, active)
        s_start[chunks] = s
        dc = u[chunks] - w[chunks] @ s
        d[chunks] = dc
        state = _put(state, active, gamma[chunks][..., None, None] * s + kd[chunks].transpose(-1, -2) @ dc)
    return d, s_start, state


def _loop_backward(
    w: torch.Tensor,
    kd: torch.Tensor,
    gamma: torch.Tensor,
    dd: torch.Tensor,
    ds_start: torch.Tensor,
    ds_final: torch.Tensor,
    schedule: ChunkSchedule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ds = ds_final.clone()
    dd_total = torch.empty_like(dd)
    ds_next = torch.empty_like(ds_start)
    for active, chunks in reversed(schedule.steps):
        dsn = _gather(ds, active)
        ds_next[chunks] = dsn
        ddt = dd[chunks] + kd[chunks] @ dsn
        dd_total[chunks] = ddt
        ds_prev = gamma[chunks][..., None, None] * dsn - w[chunks].transpose(-1, -2) @ ddt + ds_start[chunks]
        ds = _put(ds, active, ds_prev)
    return dd_total, ds_next, ds


def _triton_supported(u: torch.Tensor, w: torch.Tensor) -> bool:
    def ok(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return u.is_cuda and u.dtype == torch.float32 and ok(w.shape[-1]) and ok(u.shape[-1]) and ok(u.shape[-2])


class _StateRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, w, kd, gamma, s0, schedule, use_triton):  # type: ignore[override]
        use_triton = use_triton and _triton_supported(u, w)
        if use_triton:
            from model_support.kernels._triton_recurrence import forward as triton_forward

            d, s_start, s_final = triton_forward(u, w, kd, gamma, s0, schedule.offsets)
        else:
            d, s_start, s_final = _loop_forward(u, w, kd, gamma, s0, schedule)
        ctx.save_for_backward(w, kd, gamma, d, s_start)
        ctx.schedule = schedule
        ctx.use_triton = use_triton
        return d, s_start, s_final

    @staticmethod
    def backward(ctx, dd, ds_start, ds_final):  # type: ignore[override]
        w, kd, gamma, d, s_start = ctx.saved_tensors
        dd = torch.zeros_like(d) if dd is None else dd.contiguous()
        ds_start = torch.zeros_like(s_start) if ds_start is None else ds_start.contiguous()
        n_seq = ctx.schedule.offsets.numel() - 1
        if ds_final is None:
            ds_final = s_start.new_zeros(n_seq, *s_start.shape[1:])
        if ctx.use_triton:
            from model_support.kernels._triton_recurrence import backward as triton_backward

            dd_total, ds_next, ds0 = triton_backward(
                w, kd, gamma, dd, ds_start, ds_final.contiguous(), ctx.schedule.offsets
            )
        else:
            dd_total, ds_next, ds0 = _loop_backward(w, kd, gamma, dd, ds_start, ds_final, ctx.schedule)
        # The rest needs no order: batched over all chunks at once.
        dw = -(dd_total @ s_start.transpose(-1, -2))
        dkd = d @ ds_next.transpose(-1, -2)
        dgamma = torch.einsum("nhkv,nhkv->nh", s_start, ds_next)
        return dd_total, dw, dkd, dgamma, ds0, None, None


def state_recurrence(
    u: torch.Tensor,
    w: torch.Tensor,
    kd: torch.Tensor,
    gamma: torch.Tensor,
    s0: torch.Tensor,
    schedule: ChunkSchedule,
    *,
    use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the chunk-to-chunk recurrence, differentiably.

    Shapes: ``u [Nc, H, C, V]``, ``w`` and ``kd [Nc, H, C, K]``, ``gamma [Nc, H]``,
    ``s0 [S, H, K, V]``. Returns ``D [Nc, H, C, V]``, the state entering each chunk
    ``[Nc, H, K, V]`` and each sequence's final state ``[S, H, K, V]``. ``use_triton``
    takes the Triton kernels where they apply (CUDA, float32, power-of-two sizes >= 16) and
    the torch loop elsewhere; both compute the same function.
    """
    return _StateRecurrence.apply(
        u.contiguous(), w.contiguous(), kd.contiguous(), gamma.contiguous(), s0.contiguous(), schedule, use_triton
    )
