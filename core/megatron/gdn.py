"""Local-spec (transformer-engine and fla free) Gated DeltaNet hybrid layers for megatron-core.

megatron-core's ``GatedDeltaNet`` allocates on ``torch.cuda.current_device()`` and calls fla's triton
kernels, so it cannot run on CPU. :class:`LocalGatedDeltaNet` is the same layer with the same parameter
names (``in_proj``, ``conv1d``, ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``), so megatron-bridge's
Qwen3.5 mappings (GDNLinearMappingSeparate, GDNConv1dMapping, RMSNorm2ZeroCenteredRMSNormMapping) fill
it unchanged. The recurrence runs through ``model_support.kernels.gdn.chunk_gated_delta_rule`` with the
row's ``cu_seqlens`` (set by :func:`model_support.core.megatron.forward.gdn_packing`), and the causal
convolution restarts at every sequence boundary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from model_support.core.megatron.spec import ZeroCenteredRMSNorm


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: Any
) -> torch.Tensor:
    """[B, S, HV, D] gated delta rule (q/k l2-normalised, grouped heads), state restarting at each boundary."""
    from model_support.kernels.gdn import chunk_gated_delta_rule

    out, _ = chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=False, use_qk_l2norm=True
    )
    return out


def causal_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution + SiLU over [B, S, C], zero left-padding at every sequence start."""
    width = weight.shape[-1]
    starts = [0] if cu_seqlens is None else cu_seqlens[:-1].tolist()
    ends = [x.shape[1]] if cu_seqlens is None else cu_seqlens[1:].tolist()
    outs = []
    for start, end in zip(starts, ends, strict=True):
        seg = x[:, start:end].transpose(1, 2)
        y = F.conv1d(F.pad(seg, (width - 1, 0)), weight, groups=seg.shape[1])
        outs.append(F.silu(y).transpose(1, 2))
    return torch.cat(outs, dim=1)


class LocalGatedDeltaNet(MegatronModule):
    """Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next) with megatron-core tensor-parallel linears."""

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None, **kwargs: Any) -> None:
        super().__init__(config)
        from megatron.core import parallel_state

        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.k_heads % self.tp or self.v_heads % self.tp:
            raise ValueError(f"GDN heads ({self.k_heads} key, {self.v_heads} value) do not split over TP={self.tp}")
        qk, vv = self.k_heads * self.k_dim, self.v_heads * self.v_dim
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
        self.conv1d = torch.nn.Conv1d(
            conv_channels, conv_channels, config.linear_conv_kernel_dim, groups=conv_channels, bias=False
        )
        self.A_log = torch.nn.Parameter(torch.zeros(self.v_heads // self.tp))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.v_heads // self.tp))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            param.tensor_model_parallel = True
            param.partition_dim = 0
        self.out_norm = ZeroCenteredRMSNorm(config, self.v_dim, eps=config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            vv,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        self.cu_seqlens: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, **kwargs: Any):
        mixed, _ = self.in_proj(hidden_states)  # [S, B, D]
        mixed = mixed.transpose(0, 1)
        batch, seq, _ = mixed.shape
        q, k, v, z, b, a = torch.split(mixed, self.sections, dim=-1)
        qkv = causal_conv(torch.cat([q, k, v], dim=-1), self.conv1d.weight, self.cu_seqlens)
        q, k, v = torch.split(qkv, self.sections[:3], dim=-1)
        q = q.reshape(batch, seq, -1, self.k_dim)
        k = k.reshape(batch, seq, -1, self.k_dim)
        v = v.reshape(batch, seq, -1, self.v_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = gated_delta_rule(q, k, v, g, b.sigmoid(), self.cu_seqlens)
        normed = self.out_norm(core.reshape(-1, self.v_dim).float())
        gated = normed * F.silu(z.reshape(-1, self.v_dim).float())
        gated = gated.to(hidden_states.dtype).reshape(batch, seq, -1).transpose(0, 1).contiguous()
        return self.out_proj(gated)
