"""Shared-prefix Gated DeltaNet: G completions of one prompt, the prompt computed once.

Naive packing repeats the P prompt tokens in each of the G rows (``G * (P + C)`` tokens).
Here the prompt is computed once and its final state is fanned out as the initial state of
every completion (``P + G * C`` tokens). The fan-out is an ``expand``, so autograd sums the
G completions' state gradients back into the prompt.

Two entry points: :func:`packed_shared_prefix_gated_delta_rule` takes one packed row laid out
as ``[prompt, completion 1, ..., completion G]`` (what a trainer's packer produces, and what a
model layer receives); :func:`shared_prefix_gated_delta_rule` takes the prompt and the
completions as separate tensors and joins them.

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

__all__ = ["GDNInputs", "SharedPrefixOutput", "packed_shared_prefix_gated_delta_rule", "shared_prefix_gated_delta_rule"]


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


def packed_shared_prefix_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: str | BackendChoice | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One packed row (``B = 1``, layout of ``gdn.py``) whose sequence 0 is a prompt that every later
    sequence continues: sequence ``i > 0`` of ``cu_seqlens`` is a completion and starts from the
    prompt's final state.

    ``initial_state`` (``[1, HV, K, V]``) is the prompt's own starting state. Outputs and gradients
    equal those of running each ``prompt + completion`` row separately. Returns ``(o [1, T, HV, V],
    the completions' final states [G, HV, K, V] or None)``.
    """
    check_shapes(q, k, v, g, beta)
    if q.shape[0] != 1:
        raise ValueError(f"the shared prefix needs packed input with batch size 1, got {q.shape[0]}")
    if cu_seqlens.numel() < 3:
        raise ValueError(f"cu_seqlens must hold a prompt and at least one completion, got {cu_seqlens.tolist()}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    name = resolve_backend(backend, q.device, (q, k, v, g, beta, initial_state))
    if name == "fla-hybrid":
        out, final = run_fla(
            q, k, v, g, beta, cu_seqlens, initial_state, output_final_state, scale, use_qk_l2norm, True,
            shared_prompt=True,
        )  # fmt: skip
        return out.to(v.dtype), final
    if name != "fla":
        out, final = run_chunked(
            q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, name == "chunked-triton",
            fan_out_first=True,
        )  # fmt: skip
        return out.to(v.dtype), final[1:] if output_final_state else None

    prompt_len = int(cu_seqlens[1])  # fla's own index preparation synchronises on cu_seqlens as well
    prefix_out, prefix_state = chunk_gated_delta_rule(
        *(x[:, :prompt_len] for x in (q, k, v, g, beta)), initial_state=initial_state, output_final_state=True,
        scale=scale, use_qk_l2norm=use_qk_l2norm, backend=name,
    )  # fmt: skip
    completion_out, final = chunk_gated_delta_rule(
        *(x[:, prompt_len:] for x in (q, k, v, g, beta)),
        cu_seqlens=cu_seqlens[1:] - prompt_len,
        initial_state=prefix_state.expand(cu_seqlens.numel() - 2, -1, -1, -1).contiguous(),
        output_final_state=output_final_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        backend=name,
    )
    return torch.cat([prefix_out, completion_out], dim=1), final


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

    ``completion_cu_seqlens`` (``[G + 1]``) splits ``completions``; the rest is as in
    :func:`packed_shared_prefix_gated_delta_rule`, which this calls on the joined row.
    """
    for part in (prefix, completions):
        check_shapes(*part)
    if prefix.q.shape[0] != 1 or completions.q.shape[0] != 1:
        raise ValueError("prefix and completions must be packed with batch size 1")
    prompt_len = prefix.q.shape[1]
    joined = (torch.cat([p, c], dim=1) for p, c in zip(prefix, completions, strict=True))
    cu = torch.cat([completion_cu_seqlens.new_zeros(1), completion_cu_seqlens + prompt_len])
    out, final = packed_shared_prefix_gated_delta_rule(
        *joined, cu, initial_state=initial_state, output_final_state=output_final_state, scale=scale,
        use_qk_l2norm=use_qk_l2norm, backend=backend,
    )  # fmt: skip
    return SharedPrefixOutput(out[:, :prompt_len], out[:, prompt_len:], final)
