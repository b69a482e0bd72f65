"""Packed and shared-prefix Gated DeltaNet kernels.

Public API:

- :func:`packing.cu_seqlens_from_position_ids`: packed position ids -> int32 ``cu_seqlens``
  (shared with the packed-attention path).
- :func:`select_backend` / :class:`BackendChoice`: which GDN implementation runs here, and why.
- :func:`gdn.chunk_gated_delta_rule`: varlen GDN forward + backward, fla's layout.
- :func:`shared_prefix.packed_shared_prefix_gated_delta_rule` (one packed row: prompt, then its
  completions) and :func:`shared_prefix.shared_prefix_gated_delta_rule` (prompt and completions
  apart): G completions over one prompt whose state is computed once.

Importing this package imports neither fla nor Triton.
"""

from model_support.kernels.backend import BACKENDS, BackendChoice, select_backend
from model_support.kernels.gdn import chunk_gated_delta_rule
from model_support.kernels.packing import cu_seqlens_from_position_ids
from model_support.kernels.shared_prefix import (
    GDNInputs,
    SharedPrefixOutput,
    packed_shared_prefix_gated_delta_rule,
    shared_prefix_gated_delta_rule,
)

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "GDNInputs",
    "SharedPrefixOutput",
    "chunk_gated_delta_rule",
    "cu_seqlens_from_position_ids",
    "packed_shared_prefix_gated_delta_rule",
    "select_backend",
    "shared_prefix_gated_delta_rule",
]
