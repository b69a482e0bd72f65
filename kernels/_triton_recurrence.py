"""Triton kernels for the chunk-to-chunk state recurrence (see ``_recurrence.py``).

One program owns one sequence, one head and ``BV`` value columns of the ``[K, V]`` state,
keeps that slice of the state in registers and walks the sequence's chunks in order
(backward: in reverse). Value columns never interact in this recurrence, so the split over
``V`` needs no communication. Dots run as ``tf32x3`` (three tensor-core passes, float32
accuracy: the state is carried over many chunks and plain tf32's 1e-3 error would
accumulate). On the H100 (Triton 3.6), per ``benchmarks/gdn_profile.py``: about 10x faster
than ``ieee`` and about 10% slower than plain ``tf32``; ``BV = 32`` with 4 warps and one
pipeline stage was the fastest setting for 16 x 32 chunks (deeper pipelining of the
``[C, K]`` float32 tiles asks for more shared memory than a program may hold). ``tf32x3``
with ``BV = 16`` and 8 warps made an illegal memory access there, twice: rerun that script
(it checks every setting against the torch loop) before changing these constants.

Imported only when that path is taken, so CPU-only installs never import Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_V", "DOT_PRECISION", "NUM_STAGES", "NUM_WARPS", "backward", "forward"]

DOT_PRECISION = "tf32x3"
BLOCK_V = 32
NUM_WARPS = 4
NUM_STAGES = 1


@triton.jit
def _program_tiles(offsets, H: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """This program's head, chunk range, state row (int64) and tile offsets in [K, V], [C, K], [C, V]."""
    # Value blocks of one (sequence, head) are adjacent programs: they read the same w and kd
    # tiles, which then come from L2 instead of memory.
    pid = tl.program_id(0)
    i_v = pid % (V // BV)
    i_h = (pid // (V // BV)) % H
    i_s = pid // ((V // BV) * H)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    kv = o_k[:, None] * V + o_v[None, :]
    ck = o_c[:, None] * K + o_k[None, :]
    cv = o_c[:, None] * V + o_v[None, :]
    first = tl.load(offsets + i_s)
    last = tl.load(offsets + i_s + 1)
    return i_h, first, last, (i_s * H + i_h).to(tl.int64), kv, ck, cv


@triton.jit
def _forward_kernel(
    u, w, kd, gamma, s0, d, s_start, s_final, offsets,
    H: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    i_h, first, last, seq_head, kv, ck, cv = _program_tiles(offsets, H, C, K, V, BV)
    state = tl.load(s0 + seq_head * K * V + kv)
    for c in range(first, last):
        base = c * H + i_h  # int64: the bounds are loaded from int64 offsets
        tl.store(s_start + base * K * V + kv, state)
        delta = tl.load(u + base * C * V + cv) - tl.dot(
            tl.load(w + base * C * K + ck), state, input_precision=PRECISION
        )
        tl.store(d + base * C * V + cv, delta)
        decayed_k = tl.load(kd + base * C * K + ck)
        state = tl.load(gamma + base) * state + tl.dot(tl.trans(decayed_k), delta, input_precision=PRECISION)
    tl.store(s_final + seq_head * K * V + kv, state)


@triton.jit
def _backward_kernel(
    w, kd, gamma, dd, ds_start, ds_final, dd_total, ds_next, ds0, offsets,
    H: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    i_h, first, last, seq_head, kv, ck, cv = _program_tiles(offsets, H, C, K, V, BV)
    grad_state = tl.load(ds_final + seq_head * K * V + kv)
    for i in range(0, last - first):
        base = (last - 1 - i) * H + i_h
        tl.store(ds_next + base * K * V + kv, grad_state)
        decayed_k = tl.load(kd + base * C * K + ck)
        grad_delta = tl.load(dd + base * C * V + cv) + tl.dot(decayed_k, grad_state, input_precision=PRECISION)
        tl.store(dd_total + base * C * V + cv, grad_delta)
        w_c = tl.load(w + base * C * K + ck)
        grad_state = (
            tl.load(gamma + base) * grad_state
            - tl.dot(tl.trans(w_c), grad_delta, input_precision=PRECISION)
            + tl.load(ds_start + base * K * V + kv)
        )
    tl.store(ds0 + seq_head * K * V + kv, grad_state)


def _grid(n_seq: int, heads: int, v_dim: int) -> tuple[tuple[int], int]:
    block_v = min(BLOCK_V, v_dim)
    return (n_seq * heads * (v_dim // block_v),), block_v


def forward(
    u: torch.Tensor, w: torch.Tensor, kd: torch.Tensor, gamma: torch.Tensor, s0: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``_recurrence._loop_forward``; contiguous float32 inputs."""
    n_chunks, heads, chunk, v_dim = u.shape
    k_dim = w.shape[-1]
    d = torch.empty_like(u)
    s_start = u.new_empty(n_chunks, heads, k_dim, v_dim)
    s_final = torch.empty_like(s0)
    grid, block_v = _grid(s0.shape[0], heads, v_dim)
    _forward_kernel[grid](
        u,
        w,
        kd,
        gamma,
        s0,
        d,
        s_start,
        s_final,
        offsets,
        H=heads,
        C=chunk,
        K=k_dim,
        V=v_dim,
        BV=block_v,
        PRECISION=DOT_PRECISION,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return d, s_start, s_final


def backward(
    w: torch.Tensor,
    kd: torch.Tensor,
    gamma: torch.Tensor,
    dd: torch.Tensor,
    ds_start: torch.Tensor,
    ds_final: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``_recurrence._loop_backward``; contiguous float32 inputs."""
    _, heads, chunk, v_dim = dd.shape
    k_dim = w.shape[-1]
    dd_total = torch.empty_like(dd)
    ds_next = torch.empty_like(ds_start)
    ds0 = torch.empty_like(ds_final)
    grid, block_v = _grid(ds_final.shape[0], heads, v_dim)
    _backward_kernel[grid](
        w, kd, gamma, dd, ds_start, ds_final, dd_total, ds_next, ds0, offsets,
        H=heads, C=chunk, K=k_dim, V=v_dim, BV=block_v, PRECISION=DOT_PRECISION,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return dd_total, ds_next, ds0
