"""Numbers that one checkpoint's config decides: layers, GDN layout, MoE, MTP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_support.core.errors import ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# Multi-token-prediction depth, under the names the config families use.
_MTP_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


@dataclass(frozen=True)
class MoELayout:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    # Layers with a dense MLP instead of experts (Qwen3-MoE's mlp_only_layers / sparse step).
    dense_layers: tuple[int, ...] = ()

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0


@dataclass(frozen=True)
class ModelLayout:
    num_layers: int
    layer_types: tuple[str, ...]
    moe: MoELayout | None
    mtp_layers: int

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def describe(self) -> str:
        parts = [f"{self.num_layers} layers"]
        if self.gdn_layers:
            parts.append(f"{len(self.gdn_layers)} GDN + {len(self.attention_layers)} full attention")
        if self.moe:
            shared = ", shared expert" if self.moe.has_shared_expert else ""
            parts.append(f"MoE {self.moe.num_experts} experts top-{self.moe.top_k}{shared}")
        if self.mtp_layers:
            parts.append(f"{self.mtp_layers} MTP layer(s)")
        return ", ".join(parts)


def text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def mtp_layers(config: Any) -> int:
    """Multi-token-prediction layers declared by the config (top level or ``text_config``)."""
    for cfg in (text_config(config), config):
        for name in _MTP_FIELDS:
            value = getattr(cfg, name, None)
            if value:
                return int(value)
    return 0


def derive_layout(config: Any) -> ModelLayout:
    """Read the layer layout of a transformers config."""
    cfg = text_config(config)
    num_layers = int(cfg.num_hidden_layers)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        interval = getattr(cfg, "full_attention_interval", None)
        if interval:
            layer_types = [
                FULL_ATTENTION if (i + 1) % int(interval) == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(f"config has {num_layers} layers but {len(layer_types)} layer_types; list one kind per layer")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ConfigError(
            f"config has layer_types {unknown}; model-support knows {FULL_ATTENTION} and {LINEAR_ATTENTION}"
        )

    moe = None
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if num_experts:
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        mlp_only = set(getattr(cfg, "mlp_only_layers", None) or ())
        dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0)
        missing = [f for f in ("num_experts_per_tok", "moe_intermediate_size") if getattr(cfg, f, None) is None]
        if missing:
            raise ConfigError(
                f"config has {num_experts} experts but no {' or '.join(missing)}; an MoE config needs both "
                "(a family that names them otherwise needs its own handler)"
            )
        moe = MoELayout(
            num_experts=int(num_experts),
            top_k=int(cfg.num_experts_per_tok),
            expert_intermediate_size=int(cfg.moe_intermediate_size),
            shared_expert_intermediate_size=int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0),
            dense_layers=dense,
        )
    return ModelLayout(num_layers=num_layers, layer_types=tuple(layer_types), moe=moe, mtp_layers=mtp_layers(config))
