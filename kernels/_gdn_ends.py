"""The elementwise ends of fla-hybrid's Gated DeltaNet step, one launch each.

fla composes the forward's start from three kernels (the l2norm of q, of k, and the chunk-local cumulative
decay) and the backward's end from three more and two torch additions (``dk`` of the score and WY paths,
``dg`` likewise; the reverse chunk-local cumsum; the l2norm backward of q and of k). Each of them is a few
microseconds of GPU work, but each launch costs the host far more than that, and a shared-prefix step's host
time is what bounds it (docs/benchmarks.md). Here each end is one kernel over (chunk, value head) programs,
computing what fla's kernels compute: the same cumsum over the same 64-token chunk and the same l2norm
formulas. The backward's per-value-head sums (``HV > H``) are taken in float32 before the l2norm backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_support.kernels._fla_launch import TunedKernel
from model_support.kernels._program import Launch, Ref

EPS = 1e-6  # fla's l2norm epsilon (fla.modules.l2norm)

Arg = torch.Tensor | Ref
"""A tensor, or inside a pass (:mod:`~model_support.kernels._program`) a reference to one."""


@triton.jit
def _chunk(cu_seqlens, chunk_indices, BT: tl.constexpr):
    """Rows (packed token positions, int64) of this program's chunk and which of them exist."""
    i_c = tl.program_id(0)
    i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_t = i_t * BT + tl.arange(0, BT)
    return bos + o_t, o_t < length


@triton.jit
def _l2norm_rows(x, y, rstd, offs, rows_h, mask, m_t, eps):
    b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + offs, (b_x * b_rstd[:, None]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows_h, b_rstd, mask=m_t)


@triton.jit
def _l2norm_bwd_rows(y, rstd, b_dy, dx, offs, rows_h, mask, m_t):
    b_y = tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)
    b_rstd = tl.load(rstd + rows_h, mask=m_t, other=0.0)
    b_dx = b_dy * b_rstd[:, None] - tl.sum(b_dy * b_y, 1)[:, None] * b_y * b_rstd[:, None]
    tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=mask)


@triton.jit
def _forward_start_kernel(
    q, k, g, q_out, k_out, q_rstd, k_rstd, g_out, cu_seqlens, chunk_indices, scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """One (chunk, value head): the chunk-local cumsum of g times ``scale``; with ``NORM``, for the first H
    value heads also the l2norm of that key head's q and k rows."""
    i_hv = tl.program_id(1)
    rows, m_t = _chunk(cu_seqlens, chunk_indices, BT)
    b_g = tl.load(g + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    tl.store(g_out + rows * HV + i_hv, tl.cumsum(b_g, axis=0) * scale, mask=m_t)
    if NORM:  # noqa: SIM102 - a compile-time branch: without it q_out and the rstds are None
        if i_hv < H:
            o_k = tl.arange(0, BK)
            mask = m_t[:, None] & (o_k < K)[None, :]
            offs = rows[:, None] * (H * K) + i_hv * K + o_k[None, :]
            _l2norm_rows(q, q_out, q_rstd, offs, rows * H + i_hv, mask, m_t, eps)
            _l2norm_rows(k, k_out, k_rstd, offs, rows * H + i_hv, mask, m_t, eps)


@triton.jit
def _backward_end_kernel(
    dq, dk, dk_wy, dg, dg_wy, q, k, q_rstd, k_rstd, dq_out, dk_out, dg_out, cu_seqlens, chunk_indices,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """One (chunk, value head): the reverse chunk-local cumsum of ``dg + dg_wy``; for the first H value heads
    also that key head's ``dq`` and ``dk + dk_wy``, summed over its value heads and (``NORM``) taken back
    through the l2norm."""
    i_h = tl.program_id(1)
    rows, m_t = _chunk(cu_seqlens, chunk_indices, BT)
    gate = rows * HV + i_h
    b_dg = tl.load(dg + gate, mask=m_t, other=0.0).to(tl.float32)
    b_dg += tl.load(dg_wy + gate, mask=m_t, other=0.0).to(tl.float32)
    tl.store(dg_out + gate, tl.cumsum(b_dg, axis=0, reverse=True).to(dg_out.dtype.element_ty), mask=m_t)
    if i_h < H:
        o_k = tl.arange(0, BK)
        mask = m_t[:, None] & (o_k < K)[None, :]
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        for j in range(HV // H):
            offs_v = rows[:, None] * (HV * K) + (i_h * (HV // H) + j) * K + o_k[None, :]
            b_dq += tl.load(dq + offs_v, mask=mask, other=0.0).to(tl.float32)
            b_dk += tl.load(dk + offs_v, mask=mask, other=0.0).to(tl.float32)
            b_dk += tl.load(dk_wy + offs_v, mask=mask, other=0.0).to(tl.float32)
        offs = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        if NORM:
            _l2norm_bwd_rows(q, q_rstd, b_dq, dq_out, offs, rows * H + i_h, mask, m_t)
            _l2norm_bwd_rows(k, k_rstd, b_dk, dk_out, offs, rows * H + i_h, mask, m_t)
        else:
            tl.store(dq_out + offs, b_dq.to(dq_out.dtype.element_ty), mask=mask)
            tl.store(dk_out + offs, b_dk.to(dk_out.dtype.element_ty), mask=mask)


_FORWARD_START = TunedKernel(_forward_start_kernel)
_BACKWARD_END = TunedKernel(_backward_end_kernel)


def _block(k_dim: int) -> int:
    return max(16, triton.next_power_of_2(k_dim))


def forward_start(
    q: Arg,
    k: Arg,
    g: Arg,
    q_out: Arg | None,
    k_out: Arg | None,
    q_rstd: Arg | None,
    k_rstd: Arg | None,
    g_out: Arg,
    scale: float,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    *,
    heads: int,
    v_heads: int,
    k_dim: int,
) -> Launch:
    """The launch writing ``g_out``, g's chunk-local cumsum times ``scale`` (float32 ``[1, T, HV]``), and unless
    ``q_out`` is None q and k l2-normalised (``q_out``, ``k_out`` in their dtype, ``q_rstd``, ``k_rstd`` float32
    ``[1, T, H]``). Packed ``[1, T, ...]`` input, 64-token chunks listed by fla's ``chunk_indices``."""
    return Launch(
        _FORWARD_START, (chunk_indices.shape[0], v_heads), dict(
            q=q, k=k, g=g, q_out=q_out, k_out=k_out, q_rstd=q_rstd, k_rstd=k_rstd, g_out=g_out, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, scale=scale, eps=EPS, H=heads, HV=v_heads, K=k_dim, BT=64, BK=_block(k_dim),
            NORM=q_out is not None,
        ),
    )  # fmt: skip


def backward_end(
    dq: Arg,
    dk: Arg,
    dk_wy: Arg,
    dg: Arg,
    dg_wy: Arg,
    q: Arg,
    k: Arg,
    q_rstd: Arg | None,
    k_rstd: Arg | None,
    dq_out: Arg,
    dk_out: Arg,
    dg_out: Arg,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    *,
    heads: int,
    v_heads: int,
    k_dim: int,
) -> Launch:
    """The launch writing the gradients of :func:`forward_start`'s inputs: ``dq_out``, ``dk_out`` (``[1, T, H, K]``)
    from the per-value-head ``dq``, ``dk`` and ``dk_wy`` ``[1, T, HV, K]``, and ``dg_out`` from the float32
    ``dg + dg_wy``. ``q``, ``k`` are :func:`forward_start`'s outputs; ``q_rstd`` None: no l2norm."""
    return Launch(
        _BACKWARD_END, (chunk_indices.shape[0], v_heads), dict(
            dq=dq, dk=dk, dk_wy=dk_wy, dg=dg, dg_wy=dg_wy, q=q, k=k, q_rstd=q_rstd, k_rstd=k_rstd, dq_out=dq_out,
            dk_out=dk_out, dg_out=dg_out, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, H=heads, HV=v_heads,
            K=k_dim, BT=64, BK=_block(k_dim), NORM=q_rstd is not None,
        ),
    )  # fmt: skip
