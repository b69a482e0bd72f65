"""Gated DeltaNet token mixers for megatron-core: megatron-core's own on GPUs, a local one on CPU.

:class:`RoutedGatedDeltaNet` is megatron-core's ``GatedDeltaNet`` (what a trainer runs: fla's causal
convolution and l2norm, megatron-core's projections, gating and output norm) with its recurrence routed
to ``model_support.kernels.gdn.chunk_gated_delta_rule`` and the backend the handler's runtime policy
selects (e.g. ``fla-hybrid`` on Hopper, where fla 0.6 refuses its own backward). It allocates on
``torch.cuda.current_device()`` and needs fla, so it runs on GPUs only.

:class:`LocalGatedDeltaNet` is the same layer without fla or CUDA, for CPU machines, with the same
parameter names (``in_proj``, ``conv1d``, ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``), so
megatron-bridge's Qwen3.5 mappings (GDNLinearMappingSeparate, GDNConv1dMapping,
RMSNorm2ZeroCenteredRMSNormMapping) fill both unchanged. Both take the row's layout (``rows``, set by
:func:`model_support.core.megatron.forward.packed_rows`): the recurrence and the causal convolution restart at every
sequence boundary, and a completion continues its prompt (computed once) in both. A row with shared prefixes runs
:func:`gdn_forward` on either module's parameters (megatron-core's forward restarts the convolution at every
sequence).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from model_support.core.megatron.norms import ZeroCenteredRMSNorm
from model_support.core.megatron.rows import RowLayout


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: RowLayout | None,
    backend: str | None = None,
) -> torch.Tensor:
    """[B, S, HV, D] gated delta rule (q/k l2-normalised, grouped heads), the state restarting at each sequence of
    the row and every completion starting from its prompt's final state (the prompt computed once)."""
    from model_support.kernels.gdn import chunk_gated_delta_rule
    from model_support.kernels.shared_prefix import packed_shared_prefix_gated_delta_rule

    if rows is None or not rows.shared:
        cu_seqlens = None if rows is None else rows.cu_seqlens(q.device)
        out, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=False, use_qk_l2norm=True, backend=backend
        )
        return out
    outs = []
    for index, group in enumerate(rows.groups):
        span = [t[:, group[0].start : group[-1].end] for t in (q, k, v, g, beta)]
        if len(group) == 1:
            out, _ = chunk_gated_delta_rule(*span, use_qk_l2norm=True, backend=backend)
        else:
            cu_seqlens = rows.group_cu_seqlens(index, q.device)
            out, _ = packed_shared_prefix_gated_delta_rule(*span, cu_seqlens, use_qk_l2norm=True, backend=backend)
        outs.append(out)
    return torch.cat(outs, dim=1)


class RoutedGatedDeltaNet(GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet`` with the recurrence on ``kernel`` (a name from
    ``model_support.kernels.backend.BACKENDS``) and packed rows taken from ``cu_seqlens``."""

    def __init__(self, *args: Any, kernel: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernel = kernel
        self.gated_delta_rule = self._routed_rule
        self.rows: RowLayout | None = None

    @property
    def sections(self) -> list[int]:
        """This rank's ``in_proj`` output sections ``[q, k, v, z, b, a]``."""
        return list(self.in_proj_split_sections)

    def _routed_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from model_support.kernels.gdn import chunk_gated_delta_rule

        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens=cu_seqlens,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
            backend=self.kernel,
        )

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, *args: Any, **kwargs: Any):
        if self.rows is not None and self.rows.shared:
            # megatron-core's forward restarts the convolution at every sequence; a completion continues its
            # prompt's. The same layer's parameters, megatron-core's recurrence kernel, the shared-prefix schedule.
            return gdn_forward(self, hidden_states, self.rows, self.kernel)
        if self.rows is not None and kwargs.get("packed_seq_params") is None:
            cu = self.rows.cu_seqlens(hidden_states.device)
            kwargs["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, rows: RowLayout | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal convolution + SiLU over [B, S, C]: zero left-padding at every sequence start, a completion's
    last ``width - 1`` inputs of its prompt before it."""
    width = weight.shape[-1]
    pieces = [(x, None)] if rows is None else []
    for group in rows.groups if rows is not None else ():
        prompt = group[0]
        for segment in group:
            left = None if segment is prompt else x[:, max(prompt.end - width + 1, prompt.start) : prompt.end]
            pieces.append((x[:, segment.start : segment.end], left))
    outs = []
    for body, left in pieces:
        context = body if left is None else torch.cat([left, body], dim=1)
        padded = F.pad(context.transpose(1, 2), (width - 1 - (context.shape[1] - body.shape[1]), 0))
        y = F.conv1d(padded, weight, bias, groups=body.shape[-1])
        outs.append(F.silu(y).transpose(1, 2))
    return torch.cat(outs, dim=1)


def gdn_forward(layer: Any, hidden_states: torch.Tensor, rows: RowLayout | None, kernel: str | None = None):
    """The Gated DeltaNet token mixer of ``layer`` (its ``in_proj``, ``conv1d``, ``A_log``, ``dt_bias``,
    ``out_norm``, ``out_proj``, ``sections`` and head sizes ``key_head_dim`` / ``value_head_dim``, as
    megatron-core's ``GatedDeltaNet`` names them) over [S, B, H] hidden states,
    for plain rows or one packed row's ``rows``; the recurrence on ``kernel`` (None: the device's default)."""
    from megatron.core.ssm.gated_delta_net import get_parameter_local_cp, tensor_a2a_cp2hp, tensor_a2a_hp2cp

    from model_support.core.megatron import context_parallel

    mixed, _ = layer.in_proj(hidden_states)  # [S, B, D]
    sections, conv, a_log, dt_bias = list(layer.sections), layer.conv1d.weight, layer.A_log, layer.dt_bias
    cp_group = context_parallel.group()
    if cp_group is not None:
        # Context parallel as megatron-core's GatedDeltaNet does it: all-to-all from sequence chunks to the
        # whole sequence for 1 / cp of the heads, and back after the output norm.
        if rows is not None:
            raise ValueError("a packed row under context parallelism needs THD attention")
        mixed = tensor_a2a_cp2hp(mixed, seq_dim=0, head_dim=-1, cp_group=cp_group, split_sections=sections)
        conv = get_parameter_local_cp(conv, 0, cp_group, split_sections=sections[:3])
        a_log, dt_bias = (get_parameter_local_cp(p, 0, cp_group) for p in (a_log, dt_bias))
        sections = [size // cp_group.size() for size in sections]
    mixed = mixed.transpose(0, 1)
    batch, seq, _ = mixed.shape
    q, k, v, z, b, a = torch.split(mixed, sections, dim=-1)
    qkv = causal_conv(torch.cat([q, k, v], dim=-1), conv, rows, layer.conv1d.bias)
    q, k, v = torch.split(qkv, sections[:3], dim=-1)
    q = q.reshape(batch, seq, -1, layer.key_head_dim)
    k = k.reshape(batch, seq, -1, layer.key_head_dim)
    v = v.reshape(batch, seq, -1, layer.value_head_dim)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    core = gated_delta_rule(q, k, v, g, b.sigmoid(), rows, kernel)
    normed = layer.out_norm(core.reshape(-1, layer.value_head_dim).float())
    gated = normed * F.silu(z.reshape(-1, layer.value_head_dim).float())
    gated = gated.to(hidden_states.dtype).reshape(batch, seq, -1).transpose(0, 1).contiguous()
    if cp_group is not None:
        gated = tensor_a2a_hp2cp(gated, seq_dim=0, head_dim=-1, cp_group=cp_group)
    return layer.out_proj(gated)


class LocalGatedDeltaNet(MegatronModule):
    """Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next) with megatron-core tensor-parallel linears."""

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None, **kwargs: Any) -> None:
        super().__init__(config)
        from megatron.core import parallel_state

        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.k_heads % self.tp or self.v_heads % self.tp:
            raise ValueError(f"GDN heads ({self.k_heads} key, {self.v_heads} value) do not split over TP={self.tp}")
        qk, vv = self.k_heads * self.key_head_dim, self.v_heads * self.value_head_dim
        self.sections = [qk // self.tp, qk // self.tp, vv // self.tp, vv // self.tp]
        self.sections += [self.v_heads // self.tp] * 2
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            sum(self.sections) * self.tp,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
        )
        conv_channels = (2 * qk + vv) // self.tp
        dtype = config.params_dtype  # as megatron-core's GatedDeltaNet holds them
        self.conv1d = torch.nn.Conv1d(
            conv_channels, conv_channels, config.linear_conv_kernel_dim, groups=conv_channels, bias=False, dtype=dtype
        )
        self.A_log = torch.nn.Parameter(torch.zeros(self.v_heads // self.tp, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.v_heads // self.tp, dtype=dtype))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            param.tensor_model_parallel = True
            param.partition_dim = 0
        self.out_norm = ZeroCenteredRMSNorm(config, self.value_head_dim, eps=config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            vv,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        self.rows: RowLayout | None = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, **kwargs: Any):
        return gdn_forward(self, hidden_states, self.rows)


# Every Gated DeltaNet module class the builder may place in a decoder layer.
GDN_MODULES = (LocalGatedDeltaNet, RoutedGatedDeltaNet)
