"""Local (transformer-engine free) layer specs that run on CPU and GPU alike.

Two local-spec modules of megatron-core do not fit: ``DotProductAttention`` takes its score buffer from
a CUDA-only global memory buffer, and ``WrappedTorchNorm`` refuses zero-centred gamma (Qwen3.5's norms).
:class:`SDPAttention` and :class:`ZeroCenteredRMSNorm` (``norms.py``) replace them; everything else is megatron-core's
own local spec (ColumnParallelLinear / RowParallelLinear, SelfAttention with q/k norm and output gate or
multi-latent attention, MoE SequentialMLP), laid out per layer by megatron-core's own block spec.
:class:`PostNormRowParallelLinear` is the local twin of megatron-bridge's ``TERowParallelLinearLayerNorm`` (a norm
on a projection's output), for a family's own layer spec.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from model_support.core.megatron.norms import LocalRMSNorm as LocalRMSNorm  # re-exported for families' layer specs
from model_support.core.megatron.norms import ZeroCenteredRMSNorm, local_norm
from model_support.core.megatron.rows import RowLayout


class SDPAttention(MegatronModule):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (megatron layout).

    ``attention_mask`` (boolean, True = masked, broadcastable to [B, H, S, S]) is honoured when given; without it
    attention is causal. A packed row's layout (``rows``, set by
    :func:`model_support.core.megatron.forward.packed_rows`) is attended block by block, never through a [S, S]
    mask. ``softmax_scale`` is the one
    the parent attention passes (multi-latent attention's includes the yarn mscale), else the config's, else
    1/sqrt(kv_channels). Keys and values are shared by ``heads / key heads`` queries each (GQA); multi-latent
    attention gives one key head per query head.
    ``window`` (a ModuleSpec param) makes it sliding-window attention: query ``i`` sees keys ``i - window + 1 .. i``
    (transformers' ``sliding_window``, transformer-engine's ``window_size=(window - 1, 0)``).
    The config's ``softmax_type`` is megatron-core's: ``"learnable"`` gives each head a sink, ``softmax_offset``
    (gpt-oss's ``sinks``), a logit that joins every query's softmax with no value; ``"off-by-one"`` a sink of 0.
    ``softcap`` (a ModuleSpec param) caps every score as ``softcap * tanh(score / softcap)`` before the softmax
    (Gemma 2's ``attn_logit_softcapping``).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        softmax_scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ):
        super().__init__(config)
        self.scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must hold at least one key, got {window}")
        self.window = window
        if softcap is not None and (softcap <= 0 or config.softmax_type != "vanilla"):
            raise ValueError(f"a score soft-cap must be positive and without attention sinks, got {softcap}")
        self.softcap = softcap
        self.rows: RowLayout | None = None  # a packed row's layout, set around a forward
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        if config.softmax_type == "vanilla":
            self.softmax_offset: torch.Tensor | None = None
        elif config.softmax_type == "learnable":  # this rank's heads' sinks (split by heads, as the bridge shards them)
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype), persistent=False)
        else:
            raise ValueError(f"softmax_type {config.softmax_type!r}: vanilla, off-by-one or learnable")

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None
    ) -> torch.Tensor:
        """SDPA of [B, H, S, D] blocks, causal without ``visible`` (True = a query may see a key). With sinks, each
        head's sink is one more key, scoring its ``softmax_offset`` against every query and carrying a zero value: an
        extra query channel of 1 meets the sink key's channel of ``offset / scale`` (0 on the other keys)."""
        if self.softcap is None and self.softmax_offset is None:
            if visible is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scale)
        (batch, heads, sq, _), sk = q.shape, k.shape[2]
        if visible is None:
            visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        if self.softcap is not None:
            return self._capped(q, k, v, visible)
        sink = (self.softmax_offset.to(k.dtype) / self.scale).reshape(1, heads, 1, 1).expand(batch, -1, 1, 1)
        q = torch.cat([q, q.new_ones(batch, heads, sq, 1)], dim=-1)
        k = torch.cat([torch.cat([k, k.new_zeros(batch, heads, sk, 1)], dim=-1), F.pad(sink, (k.shape[-1], 0))], dim=2)
        v = torch.cat([v, v.new_zeros(batch, heads, 1, v.shape[-1])], dim=2)
        visible = torch.cat(
            [visible.expand(*visible.shape[:-2], sq, sk), visible.new_ones(*visible.shape[:-2], sq, 1)], -1
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scale)

    def _capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Attention with soft-capped scores, written out: SDPA has no hook between the scores and the softmax.
        The softmax in fp32, as megatron-core's softmax of bf16 scores."""
        assert self.softcap is not None
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = self.softcap * torch.tanh(scores / self.softcap)
        probs = torch.softmax(scores.float().masked_fill(~visible, float("-inf")), dim=-1)
        return torch.matmul(probs.to(v.dtype), v)

    def _mask(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """True where a query may not see a key: a later one, or one outside the sliding window."""
        distance = query_positions[:, None] - key_positions[None, :]
        outside = distance < 0
        return outside | (distance >= self.window) if self.window is not None else outside

    def _by_segment(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: RowLayout) -> torch.Tensor:
        """[B, H, S, D] attention of a packed row block by block: each sequence (or prompt) causally, each
        completion against its prompt and itself; no block crosses a sequence."""
        positions = rows.positions_on(q.device)
        outs = []
        for group in rows.groups:
            prompt = group[0]
            for segment in group:
                span = slice(segment.start, segment.end)
                keys = [span] if segment is prompt else [slice(prompt.start, prompt.end), span]
                key_positions = torch.cat([positions[s] for s in keys])
                sk, sv = (torch.cat([t[:, :, s] for s in keys], dim=2) for t in (k, v))
                if self.window is None and segment is prompt:
                    outs.append(self._attend(q[:, :, span], sk, sv))
                else:
                    outs.append(self._attend(q[:, :, span], sk, sv, ~self._mask(positions[span], key_positions)))
        return torch.cat(outs, dim=2)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kwargs):
        from model_support.core.megatron import context_parallel

        seq, batch = query.shape[0], query.shape[1]
        positions = None  # of queries and keys in the whole sequence, where they are not 0..S-1 alike
        cp_group = context_parallel.group()
        if cp_group is not None:
            # Context parallel: this rank's queries attend to every rank's keys, gathered in sequence order.
            if attention_mask is not None:
                raise ValueError("a packed (masked) row under context parallelism needs THD attention")
            total = seq * cp_group.size()
            key, value = context_parallel.gather_keys(key, cp_group), context_parallel.gather_keys(value, cp_group)
            positions = (
                context_parallel.local_positions(total, cp_group, query.device),
                torch.arange(key.shape[0], device=query.device),
            )
        elif self.window is not None:
            positions = (torch.arange(seq, device=query.device),) * 2
        # [S, B, H, D] -> [B, H, S, D]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if q.shape[1] > k.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if self.rows is not None:
            if cp_group is not None:
                raise ValueError("a packed row under context parallelism needs THD attention")
            out = self._by_segment(q, k, v, self.rows)
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
        if positions is not None:
            outside = self._mask(*positions)
            attention_mask = outside if attention_mask is None else attention_mask | outside
        out = self._attend(q, k, v, None if attention_mask is None else ~attention_mask)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


class PostNormRowParallelLinear(RowParallelLinear):
    """A RowParallelLinear whose output goes through a zero-centred RMSNorm, ``post_layernorm``.

    megatron-bridge maps such norms as ``<linear>.post_layernorm.weight`` (its ``TERowParallelLinearLayerNorm``,
    transformer-engine only). :meth:`project` is the linear alone: a LoRA update joins the projection before
    the norm (:class:`~model_support.core.megatron.lora.LoraLinear` uses it).
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = ZeroCenteredRMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, bias = super().forward(x)
        if bias is not None:
            raise ValueError("a post-norm projection cannot defer its bias past the norm (add_bias_linear=False)")
        return out, None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, _ = self.project(x)
        return self.post_layernorm(out), None


def _localize(spec: ModuleSpec, config: Any) -> ModuleSpec:
    """Put model-support's CPU-capable modules into one megatron-core local layer spec (in place)."""
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    norm = local_norm(config)
    if norm is not None:
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        attention = spec.submodules.self_attention.submodules
        # q/k norms of self-attention, q/kv norms of multi-latent attention: those the spec builds.
        # megatron-core's spec fills an absent norm with IdentityOp (its sequence-parallel check refuses a real norm
        # there when the config has no q/k norm).
        for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
            if getattr(attention, name, None) not in (None, IdentityOp):
                setattr(attention, name, norm)
    return spec


def _base_layer(config: Any) -> ModuleSpec:
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    return _localize(spec, config)


def gpt_block_spec(config: Any, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Local specs of every decoder layer by megatron-core's own GPT block spec: dense or MoE by the config's
    ``moe_layer_freq``, self-attention or multi-latent attention by ``multi_latent_attention``."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
    )
    for spec in {id(s): s for s in block.layer_specs}.values():
        _localize(spec, config)
    block.layer_specs = _windowed(config, block.layer_specs, vp_stage)
    block.layer_norm = local_norm(config) or block.layer_norm
    return block


def _windowed(config: Any, specs: list[ModuleSpec], vp_stage: int | None) -> list[ModuleSpec]:
    """This stage's layer specs with sliding-window attention where the provider asks for it: ``window_size``
    ``(left, 0)`` (a query sees itself and ``left`` keys before it) on the layers ``window_attn_skip_freq`` picks, by
    megatron-core's own rule (every layer when it is unset)."""
    window = getattr(config, "window_size", None)
    if not window:
        return specs
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.transformer.utils import is_layer_window_attention

    left, right = window
    if right != 0:
        raise ValueError(f"window_size {tuple(window)}: a decoder attends to no later token, so the right side is 0")
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    out = []
    for index, spec in enumerate(specs):
        if is_layer_window_attention(window, config.window_attn_skip_freq, offset + index + 1):
            spec = copy.deepcopy(spec)
            attention = spec.submodules.self_attention.submodules
            attention.core_attention = ModuleSpec(module=SDPAttention, params={"window": left + 1})
        out.append(spec)
    return out


def stage_layers(config: Any, layers: list[ModuleSpec], vp_stage: int | None = None) -> list[ModuleSpec]:
    """The specs of this pipeline stage's layers (this rank, virtual stage ``vp_stage``), out of one spec per layer
    of the whole model: megatron-core's ``TransformerBlock`` builds every spec it is given."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return layers[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]


def hybrid_block_spec(
    config: Any, vp_stage: int | None = None, *, gdn_kernel: str | None = None
) -> TransformerBlockSubmodules:
    """Per-layer local specs: Gated DeltaNet or full attention by the bridge's linear-attention pattern.

    ``gdn_kernel`` given: megatron-core's ``GatedDeltaNet`` with its recurrence on that kernel (GPU, fla
    installed); ``None``: :class:`~model_support.core.megatron.gdn.LocalGatedDeltaNet`.
    """
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from model_support.core.megatron.gdn import LocalGatedDeltaNet, RoutedGatedDeltaNet

    if gdn_kernel is None:
        gdn = ModuleSpec(module=LocalGatedDeltaNet)
    else:
        # The input norm stays the layer's own module (the local spec does not fuse it into in_proj).
        gdn = ModuleSpec(
            module=RoutedGatedDeltaNet,
            params={"kernel": gdn_kernel},
            submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear
            ),
        )
    base = _base_layer(config)
    layers = []
    for kind in get_linear_attention_pattern(config):
        spec = copy.deepcopy(base)
        if kind == 1:
            spec.submodules.self_attention = gdn
        layers.append(spec)
    final_norm = local_norm(config) or base.submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=stage_layers(config, layers, vp_stage), layer_norm=final_norm)
