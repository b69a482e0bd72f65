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
fla's host functions are not called: each is reduced here to its buffers and one launch of its kernel,
and a step's forward and backward are declared as two passes (:class:`_Step`,
:mod:`~model_support.kernels._program`) per ``cu_seqlens`` and input signature: once their kernels are
tuned and compiled, a pass allocates its workspaces and launches the compiled kernels with no fla or
Triton Python in between (the host's cost of a step, not its GPU work, is what bounds a shared-prefix
step; docs/benchmarks.md).
fla keeps the cumulative decay in log2 units (``exp2``); the kernel below uses the same convention
so its ``dg`` is what fla's own kernel returns.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from model_support.kernels._fla_launch import TunedKernel
from model_support.kernels._gdn_ends import Arg, backward_end, forward_start
from model_support.kernels._memo import while_alive
from model_support.kernels._program import Buffer, Launch, Layout, Pass, Ref

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


@triton.jit
def _states_kernel(src, dst, rows, N, BLOCK: tl.constexpr, SUM: tl.constexpr):
    """States ``[*, N]``: ``dst`` row 0 = the sum of ``src``'s ``rows`` rows in float32 (``SUM``), or each of
    ``dst``'s ``rows`` rows = ``src`` row 0 (a shared prompt's state fanned out to its completions)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    if SUM:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(rows):
            total += tl.load(src + row * N + offs, mask=mask).to(tl.float32)
        tl.store(dst + offs, total.to(dst.dtype.element_ty), mask=mask)
    else:
        state = tl.load(src + offs, mask=mask).to(dst.dtype.element_ty)
        for row in range(rows):
            tl.store(dst + row * N + offs, state, mask=mask)


_STATES = TunedKernel(_states_kernel)
_STATES_BLOCK = 1024


def _states(src: Arg, dst: Arg, rows: int, size: int, sum_rows: bool) -> Launch:
    """The launch of :func:`_states_kernel` over states of ``size`` elements (a launch of our own, not a torch
    operation, so that a fixed pass issues it without building tensor views)."""
    grid = (triton.cdiv(size, _STATES_BLOCK),)
    args = dict(src=src, dst=dst, rows=rows, N=size, BLOCK=_STATES_BLOCK, SUM=sum_rows)
    return Launch(_STATES, grid, args, {"num_warps": 4})


def _tile(dim: int, limit: int) -> int:
    """A block size covering ``dim`` (a power of two, at least 16, at most ``limit``), as fla's host functions."""
    return min(max(triton.next_power_of_2(dim), 16), limit)


def chunk_bwd_dqkwg(
    q: Arg,
    k: Arg,
    v: Arg,
    g: Arg,
    h: Arg,
    dv: Arg,
    do: Arg,
    dh: Arg,
    dq: Arg,
    dk: Arg,
    dw: Arg,
    dg: Arg,
    scale: float,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    *,
    total: int,
    heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
) -> Launch:
    """The launch of fla 0.6's gated ``chunk_bwd_dqkwg`` (packed ``B = 1``, varlen; ``v`` is the forward's
    ``v_new``, ``dv`` the state recurrence's), writing ``dw`` and float32 ``dg`` as fla does but ``dq`` and
    ``dk`` per value head ``[1, T, HV, K]`` (:func:`~model_support.kernels._gdn_ends.backward_end` sums them)."""
    return Launch(
        _DQKWG, (chunk_indices.shape[0], v_heads), dict(
            q=q, k=k, v=v, g=g, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, scale=scale, T=total, H=heads, HV=v_heads, K=k_dim, V=v_dim, BT=CHUNK,
            BK=max(16, triton.next_power_of_2(k_dim)), BV=_tile(v_dim, 64),
        ), {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES},
    )  # fmt: skip


@functools.cache
def _fla() -> SimpleNamespace:
    """fla's kernels as :class:`TunedKernel` (fla is imported on first use: it is optional) and the block
    sizes fla's host functions derive from the GPU's shared memory. Triton's cache is seeded with the shipped
    tuned settings first (:mod:`.tuning`)."""
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64,
        chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
    )
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dv_local, chunk_fwd_kernel_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd_kernel, recompute_w_u_fwd_kernel
    from fla.ops.utils.constant import RCP_LN2
    from fla.utils import check_shared_mem

    from model_support.kernels.tuning import seed_triton_cache

    seed_triton_cache()
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
    launch once all initial states are known (the backward's recomputation of the forward's states); and the
    steps declared over it (:class:`_Step`, one per signature of the inputs)."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    phases: tuple[_Phase, ...]
    together: _Phase
    steps: dict[_Signature, _Step]

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
        return _Index(cu, chunk_indices, (whole,), whole, {})
    # The prompt's chunks set the pace whenever it runs, alone or beside its completions.
    prompt = _Phase(cu[:2], offsets[:2], prompt_paced=True)
    together = _Phase(cu, offsets, prompt_paced=True)
    return _Index(cu, chunk_indices, (prompt, _Phase(cu[1:], offsets[1:])), together, {})


class _Signature(NamedTuple):
    """What a step is declared for, besides its index: the inputs' device, shapes and dtypes (the initial
    state's None without one) and the options; every launch's arguments but the tensors follow from these."""

    device: int
    total: int
    heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    dtypes: tuple[torch.dtype | None, ...]
    """q, k, v, g, beta, initial state."""
    scale: float
    l2norm: bool
    final_state: bool
    prompt_config: tuple[int, int, int] | None


class _Step:
    """fla 0.6's ``chunk_gated_delta_rule`` forward and backward (``fla.ops.gated_delta_rule.chunk``, with
    ``chunk_fwd``, ``wy_fast``, ``fla.ops.common.chunk_delta_h`` and ``chunk_o``) for packed ``B = 1`` input
    with 64-token chunks on a GPU where the fused kkt + solve kernel runs: fla's host functions reduced to
    their buffers and launches and declared as two passes (:mod:`~model_support.kernels._program`), with the
    state recurrence in phases, :func:`chunk_bwd_dqkwg` in the backward and the fused ends.

    Buffers: ``saved`` (what the backward reads: normalised q and k with their rstds, g's chunk-local cumsum,
    ``(I + A)^-1`` of each chunk and, for a shared prompt, every sequence's initial state), each pass's scratch
    (``w``, ``u``, per-chunk states ``h``, ``v_new``; the backward's gradients on their way), and a tensor of
    its own for each output.
    """

    def __init__(self, index: _Index, sig: _Signature) -> None:
        if sig.k_dim > 256:
            raise ValueError(f"fla-hybrid supports key head size up to 256, got {sig.k_dim}")
        self._index, self._sig = index, sig
        q_dtype, k_dtype, v_dtype, _, _, h0_dtype = sig.dtypes
        total, heads, v_heads, k_dim, v_dim = sig.total, sig.heads, sig.v_heads, sig.k_dim, sig.v_dim
        n_seq, n_chunks = index.cu_seqlens.numel() - 1, index.n_chunks
        self._shared = len(index.phases) == 2
        self._dims = {"T": total, "H": heads, "HV": v_heads, "K": k_dim, "V": v_dim}
        self._end_dims = {"heads": heads, "v_heads": v_heads, "k_dim": k_dim}  # of the fused ends' launches
        # Shapes the buffers share: per value head and per key head token rows, one state.
        self._rows, self._key_rows, self._state = (1, total, v_heads), (1, total, heads), (v_heads, k_dim, v_dim)
        rows, key_rows, state = self._rows, self._key_rows, self._state
        self._saved = [Buffer("g_c", rows, torch.float32), Buffer("a", (*rows, CHUNK), k_dtype, zero=True)]
        if sig.l2norm:
            self._saved += [
                Buffer("q_n", (*key_rows, k_dim), q_dtype), Buffer("k_n", (*key_rows, k_dim), k_dtype),
                Buffer("q_rstd", key_rows, torch.float32), Buffer("k_rstd", key_rows, torch.float32),
            ]  # fmt: skip
        if self._shared:
            self._saved.append(Buffer("starts", (n_seq, *state), torch.float32, zero=h0_dtype is None))
        self._scratch = [
            Buffer("w", (*rows, k_dim), k_dtype), Buffer("u", (*rows, v_dim), v_dtype),
            Buffer("h", (1, n_chunks, *state), k_dtype), Buffer("v_new", (*rows, v_dim), v_dtype),
        ]  # fmt: skip
        workspaces = {"saved": self._saved, "forward": self._scratch, "o": [Buffer("o", (*rows, v_dim), v_dtype)]}
        if sig.final_state:
            workspaces["final"] = [Buffer("final", (n_seq - self._shared, *state), torch.float32)]
        self.forward = Pass(Layout(workspaces), list(workspaces), self._forward_ops())
        self._backward: dict[bool, Pass] = {}

    # Inputs and the saved buffers by name; q and k stand for their normalised copies without the l2norm.
    def _qk(self) -> tuple[Ref, Ref]:
        return (Ref("q_n"), Ref("k_n")) if self._sig.l2norm else (Ref("q"), Ref("k"))

    def _starts(self) -> Ref:
        return Ref("starts") if self._shared else Ref("h0")

    def _wy(self) -> Launch:
        """``w`` and ``u`` of every chunk (fla's ``recompute_w_u_fwd``)."""
        index, (_, k) = self._index, self._qk()
        return Launch(
            _fla().w_u, (index.n_chunks, self._sig.v_heads), dict(
                k=k, v=Ref("v"), beta=Ref("beta"), w=Ref("w"), u=Ref("u"), A=Ref("a"), g=Ref("g_c"),
                cu_seqlens=index.cu_seqlens, chunk_indices=index.chunk_indices, **self._dims, BT=CHUNK, BK=64, BV=64,
            ),
        )  # fmt: skip

    def _recurrence(self, kernel: TunedKernel, phase: _Phase, **args: Any) -> Launch:
        """One of fla's state recurrence kernels over ``phase``'s sequences (one program per sequence, value
        head and value block), with :data:`PROMPT_PHASE_CONFIG` where a prompt sets the pace (Triton refuses a
        setting that needs more shared memory than the GPU has, as float32 inputs may, and the tuned one runs)."""
        n_seq, v_heads, v_dim = phase.cu_seqlens.numel() - 1, self._sig.v_heads, self._sig.v_dim
        args.update(cu_seqlens=phase.cu_seqlens, chunk_offsets=phase.chunk_offsets, BT=CHUNK, STATE_V_FIRST=False)
        setting = None
        if phase.prompt_paced and self._sig.prompt_config is not None:
            block_v, warps, stages = self._sig.prompt_config
            setting = {"BV": block_v, "num_warps": warps, "num_stages": stages}
        grid = lambda meta: (triton.cdiv(v_dim, meta["BV"]) * n_seq * v_heads,)  # noqa: E731
        return Launch(kernel, grid, {**args, **self._dims}, setting)

    def _forward_states(self, phase: _Phase, h0: Ref, ht: Ref | None) -> Launch:
        """The forward state recurrence (``chunk_gated_delta_rule_fwd_h``): per-chunk states and ``v_new``."""
        _, k = self._qk()
        return self._recurrence(
            _fla().fwd_h, phase, k=k, v=Ref("u"), w=Ref("w"), v_new=Ref("v_new"), g=Ref("g_c"), gk=None, h=Ref("h"),
            h0=h0, ht=ht,
        )  # fmt: skip

    def _forward_ops(self) -> list[Launch]:
        index, sig = self._index, self._sig
        cu, chunks = index.cu_seqlens, index.chunk_indices
        norm = (Ref("q_n"), Ref("k_n"), Ref("q_rstd"), Ref("k_rstd")) if sig.l2norm else (None,) * 4
        ops: list[Launch] = [
            forward_start(
                Ref("q"), Ref("k"), Ref("g"), *norm, Ref("g_c"), _fla().rcp_ln2, cu, chunks, **self._end_dims
            ),
            self._kkt_solve(),
            self._wy(),
        ]
        final = Ref("final") if sig.final_state else None
        if self._shared:
            # The prompt's final state is written as the first completion's initial state, then copied to the rest.
            size, n_completions = math.prod(self._state), len(index.phases[1].cu_seqlens) - 1
            if sig.dtypes[-1] is not None:
                ops.append(_states(Ref("h0"), Ref("starts"), 1, size, sum_rows=False))
            ops.append(self._forward_states(index.phases[0], Ref("starts", 0, 1), Ref("starts", 1, 2)))
            if n_completions > 1:
                ops.append(_states(Ref("starts", 1, 2), Ref("starts", 2), n_completions - 1, size, sum_rows=False))
            ops.append(self._forward_states(index.phases[1], Ref("starts", 1), final))
        else:
            ops.append(self._forward_states(index.together, Ref("h0"), final))
        ops.append(self._output())
        return ops

    def _kkt_solve(self) -> Launch:
        """``(I + A)^-1`` of every chunk (fla's fused kkt + solve_tril) into the zeroed ``a``."""
        index, sig, (_, k) = self._index, self._sig, self._qk()
        return Launch(
            _fla().kkt_solve, (index.n_chunks, sig.v_heads), dict(
                k=k, g=Ref("g_c"), beta=Ref("beta"), A=Ref("a"), cu_seqlens=index.cu_seqlens,
                chunk_indices=index.chunk_indices, T=sig.total, H=sig.heads, HV=sig.v_heads, K=sig.k_dim, BT=CHUNK,
                BC=16,
            ),
        )  # fmt: skip

    def _output(self) -> Launch:
        """The output (fla's ``chunk_fwd_o``)."""
        index, sig, (q, k) = self._index, self._sig, self._qk()
        n_chunks, v_dim = index.n_chunks, sig.v_dim
        return Launch(
            _fla().fwd_o, lambda meta: (triton.cdiv(v_dim, meta["BV"]) * n_chunks, sig.v_heads), dict(
                q=q, k=k, v=Ref("v_new"), h=Ref("h"), g=Ref("g_c"), g_gamma=None, o=Ref("o"),
                cu_seqlens=index.cu_seqlens, chunk_indices=index.chunk_indices, scale=sig.scale, **self._dims,
                BT=CHUNK, STATE_V_FIRST=False,
            ),
        )  # fmt: skip

    def _dv_local(self) -> Launch:
        """The values' gradient through the chunks' local attention (fla's ``chunk_bwd_dv_local``)."""
        index, sig, (q, k) = self._index, self._sig, self._qk()
        tile = _fla().dv_local_tile
        return Launch(
            _fla().dv_local, (index.n_chunks, sig.v_heads), dict(
                q=q, k=k, g=Ref("g_c"), g_gamma=None, A=None, do=Ref("do"), dv=Ref("dv"), cu_seqlens=index.cu_seqlens,
                chunk_indices=index.chunk_indices, scale=sig.scale, **self._dims, BT=CHUNK, BK=_tile(sig.k_dim, tile),
                BV=_tile(sig.v_dim, tile),
            ),
        )  # fmt: skip

    def _wy_backward(self) -> Launch:
        """Gradients of k (per value head), v, beta and g through the WY representation (fla's
        ``prepare_wy_repr_bwd``); v's and beta's are the step's."""
        index, sig, (_, k) = self._index, self._sig, self._qk()
        tile = _fla().wy_bwd_tile
        return Launch(
            _fla().wy_bwd, (index.n_chunks, sig.v_heads), dict(
                k=k, v=Ref("v"), beta=Ref("beta"), g=Ref("g_c"), A=Ref("a"), dw=Ref("dw"), du=Ref("dv2"),
                dk=Ref("dk_wy"), dv=Ref("dv_out"), db=Ref("db"), dg=Ref("dg_wy"), cu_seqlens=index.cu_seqlens,
                chunk_indices=index.chunk_indices, **self._dims, BT=CHUNK, BK=_tile(sig.k_dim, tile),
                BV=_tile(sig.v_dim, tile),
            ),
        )  # fmt: skip

    def backward(self, with_dht: bool) -> Pass:
        """The backward pass, given a gradient of the final states or not."""
        if with_dht not in self._backward:
            self._backward[with_dht] = self._declare_backward(with_dht)
        return self._backward[with_dht]

    def _declare_backward(self, with_dht: bool) -> Pass:
        index, sig = self._index, self._sig
        q_dtype, k_dtype, v_dtype, g_dtype, beta_dtype, h0_dtype = sig.dtypes
        rows, key_rows, state = self._rows, self._key_rows, self._state
        n_seq, n_chunks = index.cu_seqlens.numel() - 1, index.n_chunks
        scratch = [
            *self._scratch,
            Buffer("dv", (*rows, sig.v_dim), q_dtype), Buffer("dv2", (*rows, sig.v_dim), q_dtype),
            Buffer("dh", (1, n_chunks, *state), q_dtype), Buffer("dq_v", (*rows, sig.k_dim), q_dtype),
            Buffer("dk_v", (*rows, sig.k_dim), k_dtype), Buffer("dw", (*rows, sig.k_dim), k_dtype),
            Buffer("dg_v", rows, torch.float32), Buffer("dk_wy", (*rows, sig.k_dim), k_dtype),
            Buffer("dg_wy", rows, torch.float32),
        ]  # fmt: skip
        if self._shared:
            scratch.append(Buffer("d_fanned", (n_seq - 1, *state), torch.float32))
            scratch.append(Buffer("dht_p", (1, *state), torch.float32))
        workspaces = {
            "saved": self._saved,
            "backward": scratch,
            "dq": [Buffer("dq", (*key_rows, sig.k_dim), q_dtype)],
            "dk": [Buffer("dk", (*key_rows, sig.k_dim), k_dtype)],
            "dv_out": [Buffer("dv_out", (*rows, sig.v_dim), v_dtype)],
            "db": [Buffer("db", rows, beta_dtype)],
            "dg": [Buffer("dg", rows, g_dtype)],
        }
        want_dh0 = h0_dtype is not None
        if want_dh0:
            workspaces["dh0"] = [Buffer("dh0", (1 if self._shared else n_seq, *state), torch.float32)]
        q, k = self._qk()
        cu, chunks = index.cu_seqlens, index.chunk_indices
        ops: list[Launch] = [
            self._wy(),
            # Every initial state is known now, so recomputing the states takes one launch, a shared prompt's
            # completions running beside the prompt instead of after it.
            self._forward_states(index.together, self._starts(), None),
            self._dv_local(),
        ]
        # The backward state recurrence (chunk_gated_delta_rule_bwd_dhu), phases last first: the completions'
        # initial-state gradients, summed, are the gradient of the prompt's final state.
        dhu = dict(
            q=q, k=k, w=Ref("w"), g=Ref("g_c"), gk=None, do=Ref("do"), dh=Ref("dh"), dv=Ref("dv"), dv2=Ref("dv2"),
            scale=sig.scale,
        )  # fmt: skip
        dht = Ref("dht") if with_dht else None
        dh0 = Ref("dh0") if want_dh0 else None
        if self._shared:
            ops.append(self._recurrence(_fla().bwd_dhu, index.phases[1], dht=dht, dh0=Ref("d_fanned"), **dhu))
            ops.append(_states(Ref("d_fanned"), Ref("dht_p"), n_seq - 1, math.prod(state), sum_rows=True))
            ops.append(self._recurrence(_fla().bwd_dhu, index.phases[0], dht=Ref("dht_p"), dh0=dh0, **dhu))
        else:
            ops.append(self._recurrence(_fla().bwd_dhu, index.together, dht=dht, dh0=dh0, **dhu))
        dims = self._end_dims
        norm = (Ref("q_rstd"), Ref("k_rstd")) if sig.l2norm else (None, None)
        ops += [
            chunk_bwd_dqkwg(
                q, k, Ref("v_new"), Ref("g_c"), Ref("h"), Ref("dv2"), Ref("do"), Ref("dh"), Ref("dq_v"), Ref("dk_v"),
                Ref("dw"), Ref("dg_v"), sig.scale, cu, chunks, total=sig.total, v_dim=sig.v_dim, **dims,
            ),
            self._wy_backward(),
            backward_end(
                Ref("dq_v"), Ref("dk_v"), Ref("dk_wy"), Ref("dg_v"), Ref("dg_wy"), q, k, *norm, Ref("dq"), Ref("dk"),
                Ref("dg"), cu, chunks, **dims,
            ),
        ]  # fmt: skip
        return Pass(Layout(workspaces), [w for w in workspaces if w != "saved"], ops)


def _step(index: _Index, sig: _Signature) -> _Step:
    step = index.steps.get(sig)
    if step is None:
        step = index.steps[sig] = _Step(index, sig)
    return step


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
        # fla's kernels index with contiguous strides (fla's own Function makes every input contiguous).
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.contiguous()
        index = _index(cu_seqlens, shared_prompt)
        _, total, heads, k_dim = q.shape
        dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, None if h0 is None else h0.dtype)
        sig = _Signature(
            q.get_device(), total, heads, v.shape[2], k_dim, v.shape[3], dtypes, scale, use_qk_l2norm,
            output_final_state, PROMPT_PHASE_CONFIG,
        )  # fmt: skip
        step = _step(index, sig)
        env = step.forward({"q": q, "k": k, "v": v, "g": g, "beta": beta, "h0": h0}, q.device)
        # The normalised q and k are saved; without the l2norm the inputs are. The shared prompt's own initial
        # state is copied into the saved buffers.
        qk = (None, None) if use_qk_l2norm else (q, k)
        ctx.save_for_backward(env["saved"], *qk, v, beta, None if shared_prompt else h0)
        ctx.step = step
        return env["o"].to(q.dtype), env.get("final")

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dht: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        saved, q, k, v, beta, h0 = ctx.saved_tensors
        # Autograd may hand in expanded gradients (stride 0, e.g. from ``final_state.sum()``).
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        inputs = {"saved": saved, "q": q, "k": k, "v": v, "beta": beta, "h0": h0, "do": do, "dht": dht}
        env = ctx.step.backward(dht is not None)(inputs, do.device)
        return env["dq"], env["dk"], env["dv_out"], env["dg"], env["db"], None, env.get("dh0"), None, None, None, None
