"""Shared-prefix Gated DeltaNet: G completions of one prompt, the prompt computed once.

Naive packing repeats the P prompt tokens in each of the G rows (``G * (P + C)`` tokens).
Here the prompt is computed once and its final state is fanned out as the initial state of
every completion (``P + G * C`` tokens). The fan-out is an ``expand``, so autograd sums the
G completions' state gradients back into the prompt.

On our chunked backends and on fla-hybrid, everything but the state recurrence runs in one
pass over prompt and completions together, and the recurrence runs in two phases (prompt,
then all completions); on fla the prompt and the completions are two calls joined by
``initial_state`` / ``output_final_state``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_support.kernels.backend import BackendChoice
from model_support.kernels.gdn import check_shapes, chunk_gated_delta_rule, resolve_backend, run_chunked, run_fla

__all__ = ["GDNInputs", "SharedPrefixOutput", "shared_prefix_gated_delta_rule"]


class GDNInputs(NamedTuple):
    """One packed ``[1, T, ...]`` set of Gated DeltaNet inputs (layout of ``gdn.py``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


class SharedPrefixOutput(NamedTuple):
    prefix: torch.Tensor
    """Prompt outputs ``[1, P, HV, V]``."""
    completions: torch.Tensor
    """Completion outputs ``[1, sum(C_i), HV, V]``, packed as the input."""
    final_state: torch.Tensor | None
    """Each completion's final state ``[G, HV, K, V]`` when asked for."""


def shared_prefix_gated_delta_rule(
    prefix: GDNInputs,
    completions: GDNInputs,
    completion_cu_seqlens: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: str | BackendChoice | None = None,
) -> SharedPrefixOutput:
    """Run one prompt (``prefix``, a single sequence) and G packed completions of it.

    ``completion_cu_seqlens`` (``[G + 1]``) splits ``completions``; ``initial_state``
    (``[1, HV, K, V]``) is the prompt's own starting state. Outputs and gradients equal those
    of running each ``prompt + completion`` row separately.
    """
    for part in (prefix, completions):
        check_shapes(*part)
    if prefix.q.shape[0] != 1 or completions.q.shape[0] != 1:
        raise ValueError("prefix and completions must be packed with batch size 1")
    scale = prefix.q.shape[-1] ** -0.5 if scale is None else scale
    name = resolve_backend(backend, prefix.q.device, (*prefix, *completions, initial_state))
    n_completions = completion_cu_seqlens.numel() - 1
    prompt_len = prefix.q.shape[1]

    if name != "fla":
        joined = (torch.cat([p, c], dim=1) for p, c in zip(prefix, completions, strict=True))
        cu = torch.cat([completion_cu_seqlens.new_zeros(1), completion_cu_seqlens + prompt_len])
        if name == "fla-hybrid":
            out, final = run_fla(
                *joined, cu, initial_state, output_final_state, scale, use_qk_l2norm, True, prompt_len=prompt_len
            )
        else:
            out, final = run_chunked(
                *joined, cu, initial_state, scale, use_qk_l2norm, name == "chunked-triton", fan_out_first=True
            )
            final = final[1:]
        out = out.to(prefix.v.dtype)
        return SharedPrefixOutput(out[:, :prompt_len], out[:, prompt_len:], final if output_final_state else None)

    prefix_out, prefix_state = chunk_gated_delta_rule(
        *prefix, initial_state=initial_state, output_final_state=True, scale=scale,
        use_qk_l2norm=use_qk_l2norm, backend=name,
    )  # fmt: skip
    completion_out, final = chunk_gated_delta_rule(
        *completions,
        cu_seqlens=completion_cu_seqlens,
        initial_state=prefix_state.expand(n_completions, -1, -1, -1).contiguous(),
        output_final_state=output_final_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        backend=name,
    )
    return SharedPrefixOutput(prefix_out, completion_out, final)
