"""Chunked Gated DeltaNet (forward and backward) against the float64 token recurrence."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_support.kernels import chunk_gated_delta_rule, cu_seqlens_from_position_ids
from model_support.kernels.reference import recurrent_gated_delta_rule

REPO = Path(__file__).resolve().parents[2]


def _inputs(
    total: int, heads: int, v_heads: int, k_dim: int, v_dim: int, n_seq: int, dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(1, total, heads, k_dim), randn(1, total, heads, k_dim)
    v = randn(1, total, v_heads, v_dim)
    g = F.logsigmoid(randn(1, total, v_heads) + 3.0)  # decays in (0, 1), mostly near 1
    beta = torch.rand(1, total, v_heads, generator=gen, dtype=torch.float64)
    h0 = randn(n_seq, v_heads, k_dim, v_dim) * 0.5
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, h0)]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _loss_weights(o: torch.Tensor, s: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    return (
        torch.randn(o.shape, generator=gen, dtype=torch.float64),
        torch.randn(s.shape, generator=gen, dtype=torch.float64),
    )


CASES = [
    # lengths, pad, H, HV, K, V, l2norm
    ([1, 64, 70, 130], 5, 2, 4, 16, 8, True),  # length-1, exactly one chunk, ragged, trailing padding
    ([200], 0, 1, 1, 32, 16, False),
    ([1, 1, 1], 0, 2, 2, 8, 8, True),
    ([63, 65], 3, 3, 3, 16, 32, False),
]


@pytest.mark.parametrize(("lengths", "pad", "heads", "v_heads", "k_dim", "v_dim", "l2"), CASES)
def test_float64_forward_and_backward_match_recurrence(
    lengths: list[int], pad: int, heads: int, v_heads: int, k_dim: int, v_dim: int, l2: bool
) -> None:
    seed = sum(lengths) + k_dim
    xs = _inputs(sum(lengths) + pad, heads, v_heads, k_dim, v_dim, len(lengths), torch.float64, seed)
    cu = _cu(lengths)
    o, s = chunk_gated_delta_rule(
        *xs[:5], cu_seqlens=cu, initial_state=xs[5], output_final_state=True, use_qk_l2norm=l2
    )
    ref_o, ref_s = recurrent_gated_delta_rule(*xs[:5], cu_seqlens=cu, initial_state=xs[5], use_qk_l2norm=l2)
    assert _rel(o, ref_o) < 1e-10
    assert _rel(s, ref_s) < 1e-10
    if pad:
        assert torch.count_nonzero(o[0, -pad:]) == 0

    w_o, w_s = _loss_weights(o, s, seed)
    grads = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), xs)
    ref_grads = torch.autograd.grad((ref_o * w_o).sum() + (ref_s * w_s).sum(), xs)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "h0"), grads, ref_grads, strict=True):
        assert _rel(got, want) < 1e-9, name
    if pad:
        for got in grads[:5]:
            assert torch.count_nonzero(got[0, -pad:]) == 0


def test_float32_close_to_float64_reference() -> None:
    lengths = [100, 37]
    xs = _inputs(sum(lengths), 2, 2, 32, 32, 2, torch.float64, seed=7)
    cu = _cu(lengths)
    ref_o, ref_s = recurrent_gated_delta_rule(*xs[:5], cu_seqlens=cu, initial_state=xs[5], use_qk_l2norm=True)
    x32 = [x.detach().float().requires_grad_() for x in xs]
    o, s = chunk_gated_delta_rule(
        *x32[:5], cu_seqlens=cu, initial_state=x32[5], output_final_state=True, use_qk_l2norm=True
    )
    assert o.dtype == torch.float32
    assert _rel(o, ref_o) < 1e-5
    assert _rel(s, ref_s) < 1e-5
    w_o, w_s = _loss_weights(o, s, 7)
    grads = torch.autograd.grad((o * w_o.float()).sum() + (s * w_s.float()).sum(), x32)
    ref_grads = torch.autograd.grad((ref_o * w_o).sum() + (ref_s * w_s).sum(), xs)
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 1e-4


def test_bfloat16_inputs_keep_dtype_and_stay_close() -> None:
    xs = _inputs(96, 2, 2, 16, 16, 1, torch.float64, seed=3)
    ref_o, _ = recurrent_gated_delta_rule(*xs[:5], cu_seqlens=_cu([96]), use_qk_l2norm=True)
    o, state = chunk_gated_delta_rule(*(x.detach().bfloat16() for x in xs[:5]), use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16
    assert state is None
    assert _rel(o, ref_o) < 2e-2


def test_batched_equals_packed_and_position_ids_drive_varlen() -> None:
    xs = [x.detach() for x in _inputs(2 * 80, 2, 2, 16, 16, 2, torch.float64, seed=11)]
    packed_o, packed_s = chunk_gated_delta_rule(
        *xs[:5], cu_seqlens=_cu([80, 80]), initial_state=xs[5], output_final_state=True
    )
    batched = [x.reshape(2, 80, *x.shape[2:]) for x in xs[:5]]
    o, s = chunk_gated_delta_rule(*batched, initial_state=xs[5], output_final_state=True)
    assert _rel(o.reshape(packed_o.shape), packed_o) < 1e-12
    assert _rel(s, packed_s) < 1e-12

    position_ids = torch.cat([torch.arange(80), torch.arange(80)])[None]
    o_pos, _ = chunk_gated_delta_rule(
        *xs[:5], cu_seqlens=cu_seqlens_from_position_ids(position_ids), initial_state=xs[5]
    )
    assert torch.equal(o_pos, packed_o)


def test_invalid_arguments_are_refused() -> None:
    xs = [x.detach() for x in _inputs(8, 2, 3, 8, 8, 1, torch.float64, seed=0)]
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(*xs[:5])
    ys = [x.detach() for x in _inputs(8, 2, 2, 8, 8, 1, torch.float64, seed=0)]
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule(*(x.reshape(2, 4, *x.shape[2:]) for x in ys[:5]), cu_seqlens=_cu([4, 4]))
    with pytest.raises(ValueError, match="shape mismatch"):
        chunk_gated_delta_rule(ys[0], ys[1][:, :4], *ys[2:5])
    for cu in ([2, 5, 8], [0, 5, 3]):
        with pytest.raises(ValueError, match="start at 0 and be non-decreasing"):
            chunk_gated_delta_rule(*ys[:5], cu_seqlens=torch.tensor(cu))


def _interpreted_error(script: str, timeout: int) -> float:
    """Run ``script`` in a fresh process under Triton's CPU interpreter; the last line it prints, as a float."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


def _interpreter_loops_over_loaded_bounds() -> bool:
    """Triton 3.6's interpreter (the H100 image's) cannot take a loaded scalar as a ``range`` bound: its
    ``__index__`` converts a one-element array, which that image's numpy refuses; 3.8's (CI's) can. The compiled
    kernel is not affected."""
    import triton
    from packaging.version import Version

    return Version(triton.__version__) >= Version("3.7")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is not None and not _interpreter_loops_over_loaded_bounds(),
    reason="this Triton's interpreter cannot loop over a bound loaded from memory (Triton < 3.7)",
)
def test_triton_recurrence_matches_torch_loop_in_interpreter() -> None:
    """Our Triton kernels, run by Triton's CPU interpreter, against the torch loop."""
    script = textwrap.dedent(
        """
        import torch
        from model_support.kernels import _triton_recurrence as tr
        from model_support.kernels._recurrence import ChunkSchedule, _loop_backward, _loop_forward

        gen = torch.Generator().manual_seed(0)
        counts, heads, chunk, k_dim, v_dim = [3, 1, 0, 2], 2, 64, 16, 32
        n = sum(counts)
        sched = ChunkSchedule.build(counts, torch.device("cpu"))
        def r(*s, scale=1.0):
            return torch.randn(*s, generator=gen) * scale
        u, w, kd = r(n, heads, chunk, v_dim), r(n, heads, chunk, k_dim, scale=0.1), r(n, heads, chunk, k_dim, scale=0.1)
        gamma, s0 = torch.rand(n, heads, generator=gen), r(len(counts), heads, k_dim, v_dim)
        worst = 0.0
        for got, want in zip(tr.forward(u, w, kd, gamma, s0, sched.offsets), _loop_forward(u, w, kd, gamma, s0, sched)):
            worst = max(worst, float((got - want).norm() / want.norm()))
        dd, dss, dsf = r(n, heads, chunk, v_dim), r(n, heads, k_dim, v_dim), r(len(counts), heads, k_dim, v_dim)
        got_all = tr.backward(w, kd, gamma, dd, dss, dsf, sched.offsets)
        for got, want in zip(got_all, _loop_backward(w, kd, gamma, dd, dss, dsf, sched)):
            worst = max(worst, float((got - want).norm() / want.norm()))
        print(worst)
        """
    )
    assert _interpreted_error(script, timeout=120) < 1e-6


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_hybrid_dqkwg_matches_autograd_in_interpreter() -> None:
    """fla-hybrid's own chunk_bwd_dqkwg kernel (Triton's CPU interpreter) against float64 autograd of one
    chunk's output and next state, on ragged sequences with grouped value heads."""
    script = textwrap.dedent(
        """
        import math, torch
        from model_support.kernels._fla_hybrid import CHUNK, chunk_bwd_dqkwg

        gen = torch.Generator().manual_seed(0)
        lengths, heads, v_heads, k_dim, v_dim, scale = [1, 64, 100], 1, 2, 16, 32, 0.3
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        chunks = [(n, i) for n, length in enumerate(lengths) for i in range(-(-length // CHUNK))]
        def r(*s):
            return torch.randn(*s, generator=gen)
        q, k = r(1, total, heads, k_dim) * 0.3, r(1, total, heads, k_dim) * 0.3
        v, do, dv = (r(1, total, v_heads, v_dim) for _ in range(3))
        w = r(1, total, v_heads, k_dim)
        h, dh = r(len(chunks), v_heads, k_dim, v_dim), r(len(chunks), v_heads, k_dim, v_dim)
        g = torch.nn.functional.logsigmoid(r(1, total, v_heads) + 2)
        g_cum = torch.empty_like(g)  # chunk-local cumulative decay, as fla passes it (log2 units)
        for n, i in chunks:
            rows = slice(int(cu[n]) + i * CHUNK, min(int(cu[n]) + (i + 1) * CHUNK, int(cu[n + 1])))
            g_cum[0, rows] = g[0, rows].cumsum(0)
        got = [torch.empty(1, total, v_heads, k_dim) for _ in range(3)] + [torch.empty(1, total, v_heads)]
        dims = dict(total=total, heads=heads, v_heads=v_heads, k_dim=k_dim, v_dim=v_dim)
        chunk_bwd_dqkwg(q, k, v, g_cum / math.log(2), h, dv, do, dh, *got, scale, cu, torch.tensor(chunks), **dims)()
        for i in (0, 1):  # dq, dk per value head: summed over each key head's value heads
            got[i] = got[i].view(1, total, heads, v_heads // heads, k_dim).sum(3)

        want = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, w, g)]  # dq, dk, dw, dg
        for c, (n, i) in enumerate(chunks):
            rows = slice(int(cu[n]) + i * CHUNK, min(int(cu[n]) + (i + 1) * CHUNK, int(cu[n + 1])))
            for hv in range(v_heads):
                hq = hv // (v_heads // heads)
                pairs = ((q, hq), (k, hq), (w, hv), (g_cum, hv))
                qc, kc, wc, gc = (x[0, rows, head].double().requires_grad_() for x, head in pairs)
                vc, hc, dhc = v[0, rows, hv].double(), h[c, hv].double(), dh[c, hv].double()
                decay = (gc[:, None] - gc[None, :]).exp() * torch.ones(len(gc), len(gc)).tril()
                o = scale * ((qc * gc.exp()[:, None]) @ hc + ((qc @ kc.T) * decay) @ vc)
                h_next = gc[-1].exp() * hc + (kc * (gc[-1] - gc).exp()[:, None]).T @ vc
                v_new_term = (dv[0, rows, hv].double() * (wc @ hc)).sum()  # v_new = u - w h
                loss = (do[0, rows, hv].double() * o).sum() + (dhc * h_next).sum() - v_new_term
                dq, dk, dw, dg = torch.autograd.grad(loss, (qc, kc, wc, gc))
                want[0][0, rows, hq] += dq
                want[1][0, rows, hq] += dk
                want[2][0, rows, hv] = dw
                want[3][0, rows, hv] = dg
        print(max(float((a.double() - b).norm() / b.norm()) for a, b in zip(got, want)))
        """
    )
    assert _interpreted_error(script, timeout=300) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="fla-hybrid's module needs Triton")
def test_hybrid_shared_prompt_phases_keep_absolute_token_and_chunk_positions() -> None:
    """fla-hybrid's two recurrence phases (prompt, then its completions) are slices of the joined
    cu_seqlens and of the chunk offsets computed from it on the device, so both phases index the
    same full-size tensors; the backward's recomputation runs all sequences together. The chunk indices
    are fla's [sequence, chunk within it] pairs."""
    from model_support.kernels._fla_hybrid import _index

    cu = torch.tensor([0, 130, 131, 195, 265])  # prompt of 130 tokens (3 chunks), completions 1, 64, 70
    shared = _index(cu, shared_prompt=True)
    prompt, completions = shared.phases
    assert prompt.cu_seqlens.tolist() == [0, 130]
    assert prompt.chunk_offsets[:1].tolist() == [0]
    assert completions.cu_seqlens.tolist() == [130, 131, 195, 265]
    assert completions.chunk_offsets[:3].tolist() == [3, 4, 5]
    assert shared.together.cu_seqlens is cu and shared.together.chunk_offsets.tolist() == [0, 3, 4, 5, 7]
    assert prompt.prompt_paced and shared.together.prompt_paced and not completions.prompt_paced
    assert shared.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [3, 0], [3, 1]]
    assert shared.n_chunks == 7 and shared.chunk_indices.dtype == cu.dtype
    plain = _index(cu, shared_prompt=False)
    assert plain.phases == (plain.together,) and not plain.together.prompt_paced


def test_fla_index_is_read_once_per_cu_seqlens_tensor() -> None:
    """fla's index helpers cache by tensor identity: the same cu_seqlens must give the same int64 tensor
    (no new host sync per layer), and a different tensor must be read afresh, even with equal values."""
    from model_support.kernels.gdn import _fla_index

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    first, n_valid = _fla_index(cu)
    assert first.dtype == torch.long and first.tolist() == [0, 5, 9] and n_valid == 9
    assert _fla_index(cu)[0] is first
    other, n_other = _fla_index(torch.tensor([0, 3], dtype=torch.int32))
    assert other is not first and n_other == 3
    assert _fla_index(torch.tensor([0, 3], dtype=torch.int32))[0] is not other
