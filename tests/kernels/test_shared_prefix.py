"""Shared-prefix execution equals running each prompt + completion row separately."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_support.kernels import (
    GDNInputs,
    chunk_gated_delta_rule,
    packed_shared_prefix_gated_delta_rule,
    shared_prefix_gated_delta_rule,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


def test_shared_prefix_outputs_and_gradients_match_unshared() -> None:
    gen = torch.Generator().manual_seed(5)
    prompt_len, completion_lens, heads, v_heads, k_dim, v_dim = 70, [5, 64, 1], 2, 4, 16, 8
    n = len(completion_lens)

    def make(total: int) -> GDNInputs:
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        g = F.logsigmoid(randn(1, total, v_heads) + 3.0)
        beta = torch.rand(1, total, v_heads, generator=gen, dtype=torch.float64)
        parts = (randn(1, total, heads, k_dim), randn(1, total, heads, k_dim), randn(1, total, v_heads, v_dim), g, beta)
        return GDNInputs(*(x.requires_grad_() for x in parts))

    prefix, completions = make(prompt_len), make(sum(completion_lens))
    h0 = torch.randn(1, v_heads, k_dim, v_dim, generator=gen, dtype=torch.float64).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(completion_lens).cumsum(0).tolist()], dtype=torch.int32)

    shared = shared_prefix_gated_delta_rule(
        prefix, completions, cu, initial_state=h0, output_final_state=True, use_qk_l2norm=True
    )

    # Unshared: each row is prompt + completion, packed; the prompt appears n times.
    rows = [[] for _ in range(5)]
    bounds = cu.tolist()
    for i in range(n):
        for field, (p, c) in enumerate(zip(prefix, completions, strict=True)):
            rows[field].append(torch.cat([p, c[:, bounds[i] : bounds[i + 1]]], dim=1))
    packed = [torch.cat(r, dim=1) for r in rows]
    row_cu = torch.tensor([0, *torch.tensor([prompt_len + c for c in completion_lens]).cumsum(0).tolist()])
    o, final = chunk_gated_delta_rule(
        *packed, cu_seqlens=row_cu, initial_state=h0.expand(n, -1, -1, -1), output_final_state=True, use_qk_l2norm=True
    )
    starts = row_cu.tolist()
    for i in range(n):
        row = o[:, starts[i] : starts[i + 1]]
        assert _rel(shared.prefix, row[:, :prompt_len]) < 1e-12
        assert _rel(shared.completions[:, bounds[i] : bounds[i + 1]], row[:, prompt_len:]) < 1e-12
    assert _rel(shared.final_state, final) < 1e-12

    gen_w = torch.Generator().manual_seed(9)
    w_o = torch.randn(o.shape, generator=gen_w, dtype=torch.float64)
    w_s = torch.randn(final.shape, generator=gen_w, dtype=torch.float64)
    # The same loss written over the shared outputs: prompt positions weighted by every row's weights.
    w_prefix = sum(w_o[:, starts[i] : starts[i] + prompt_len] for i in range(n))
    w_comp = torch.cat([w_o[:, starts[i] + prompt_len : starts[i + 1]] for i in range(n)], dim=1)
    leaves = [*prefix, *completions, h0]
    got = torch.autograd.grad(
        (shared.prefix * w_prefix).sum() + (shared.completions * w_comp).sum() + (shared.final_state * w_s).sum(),
        leaves,
    )
    want = torch.autograd.grad((o * w_o).sum() + (final * w_s).sum(), leaves)
    for name, a, b in zip(
        [f"prefix.{f}" for f in GDNInputs._fields] + [f"comp.{f}" for f in GDNInputs._fields] + ["h0"],
        got,
        want,
        strict=True,
    ):
        assert _rel(a, b) < 1e-10, name


def test_packed_row_matches_separate_parts_and_zeroes_trailing_padding() -> None:
    """One packed row [prompt, completions..., padding] gives the same outputs and gradients as the
    prompt and completions passed apart; the padding gets zero output and zero gradient."""
    gen = torch.Generator().manual_seed(11)
    prompt_len, completion_lens, pad, heads, dim = 67, [3, 64, 20], 5, 2, 16
    total = prompt_len + sum(completion_lens) + pad
    row = GDNInputs(
        torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64),
        torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64),
        torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64),
        F.logsigmoid(torch.randn(1, total, heads, generator=gen, dtype=torch.float64) + 3.0),
        torch.rand(1, total, heads, generator=gen, dtype=torch.float64),
    )
    leaves = [x.clone().requires_grad_() for x in row]
    cu = torch.tensor([0, *torch.tensor([prompt_len, *completion_lens]).cumsum(0).tolist()])
    o, final = packed_shared_prefix_gated_delta_rule(*leaves, cu, output_final_state=True, use_qk_l2norm=True)

    parts = [x.clone().requires_grad_() for x in row]
    end = int(cu[-1])
    apart = shared_prefix_gated_delta_rule(
        GDNInputs(*(x[:, :prompt_len] for x in parts)),
        GDNInputs(*(x[:, prompt_len:end] for x in parts)),
        cu[1:] - prompt_len,
        output_final_state=True,
        use_qk_l2norm=True,
    )
    assert _rel(o[:, :prompt_len], apart.prefix) < 1e-12
    assert _rel(o[:, prompt_len:end], apart.completions) < 1e-12
    assert _rel(final, apart.final_state) < 1e-12
    assert final.shape == (len(completion_lens), heads, dim, dim)
    assert o[:, end:].abs().max() == 0

    weight = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((o * weight).sum() + final.sum(), leaves)
    apart_out = torch.cat([apart.prefix, apart.completions], dim=1)
    want = torch.autograd.grad((apart_out * weight[:, :end]).sum() + apart.final_state.sum(), parts)
    for name, a, b in zip(GDNInputs._fields, got, want, strict=True):
        assert _rel(a[:, :end], b[:, :end]) < 1e-10, name
        assert a[:, end:].abs().max() == 0, name


def test_packed_row_without_a_completion_is_refused() -> None:
    x = torch.randn(1, 10, 1, 8, dtype=torch.float64)
    g, beta = torch.zeros(1, 10, 1, dtype=torch.float64), torch.ones(1, 10, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="a prompt and at least one completion, got \\[0, 10\\]"):
        packed_shared_prefix_gated_delta_rule(x, x, x, g, beta, torch.tensor([0, 10]))
