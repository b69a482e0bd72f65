"""The fused ends of fla-hybrid's step (``kernels/_gdn_ends.py``) against torch, in Triton's CPU interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json
import torch
from model_support.kernels._gdn_ends import backward_end, forward_start
from model_support.kernels.reference import l2norm

def chunks_of(lengths):
    pairs = [(n, c) for n, length in enumerate(lengths) for c in range(-(-length // 64))]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu, torch.tensor(pairs, dtype=torch.int32)

def chunk_cumsum(x, lengths, reverse=False):
    # [1, T, HV] cumulative sums inside each sequence's 64-token chunks
    out, start = torch.empty_like(x), 0
    for length in lengths:
        for c in range(start, start + length, 64):
            end = min(c + 64, start + length)
            part = x[:, c:end]
            out[:, c:end] = part.flip(1).cumsum(1).flip(1) if reverse else part.cumsum(1)
        start += length
    return out

lengths, heads, v_heads, dim = [70, 130, 1, 64], 2, 6, 48
gen = torch.Generator().manual_seed(0)
total = sum(lengths)
cu, chunk_indices = chunks_of(lengths)
q, k = torch.randn(1, total, heads, dim, generator=gen), torch.randn(1, total, heads, dim, generator=gen)
g = torch.randn(1, total, v_heads, generator=gen)
worst = {}
for norm in (True, False):
    dims = dict(heads=heads, v_heads=v_heads, k_dim=dim)
    q_rstd, k_rstd = (torch.empty(1, total, heads), torch.empty(1, total, heads)) if norm else (None, None)
    qn, kn = (torch.empty_like(q), torch.empty_like(k)) if norm else (q, k)
    g_cum = torch.empty_like(g)
    out = (qn, kn) if norm else (None, None)
    forward_start(q, k, g, *out, q_rstd, k_rstd, g_cum, 1.5, cu, chunk_indices, **dims)()
    want_q, want_k = (l2norm(q), l2norm(k)) if norm else (q, k)
    worst[f"forward q/k norm={norm}"] = max(float((qn - want_q).abs().max()), float((kn - want_k).abs().max()))
    worst[f"forward g norm={norm}"] = float((g_cum - chunk_cumsum(g, lengths) * 1.5).abs().max())
    dq, dk, dk_wy = (torch.randn(1, total, v_heads, dim, generator=gen) for _ in range(3))
    dg, dg_wy = torch.randn(1, total, v_heads, generator=gen), torch.randn(1, total, v_heads, generator=gen)
    got_dq, got_dk = torch.empty_like(q), torch.empty_like(k)
    got_dg = torch.empty_like(g, dtype=torch.bfloat16)
    backward_end(dq, dk, dk_wy, dg, dg_wy, qn, kn, q_rstd, k_rstd, got_dq, got_dk, got_dg, cu, chunk_indices, **dims)()
    group = lambda x: x.view(1, total, heads, v_heads // heads, dim).sum(3)
    xq, xk = q.clone().requires_grad_(), k.clone().requires_grad_()
    yq, yk = (l2norm(xq), l2norm(xk)) if norm else (xq, xk)
    want_dq, want_dk = torch.autograd.grad((yq, yk), (xq, xk), (group(dq), group(dk + dk_wy)))
    errors = (float((got_dq - want_dq).abs().max()), float((got_dk - want_dk).abs().max()))
    worst[f"backward q/k norm={norm}"] = max(errors)
    want_dg = chunk_cumsum(dg + dg_wy, lengths, reverse=True)
    worst[f"backward g norm={norm}"] = float(((got_dg.float() - want_dg) / want_dg.abs().clamp(min=1)).abs().max())
    worst[f"backward g dtype norm={norm}"] = 0.0 if got_dg.dtype == torch.bfloat16 else 1.0
print(json.dumps(worst))
"""


def test_fused_ends_match_torch() -> None:
    """Ragged sequences (partial chunks, a one-token sequence), 3 value heads per key head, l2norm on and off:
    q/k and their gradients within float32 rounding, the decay cumsums within float32 (forward) and bf16
    (backward, written in g's dtype) rounding."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    for name, error in worst.items():
        limit = 2**-7 if name.startswith("backward g") else 2e-5  # g.grad in bf16: one ulp
        assert error <= limit, (name, error)
