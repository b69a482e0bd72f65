"""fla's Gated DeltaNet kernels with our own ``chunk_bwd_dqkwg`` (backend ``fla-hybrid``).

fla 0.6.0 refuses its gated ``chunk_bwd_dqkwg`` on Hopper with Triton in [3.4.0, 3.7.1): that
compiler mis-lowers a ``tl.dot`` whose operand is the transpose of another ``tl.dot``'s result
(fla issue #640). Every other kernel of fla's forward and backward is unaffected. This module runs
fla's forward and backward as fla composes them, with that one kernel replaced by
:func:`_dqkwg_kernel`, which computes the transposed score block with its own dot from loaded
operands instead of transposing an accumulator, and the elementwise kernels at either end (l2norm,
chunk-local cumsum) fused into one launch each (:mod:`~model_support.kernels._gdn_ends`).

The composition follows fla 0.6.x (``fla.ops.gated_delta_rule.chunk``); :mod:`backend` only picks
this backend for those versions, and the GPU benchmark checks it against the float64 recurrence.
fla's host functions are not called: each is reduced here to its allocations and one launch of its
kernel through :class:`~model_support.kernels._fla_launch.TunedKernel`, which skips fla's backend
dispatch, input guards and autotuner wrappers once a kernel is tuned (the host's cost of a step, not
its GPU work, is what bounds a shared-prefix step; docs/benchmarks.md).
fla keeps the cumulative decay in log2 units (``exp2``); the kernel below uses the same convention
so its ``dg`` is what fla's own kernel returns.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from model_support.kernels._fla_launch import TunedKernel
from model_support.kernels._gdn_ends import backward_end, forward_start
from model_support.kernels._memo import while_alive

CHUNK = 64
NUM_WARPS = 8
NUM_STAGES = 2
# Launch settings (value block, warps, pipeline stages) of fla's state recurrence kernels wherever a
# shared prompt's chunks set the pace; None keeps fla's autotuned choice. fla tunes one setting per
# head shape, for many sequences at once. A prompt is one sequence: with 16 heads and fla's value
# blocks of 32 or 64, 32 to 64 programs leave most of an H100 idle while its chunks run one after
# another. Value blocks of 16 (more programs, each with a shorter step) and a 3-stage load pipeline
# ran the shared-prefix step fastest of the settings tried (docs/benchmarks.md;
# ``python -m benchmarks.gdn_profile --prompt-phase``).
PROMPT_PHASE_CONFIG: tuple[int, int, int] | None = (16, 4, 3)


@triton.jit(do_not_specialize=["T"])
def _dqkwg_kernel(
    q, k, v, g, h, do, dh, dq, dk, dw, dv, dg,
    cu_seqlens, chunk_indices, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One (chunk, value head): dq, dk, dw and dg of fla's ``chunk_bwd_dqkwg`` (B = 1, varlen)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    i_h = i_hv // (HV // H)

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < length
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    rows = (bos + o_t).to(tl.int64)
    state = (i_c.to(tl.int64) * HV + i_hv) * K * V

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)  # ds[i, j] = do_i . v_j
    b_dst = tl.zeros([BT, BT], dtype=tl.float32)  # its transpose, from its own dot (never tl.trans of a dot)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        tv = rows[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_v = tl.load(v + tv, mask=m_tv, other=0.0)
        b_do = tl.load(do + tv, mask=m_tv, other=0.0)
        b_dv = tl.load(dv + tv, mask=m_tv, other=0.0)
        # h is [K, V] row-major; load it as [BV, BK].
        kv = state + o_k[None, :] * V + o_v[:, None]
        m_kv = m_k[None, :] & m_v[:, None]
        b_h = tl.load(h + kv, mask=m_kv, other=0.0)
        b_dh = tl.load(dh + kv, mask=m_kv, other=0.0)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)
        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
        b_dst = tl.dot(b_v, tl.trans(b_do), b_dst)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
        b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk)
        b_dw = tl.dot(b_dv.to(b_v.dtype), b_h.to(b_v.dtype), b_dw)

    m_tk = m_t[:, None] & m_k[None, :]
    tk = rows[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    tl.store(dw + tk, -b_dw.to(dw.dtype.element_ty), mask=m_tk)

    qk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_q = tl.load(q + qk, mask=m_tk, other=0.0)
    b_k = tl.load(k + qk, mask=m_tk, other=0.0)
    last = tl.minimum(i_t * BT + BT, length) - 1
    b_g = tl.load(g + rows * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_g_last = tl.load(g + (bos + last) * HV + i_hv).to(tl.float32)

    b_dg_last = tl.sum(b_hdh) * tl.math.exp2(b_g_last)
    b_dq = b_dq * tl.math.exp2(b_g)[:, None] * scale
    b_dk = b_dk * tl.where(m_t, tl.math.exp2(b_g_last - b_g), 0.0)[:, None]
    b_dg_last += tl.sum(b_dk * b_k.to(tl.float32))

    o_i = tl.arange(0, BT)
    valid = m_t[:, None] & m_t[None, :]
    # lower[i, j] (i >= j): ds[i, j] * exp2(g_i - g_j); upper[j, i] is the same entry, transposed.
    lower = (o_i[:, None] >= o_i[None, :]) & valid
    upper = (o_i[:, None] <= o_i[None, :]) & valid
    b_ds = tl.where(lower, b_ds * tl.math.exp2(b_g[:, None] - b_g[None, :]), 0.0) * scale
    b_dst = tl.where(upper, b_dst * tl.math.exp2(b_g[None, :] - b_g[:, None]), 0.0) * scale
    b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
    b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk)

    b_dgv = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
    b_dgv = tl.where(o_t == last, b_dgv + b_dg_last, b_dgv)
    tv_hv = rows * HV + i_hv
    tl.store(dq + tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + tv_hv, b_dgv, mask=m_t)


_DQKWG = TunedKernel(_dqkwg_kernel)


def chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    dv: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same inputs and outputs as fla 0.6's gated ``chunk_bwd_dqkwg`` (packed ``B = 1``, varlen), but ``dq`` and
    ``dk`` per value head ``[1, T, HV, K]`` (:func:`~model_support.kernels._gdn_ends.backward_end` sums them)."""
    _, total, heads, k_dim = k.shape
    v_heads, v_dim = v.shape[2], v.shape[-1]
    if k_dim > 256:
        raise ValueError(f"fla-hybrid supports key head size up to 256, got {k_dim}")
    dq = q.new_empty(1, total, v_heads, k_dim)
    dk = k.new_empty(1, total, v_heads, k_dim)
    dw = torch.empty_like(w)
    dg = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    block_k = max(16, triton.next_power_of_2(k_dim))
    block_v = _tile(v_dim, 64)
    _DQKWG(
        (chunk_indices.shape[0], v_heads), {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES},
        q=q, k=k, v=v, g=g, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=total, H=heads, HV=v_heads, K=k_dim, V=v_dim, BT=CHUNK,
        BK=block_k, BV=block_v,
    )  # fmt: skip
    return dq, dk, dw, dg


@functools.cache
def _fla() -> SimpleNamespace:
    """fla's kernels as :class:`TunedKernel` (fla is imported on first use: it is optional) and the block
    sizes fla's host functions derive from the GPU's shared memory."""
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64,
        chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
    )
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dv_local, chunk_fwd_kernel_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd_kernel, recompute_w_u_fwd_kernel
    from fla.ops.utils.constant import RCP_LN2
    from fla.utils import check_shared_mem

    return SimpleNamespace(
        kkt_solve=TunedKernel(chunk_gated_delta_rule_fwd_kkt_solve_kernel),
        w_u=TunedKernel(recompute_w_u_fwd_kernel),
        fwd_h=TunedKernel(chunk_gated_delta_rule_fwd_kernel_h_blockdim64),
        fwd_o=TunedKernel(chunk_fwd_kernel_o),
        dv_local=TunedKernel(chunk_bwd_kernel_dv_local),
        bwd_dhu=TunedKernel(chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64),
        wy_bwd=TunedKernel(prepare_wy_repr_bwd_kernel),
        rcp_ln2=RCP_LN2,
        # As fla 0.6's chunk_bwd_dv_local and prepare_wy_repr_bwd choose their tiles (device 0, as fla).
        dv_local_tile=128 if check_shared_mem("hopper") else 64 if check_shared_mem("ada") else 32,
        wy_bwd_tile=64 if check_shared_mem() else 32,
    )


class _Phase(NamedTuple):
    """Sequences whose state recurrence runs in one launch: their ``cu_seqlens`` and chunk offsets.

    Both are slices of the whole input's, so token and chunk positions stay absolute: every phase
    reads and writes the same full-size tensors, and no phase's inputs or outputs are copied.
    """

    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    prompt_paced: bool = False
    """A shared prompt's chunks set this launch's pace: it runs with :data:`PROMPT_PHASE_CONFIG`."""


class _Index(NamedTuple):
    """Everything derived from one ``cu_seqlens``: fla's chunk indices and how the state recurrence runs:
    ``phases`` one after another (forward; reversed in the backward), or every sequence ``together`` in one
    launch once all initial states are known (the backward's recomputation of the forward's states)."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    phases: tuple[_Phase, ...]
    together: _Phase

    @property
    def n_chunks(self) -> int:
        return self.chunk_indices.shape[0]


@while_alive
def _index(cu: torch.Tensor, shared_prompt: bool) -> _Index:
    """All sequences in one phase, or (prompt, completions) for a shared prompt.

    With ``shared_prompt``, sequence 0 of ``cu`` is the prompt and the others are its completions; the
    completions start from the prompt's final state, so in the forward their recurrence runs after the
    prompt's. Built once per ``cu`` tensor: the chunk count is read on the host here, once per step.
    """
    chunk_counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    offsets = torch.cat([cu.new_zeros(1), chunk_counts.cumsum(0)])
    # fla's prepare_chunk_indices' [sequence, chunk within it] pairs, from the offsets already at hand.
    sequence = torch.repeat_interleave(torch.arange(len(chunk_counts), device=cu.device), chunk_counts)
    within = torch.arange(len(sequence), device=cu.device) - offsets[sequence]
    chunk_indices = torch.stack([sequence, within], 1).to(cu)
    if not shared_prompt:
        whole = _Phase(cu, offsets)
        return _Index(cu, chunk_indices, (whole,), whole)
    # The prompt's chunks set the pace whenever it runs, alone or beside its completions.
    prompt = _Phase(cu[:2], offsets[:2], prompt_paced=True)
    together = _Phase(cu, offsets, prompt_paced=True)
    return _Index(cu, chunk_indices, (prompt, _Phase(cu[1:], offsets[1:])), together)


# fla 0.6's host functions, each reduced to its allocations and its launch (fla.ops.gated_delta_rule.chunk_fwd
# and wy_fast, fla.ops.common.chunk_o), for packed B = 1 input with 64-token chunks on a GPU where the fused
# kkt + solve kernel runs. fla's l2norm and chunk-local cumsum launches are fused in _gdn_ends.


def _kkt_solve(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, index: _Index) -> torch.Tensor:
    """``(I + A)^-1`` of every chunk (fla's fused kkt + solve_tril), ``[1, T, HV, 64]``."""
    _, total, heads, k_dim = k.shape
    v_heads = beta.shape[2]
    a = torch.zeros(1, total, v_heads, CHUNK, device=k.device, dtype=k.dtype)
    _fla().kkt_solve(
        (index.n_chunks, v_heads), k=k, g=g, beta=beta, A=a, cu_seqlens=index.cu_seqlens,
        chunk_indices=index.chunk_indices, T=total, H=heads, HV=v_heads, K=k_dim, BT=CHUNK, BC=16,
    )  # fmt: skip
    return a


def _recompute_w_u(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, g: torch.Tensor, index: _Index
) -> tuple[torch.Tensor, torch.Tensor]:
    _, total, heads, k_dim = k.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    w, u = k.new_empty(1, total, v_heads, k_dim), torch.empty_like(v)
    _fla().w_u(
        (index.n_chunks, v_heads), k=k, v=v, beta=beta, w=w, u=u, A=a, g=g, cu_seqlens=index.cu_seqlens,
        chunk_indices=index.chunk_indices, T=total, H=heads, HV=v_heads, K=k_dim, V=v_dim, BT=CHUNK, BK=64, BV=64,
    )  # fmt: skip
    return w, u


def _fwd_o(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor, g: torch.Tensor, scale: float, index: _Index
) -> torch.Tensor:
    _, total, heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    n_chunks = index.n_chunks
    grid = lambda meta: (triton.cdiv(v_dim, meta["BV"]) * n_chunks, v_heads)  # noqa: E731
    _fla().fwd_o(
        grid, q=q, k=k, v=v, h=h, g=g, g_gamma=None, o=o, cu_seqlens=index.cu_seqlens,
        chunk_indices=index.chunk_indices, scale=scale, T=total, H=heads, HV=v_heads, K=k_dim, V=v_dim, BT=CHUNK,
        STATE_V_FIRST=False,
    )  # fmt: skip
    return o


def _tile(dim: int, limit: int) -> int:
    """A block size covering ``dim`` (a power of two, at least 16, at most ``limit``), as fla's host functions."""
    return min(max(triton.next_power_of_2(dim), 16), limit)


def _dv_local(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, do: torch.Tensor, scale: float, index: _Index
) -> torch.Tensor:
    _, total, heads, k_dim = k.shape
    v_heads, v_dim = do.shape[2], do.shape[3]
    tile = _fla().dv_local_tile
    dv = torch.empty_like(do)
    _fla().dv_local(
        (index.n_chunks, v_heads), q=q, k=k, g=g, g_gamma=None, A=None, do=do, dv=dv, cu_seqlens=index.cu_seqlens,
        chunk_indices=index.chunk_indices, scale=scale, T=total, H=heads, HV=v_heads, K=k_dim, V=v_dim, BT=CHUNK,
        BK=_tile(k_dim, tile), BV=_tile(v_dim, tile),
    )  # fmt: skip
    return dv


def _wy_bwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    a: torch.Tensor,
    dw: torch.Tensor,
    du: torch.Tensor,
    index: _Index,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of k (per value head), v, beta and g through the WY representation."""
    _, total, heads, k_dim = k.shape
    v_heads, v_dim = v.shape[2], v.shape[3]
    tile = _fla().wy_bwd_tile
    dk, dv = k.new_empty(1, total, v_heads, k_dim), torch.empty_like(v)
    dg, db = torch.empty_like(g), torch.empty_like(beta)
    _fla().wy_bwd(
        (index.n_chunks, v_heads), k=k, v=v, beta=beta, g=g, A=a, dw=dw, du=du, dk=dk, dv=dv, db=db, dg=dg,
        cu_seqlens=index.cu_seqlens, chunk_indices=index.chunk_indices, T=total, H=heads, HV=v_heads, K=k_dim,
        V=v_dim, BT=CHUNK, BK=_tile(k_dim, tile), BV=_tile(v_dim, tile),
    )  # fmt: skip
    return dk, dv, db, dg


def _launch(kernel: TunedKernel, phase: _Phase, v_heads: int, v_dim: int, **args: Any) -> None:
    """Launch one of fla's state recurrence kernels over ``phase``'s sequences (one program per sequence,
    value head and value block), with :data:`PROMPT_PHASE_CONFIG` where a prompt sets the pace (Triton refuses
    a setting that needs more shared memory than the GPU has, as float32 inputs may, and the tuned one runs)."""
    n_seq = phase.cu_seqlens.numel() - 1
    args.update(cu_seqlens=phase.cu_seqlens, chunk_offsets=phase.chunk_offsets, BT=CHUNK, STATE_V_FIRST=False)
    setting = None
    if phase.prompt_paced and PROMPT_PHASE_CONFIG is not None:
        block_v, warps, stages = PROMPT_PHASE_CONFIG
        setting = {"BV": block_v, "num_warps": warps, "num_stages": stages}
    kernel(lambda meta: (triton.cdiv(v_dim, meta["BV"]) * n_seq * v_heads,), setting, **args)


def _initial_states(h0: torch.Tensor | None, k: torch.Tensor, u: torch.Tensor, index: _Index) -> torch.Tensor | None:
    """The initial state of every sequence: ``h0``, or for a shared prompt ``[prompt's h0 (zeros if none),
    then one row per completion]``, the completions' rows filled in by :func:`_fwd_h`."""
    if len(index.phases) == 1:
        return h0
    shape = (index.together.cu_seqlens.numel() - 1, u.shape[2], k.shape[-1], u.shape[-1])
    if h0 is None:
        return k.new_zeros(shape, dtype=torch.float32)
    states = k.new_empty(shape, dtype=torch.float32)
    states[0] = h0[0]
    return states


def _fwd_h(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    starts: torch.Tensor | None,
    output_final_state: bool,
    phases: tuple[_Phase, ...],
    n_chunks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fla's forward state recurrence (``chunk_gated_delta_rule_fwd_h``'s kernel), one launch per phase.

    ``starts``: every sequence's initial state (:func:`_initial_states`). With two phases (prompt, then
    completions), the prompt's final state is written into the completions' rows of ``starts`` before
    they run. Returns per-chunk states, ``v_new`` and the final states of the last phase's sequences.
    """
    _, total, heads, k_dim = k.shape
    v_heads, v_dim = u.shape[2], u.shape[3]
    h = k.new_empty(1, n_chunks, v_heads, k_dim, v_dim)
    v_new = torch.empty_like(u)
    args = {"k": k, "v": u, "w": w, "v_new": v_new, "g": g, "gk": None, "h": h, "T": total}
    args.update(H=heads, HV=v_heads, K=k_dim, V=v_dim)
    kernel = _fla().fwd_h
    if len(phases) == 2:
        prompt_final = k.new_empty(1, v_heads, k_dim, v_dim, dtype=torch.float32)
        _launch(kernel, phases[0], v_heads, v_dim, h0=starts[:1], ht=prompt_final, **args)
        starts[1:] = prompt_final
        starts = starts[1:]
    n_seq = phases[-1].cu_seqlens.numel() - 1
    final = k.new_empty(n_seq, v_heads, k_dim, v_dim, dtype=torch.float32) if output_final_state else None
    _launch(kernel, phases[-1], v_heads, v_dim, h0=starts, ht=final, **args)
    return h, v_new, final


def _bwd_dhu(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    starts: torch.Tensor | None,
    want_dh0: bool,
    dht: torch.Tensor | None,
    do: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    phases: tuple[_Phase, ...],
    n_chunks: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fla's backward state recurrence (``chunk_gated_delta_rule_bwd_dhu``'s kernel), phases last first:
    the completions' initial-state gradients, summed, are the gradient of the prompt's final state.
    Returns the per-chunk state gradients, the initial-state gradient (when ``want_dh0``) and ``dv``."""
    _, total, heads, k_dim = q.shape
    v_heads, v_dim = do.shape[2], do.shape[3]
    dh = q.new_empty(1, n_chunks, v_heads, k_dim, v_dim)
    dv2 = torch.empty_like(dv)
    args = {"q": q, "k": k, "w": w, "g": g, "gk": None, "do": do, "dh": dh, "dv": dv, "dv2": dv2, "scale": scale}
    args.update(T=total, H=heads, HV=v_heads, K=k_dim, V=v_dim)
    kernel = _fla().bwd_dhu
    if len(phases) == 2:
        d_fanned = torch.empty_like(starts[1:])
        _launch(kernel, phases[1], v_heads, v_dim, dht=dht, dh0=d_fanned, **args)
        dht = d_fanned.sum(0, keepdim=True)
    dh0 = torch.empty_like(starts[:1] if len(phases) == 2 else starts, dtype=torch.float32) if want_dh0 else None
    _launch(kernel, phases[0], v_heads, v_dim, dht=dht, dh0=dh0, **args)
    return dh, dh0, dv2


class FlaHybrid(torch.autograd.Function):
    """fla's ``chunk_gated_delta_rule`` (packed, varlen) with :func:`chunk_bwd_dqkwg` in the backward.

    With ``shared_prompt``, sequence 0 is a prompt shared by all other sequences (its completions):
    the chunk-parallel kernels run once over everything, the state recurrence in two phases.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        cu_seqlens: torch.Tensor,
        use_qk_l2norm: bool,
        shared_prompt: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.g_dtype = g.dtype  # g's gradient is written in it; the others come out in their inputs' dtypes
        # fla's kernels index with contiguous strides (fla's own Function makes every input contiguous).
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        initial_state = None if initial_state is None else initial_state.contiguous()
        index = _index(cu_seqlens, shared_prompt)
        # As fla 0.6's chunk_gated_delta_rule_fwd composes these, with the recurrence in phases.
        q, q_rstd, k, k_rstd, g = forward_start(
            q, k, g, _fla().rcp_ln2, use_qk_l2norm, index.cu_seqlens, index.chunk_indices
        )
        a = _kkt_solve(k, g, beta, index)
        w, u = _recompute_w_u(k, v, beta, a, g, index)
        starts = _initial_states(initial_state, k, u, index)
        h, v_new, final_state = _fwd_h(k, w, u, g, starts, output_final_state, index.phases, index.n_chunks)
        o = _fwd_o(q, k, v_new, h, g, scale, index)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, a, starts)
        ctx.index, ctx.scale, ctx.want_dh0 = index, scale, initial_state is not None
        return o.to(q.dtype), final_state

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dht: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, q_rstd, k, k_rstd, v, g, beta, a, starts = ctx.saved_tensors
        # Autograd may hand in expanded gradients (stride 0, e.g. from ``final_state.sum()``).
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        index = ctx.index
        # As fla 0.6's chunk_gated_delta_rule_bwd composes these, with our chunk_bwd_dqkwg. Every initial
        # state is known now, so recomputing the states takes one launch, a shared prompt's completions
        # running beside the prompt instead of after it.
        w, u = _recompute_w_u(k, v, beta, a, g, index)
        h, v_new, _ = _fwd_h(k, w, u, g, starts, False, (index.together,), index.n_chunks)
        dv = _dv_local(q, k, g, do, ctx.scale, index)
        dh, dh0, dv = _bwd_dhu(q, k, w, g, starts, ctx.want_dh0, dht, do, dv, ctx.scale, index.phases, index.n_chunks)
        cu, chunks = index.cu_seqlens, index.chunk_indices
        dq, dk, dw, dg = chunk_bwd_dqkwg(q, k, v_new, w, g, h, dv, do, dh, ctx.scale, cu, chunks)
        dk_wy, dv, db, dg_wy = _wy_bwd(k, v, beta, g, a, dw, dv, index)
        dq, dk, dg = backward_end(dq, dk, dk_wy, dg, dg_wy, q, k, q_rstd, k_rstd, ctx.g_dtype, cu, chunks)
        return dq, dk, dv, dg, db, None, dh0, None, None, None, None
