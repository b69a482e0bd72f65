"""Varlen Gated DeltaNet (chunked), forward and backward, with fla's calling convention.

Layout (as fla's ``chunk_gated_delta_rule``): ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``,
``g`` (log decay, <= 0) and ``beta [B, T, HV]``; ``HV`` a multiple of ``H`` (each query/key
head serves ``HV / H`` consecutive value heads). Packed input is ``B = 1`` with
``cu_seqlens [N + 1]``; states are ``[N, HV, K, V]`` (float32, float64 for float64 input).
Tokens at and after ``cu_seqlens[-1]`` are trailing padding: zero output, zero gradient.

Chunked formulation (our own paths). Per chunk of ``C = 64`` tokens, with ``G`` the
cumulative log decay inside the chunk, ``L[t, s] = exp(G_t - G_s)`` for ``s <= t`` and
``S`` the state entering the chunk, the delta rule's corrections ``D`` solve the
unit lower-triangular system ``(I + A) D = beta * (V - exp(G) K S)`` with
``A[t, s] = beta_t L[t, s] k_t.k_s`` (``s < t``). Solving once for the chunk gives
``D = u - w S`` (``u``, ``w``: the WY representation), then
``O = (exp(G) q) S + ((q k^T) * L) D`` and ``S' = exp(G_C) S + (exp(G_C - G) k)^T D``.
Only the last line is sequential (``_recurrence``); the rest is batched over all chunks of
all sequences. All exponents are <= 0, so nothing overflows.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_support.kernels._memo import while_alive
from model_support.kernels._recurrence import ChunkSchedule, state_recurrence, to_device
from model_support.kernels.backend import BackendChoice, check_backend, select_backend
from model_support.kernels.reference import l2norm

__all__ = ["CHUNK_SIZE", "chunk_gated_delta_rule"]

CHUNK_SIZE = 64


@dataclass(frozen=True)
class _ChunkLayout:
    """Where each real packed (token, head) lands in the contiguous ``[n_chunks, H, C]`` grid."""

    dest: torch.Tensor  # [n_valid * H] flat index into [n_chunks * H * C]
    n_chunks: int
    heads: int
    schedule: ChunkSchedule

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, heads: int, chunk: int) -> _ChunkLayout:
        # The one device-to-host synchronisation of a call (none when cu_seqlens is on the CPU).
        bounds = cu_seqlens.tolist()
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        if not bounds or bounds[0] != 0 or any(n < 0 for n in lengths):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {bounds}")
        counts = [-(-n // chunk) for n in lengths]
        starts = [0, *itertools.accumulate(counts)]
        n_seq, n_valid = len(lengths), bounds[-1]
        device = cu_seqlens.device
        table = to_device([*bounds, *starts, *lengths], device)  # one host-to-device copy
        cu, chunk_starts, seq_lengths = table[: n_seq + 1], table[n_seq + 1 : 2 * n_seq + 2], table[2 * n_seq + 2 :]
        seq = torch.repeat_interleave(torch.arange(n_seq, device=device), seq_lengths, output_size=n_valid)
        offset = torch.arange(n_valid, device=device) - cu[seq]
        chunk_id = chunk_starts[seq] + offset // chunk
        head = torch.arange(heads, device=device)
        dest = ((chunk_id[:, None] * heads + head) * chunk + (offset % chunk)[:, None]).reshape(-1)
        schedule = ChunkSchedule(offsets=chunk_starts, counts=tuple(counts))
        return cls(dest=dest, n_chunks=starts[-1], heads=heads, schedule=schedule)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[T, H, *D]`` -> contiguous ``[n_chunks, H, C, *D]``, zeros where no token sits."""
        tail = x.shape[2:]
        n_valid = self.dest.numel() // self.heads
        flat = x[:n_valid].reshape(-1, *tail)
        buf = x.new_zeros(self.n_chunks * self.heads * CHUNK_SIZE, *tail).index_copy(0, self.dest, flat)
        return buf.view(self.n_chunks, self.heads, CHUNK_SIZE, *tail)

    def from_chunks(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """``[n_chunks, H, C, D]`` -> packed ``[total, H, D]``, zeros after the real tokens."""
        out = x.reshape(-1, x.shape[-1]).index_select(0, self.dest).view(-1, self.heads, x.shape[-1])
        pad = total - out.shape[0]
        return torch.cat([out, out.new_zeros(pad, *out.shape[1:])]) if pad else out


def _intra_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    compute: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """Everything that needs no state, batched over ``[n_chunks, HV, C, *]`` (input dtype in).

    Returns ``u, w, kd, gamma`` for the recurrence and ``q_decayed, p`` for the output
    ``O = q_decayed S + p D``.
    """
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    if use_qk_l2norm:  # zero (padding) rows stay zero
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    cum = g.cumsum(-1)
    causal = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    # WY representation: u = (I + A)^-1 beta V, w = (I + A)^-1 beta exp(G) K. A has a zero
    # diagonal, which unitriangular=True reads as I + A; inverting once (C columns) and
    # multiplying is cheaper than a triangular solve with K + V columns.
    a = ((k @ k.transpose(-1, -2)) * decay * beta[..., None]).tril(-1)
    eye = torch.eye(CHUNK_SIZE, dtype=a.dtype, device=a.device)
    inverse = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True) * beta[..., None, :]
    u = inverse @ v
    w = inverse @ (k * cum.exp()[..., None])
    last = cum[..., -1]  # padding slots have g = 0, so this is the decay of the real tokens
    kd = k * (last[..., None] - cum).exp()[..., None]
    p = (q @ k.transpose(-1, -2)) * decay
    return u, w, kd, last.exp(), q * cum.exp()[..., None], p


@functools.cache
def _compiled_intra_chunk() -> Callable[..., tuple[torch.Tensor, ...]]:
    return torch.compile(_intra_chunk, dynamic=True)


def _intra_chunk_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, ...]]:
    """On CUDA with Triton (which inductor needs), ``_intra_chunk`` through ``torch.compile``:
    its dozen elementwise passes over ``[n_chunks, HV, C, C]`` tensors fuse. Eager elsewhere.
    Compiled once, with dynamic shapes."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return _compiled_intra_chunk()
    return _intra_chunk


def run_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    use_triton: bool,
    fan_out_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our chunked path on packed ``[1, T, ...]`` input; returns output and final states.

    ``fan_out_first``: sequence 0 is a shared prompt; every later sequence starts from its
    final state (``initial_state``, if given, is the prompt's alone, ``[1, HV, K, V]``). The
    parallel stages still run once over all tokens; only the recurrence runs in two phases.
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    total = q.shape[1]
    heads, v_heads = q.shape[2], v.shape[2]
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    if v_heads != heads:
        q = q.repeat_interleave(v_heads // heads, dim=1)
        k = k.repeat_interleave(v_heads // heads, dim=1)

    layout = _ChunkLayout.build(cu_seqlens, v_heads, CHUNK_SIZE)
    chunks = (layout.to_chunks(x) for x in (q, k, v, g, beta))
    u, w, kd, gamma, q_decayed, p = _intra_chunk_for(q.device)(*chunks, scale, use_qk_l2norm, compute)

    n_seq = cu_seqlens.numel() - 1
    state_shape = (v_heads, k.shape[-1], v.shape[-1])
    if not fan_out_first:
        s0 = u.new_zeros(n_seq, *state_shape) if initial_state is None else initial_state.to(compute)
        d, s_start, s_final = state_recurrence(u, w, kd, gamma, s0, layout.schedule, use_triton=use_triton)
    else:
        s0 = u.new_zeros(1, *state_shape) if initial_state is None else initial_state.to(compute)
        counts = layout.schedule.counts
        split = counts[0]
        prompt = ChunkSchedule.build([split], u.device)
        rest = ChunkSchedule.build(list(counts[1:]), u.device)
        d0, start0, final0 = state_recurrence(
            u[:split], w[:split], kd[:split], gamma[:split], s0, prompt, use_triton=use_triton
        )
        fanned = final0.expand(n_seq - 1, *state_shape)
        d1, start1, final1 = state_recurrence(
            u[split:], w[split:], kd[split:], gamma[split:], fanned, rest, use_triton=use_triton
        )
        d, s_start, s_final = torch.cat([d0, d1]), torch.cat([start0, start1]), torch.cat([final0, final1])
    o = q_decayed @ s_start + p @ d
    return layout.from_chunks(o, total)[None], s_final


@while_alive
def _fla_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` as int64 and its valid token count, once per ``cu_seqlens`` tensor.

    Reading the last entry synchronises host and device; a model's GDN layers share one
    ``cu_seqlens`` per step, so that happens once per step, not once per layer. fla's index helpers
    cache by tensor identity too (``fla.utils.tensor_cache``), so the int64 copy handed to them must
    be the same tensor each time; then a step captured in a CUDA graph syncs nowhere.
    """
    return cu_seqlens.long(), int(cu_seqlens[-1])


@functools.lru_cache(maxsize=16)
def _batched_cu_seqlens(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` of ``batch`` rows of ``length`` tokens; one tensor per recent shape, so fla's caches
    hit (bounded: batched calls of ever new lengths must not keep a tensor each)."""
    return torch.arange(batch + 1, device=device, dtype=torch.long) * length


def run_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    scale: float,
    use_qk_l2norm: bool,
    hybrid: bool,
    shared_prompt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's kernels (``hybrid``: with our own ``chunk_bwd_dqkwg``, see :mod:`._fla_hybrid`; packed input only).

    ``shared_prompt`` (hybrid only): sequence 0 is a prompt that every other sequence continues.
    """
    total = q.shape[1]
    if cu_seqlens is None:
        n_valid = total
    else:
        cu_seqlens, n_valid = _fla_index(cu_seqlens)
    if n_valid < total:
        q, k, v, g, beta = (x[:, :n_valid] for x in (q, k, v, g, beta))
    if hybrid:
        from model_support.kernels._fla_hybrid import FlaHybrid

        o, final = FlaHybrid.apply(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, shared_prompt
        )
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

        from model_support.kernels.tuning import seed_triton_cache

        seed_triton_cache()

        o, final = fla_chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
            cu_seqlens=cu_seqlens,
        )
    if n_valid < total:
        o = torch.cat([o, o.new_zeros(1, total - n_valid, *o.shape[2:])], dim=1)
    return o, final


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the five inputs follow the layout of this module."""
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or g.shape != v.shape[:3] or beta.shape != g.shape:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
            f"g {tuple(g.shape)} beta {tuple(beta.shape)}"
        )
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"value heads ({v.shape[2]}) must be a multiple of query/key heads ({q.shape[2]})")


def resolve_backend(
    backend: str | BackendChoice | None, device: torch.device, inputs: tuple[torch.Tensor | None, ...]
) -> str:
    """The backend name to run: the policy's choice, or the caller's after checking it is correct here.

    A backward is needed when autograd is on and any input requires grad.
    """
    need_backward = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    return _resolved(backend.name if isinstance(backend, BackendChoice) else backend, device, need_backward)


@functools.lru_cache(maxsize=64)
def _resolved(name: str | None, device: torch.device, need_backward: bool) -> str:
    """:func:`resolve_backend` once per process for each question: what it reads (installed versions, the GPU's
    compute capability) does not change while a process runs, and a model asks once per GDN layer and step.
    A refusal raises, so it is not remembered."""
    if name is None:
        return select_backend(device, need_backward=need_backward).name
    check_backend(name, device, need_backward=need_backward)
    return name


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: str | BackendChoice | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet over packed or batched sequences; differentiable in every tensor input.

    Args mirror fla's ``chunk_gated_delta_rule`` (``use_qk_l2norm`` is its
    ``use_qk_l2norm_in_kernel``). ``cu_seqlens`` (int32 or int64, e.g. from
    :func:`model_support.kernels.packing.cu_seqlens_from_position_ids`) needs ``B = 1``.
    ``backend``: a name from :data:`model_support.kernels.backend.BACKENDS`, a
    :class:`BackendChoice`, or ``None`` for :func:`select_backend` on ``q``'s device. A named
    backend that cannot run correctly here raises ``ValueError``.

    Returns ``(o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] or None)``.
    """
    batch, total, _, k_dim = q.shape
    v_heads = v.shape[2]
    check_shapes(q, k, v, g, beta)
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs packed input with batch size 1, got {batch}")
    scale = k_dim**-0.5 if scale is None else scale
    name = resolve_backend(backend, q.device, (q, k, v, g, beta, initial_state))

    if name == "fla":
        return run_fla(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state, scale, use_qk_l2norm, False)

    if cu_seqlens is None:
        cu = _batched_cu_seqlens(batch, total, q.device)
        q, k, v, g, beta = (x.reshape(1, batch * total, *x.shape[2:]) for x in (q, k, v, g, beta))
    else:
        cu = cu_seqlens
    if name == "fla-hybrid":
        o, final = run_fla(q, k, v, g, beta, cu, initial_state, output_final_state, scale, use_qk_l2norm, True)
    else:
        o, final = run_chunked(q, k, v, g, beta, cu, initial_state, scale, use_qk_l2norm, name == "chunked-triton")
    o = o.reshape(batch, total, v_heads, v.shape[-1]).to(v.dtype)
    return o, final if output_final_state else None
