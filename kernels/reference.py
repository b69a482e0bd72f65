"""Token-by-token Gated DeltaNet recurrence: the slow, obviously-right reference.

Run it in float64 to check the chunked implementations; it follows the same layout as
:func:`model_support.kernels.gdn.chunk_gated_delta_rule` (packed ``[1, T, H, D]`` plus
``cu_seqlens``, state ``[N, HV, K, V]``).
"""

from __future__ import annotations

import torch

__all__ = ["l2norm", "recurrent_gated_delta_rule"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dimension (fla's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference outputs ``[1, T, HV, V]`` (zeros after ``cu_seqlens[-1]``) and final states.

    Per token, with ``S`` of shape ``[K, V]``: ``S <- exp(g) S``;
    ``S <- S + beta k (v - S^T k)^T``; ``o = S^T (scale q)``. Query/key heads are shared by
    ``HV / H`` consecutive value heads. Computed in the dtype of the inputs.
    """
    _, t_total, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = (q[0] * scale).repeat_interleave(hv // h, dim=1)
    k = k[0].repeat_interleave(hv // h, dim=1)
    v, g, beta = v[0], g[0], beta[0]
    bounds = cu_seqlens.tolist()
    n_seq = len(bounds) - 1
    out = v.new_zeros(t_total, hv, dv)
    finals = []
    for i in range(n_seq):
        state = v.new_zeros(hv, dk, dv) if initial_state is None else initial_state[i].to(v.dtype).clone()
        for t in range(bounds[i], bounds[i + 1]):
            state = state * g[t].exp()[:, None, None]
            recalled = torch.einsum("hkv,hk->hv", state, k[t])
            state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - recalled))
            out[t] = torch.einsum("hkv,hk->hv", state, q[t])
        finals.append(state)
    final = torch.stack(finals) if finals else v.new_zeros(0, hv, dk, dv)
    return out[None], final
