"""Numbers that one checkpoint's config decides: layers, GDN layout, MoE, MTP."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from model_support.core.errors import ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# A config's layer_types entries that name the two layer kinds model-support builds.
_LAYER_KINDS = {FULL_ATTENTION: FULL_ATTENTION, LINEAR_ATTENTION: LINEAR_ATTENTION}

# Multi-token-prediction depth, under the names the config families use.
_MTP_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


@dataclass(frozen=True)
class MoELayout:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    # Layers with a dense MLP instead of experts.
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


@dataclass(frozen=True)
class ConfigFields:
    """Where one family's config keeps what its layer layout needs (transformers' common names by default).

    A handler declares only what its family names otherwise; a value that no single field holds is a function of
    the (text) config.
    """

    # The expert count: the first of these fields that is set (absent or 0: a dense model).
    experts: tuple[str, ...] = ("num_experts", "num_local_experts")
    experts_per_token: str = "num_experts_per_tok"
    expert_intermediate_size: str = "moe_intermediate_size"
    # The shared expert's width (None: the family has none).
    shared_expert_intermediate_size: str | Callable[[Any], int] | None = None
    # Layers of an MoE model that have a dense MLP instead of experts (None: none).
    dense_layers: Callable[[Any], Iterable[int]] | None = None
    # layer_types entries -> the kind model-support builds (e.g. a sliding-window layer is full attention).
    layer_kinds: Mapping[str, str] = field(default_factory=lambda: dict(_LAYER_KINDS))
    # Fields listing layer indices, and fields counting layers, that a replica cut to fewer layers must follow.
    layer_lists: tuple[str, ...] = ()
    layer_counts: tuple[str, ...] = ()

    def expert_field(self, value: Callable[[str], Any]) -> str | None:
        """The field holding a nonzero expert count (None: dense); ``value`` reads a field of the config (``dict.get``
        of a config.json section, or an attribute of a transformers config)."""
        return next((name for name in self.experts if value(name)), None)


def _required(cfg: Any, name: str, why: str) -> Any:
    value = getattr(cfg, name, None)
    if value is None:
        raise ConfigError(
            f"config has no {name}, which {why}; add it to config.json or declare where the family "
            "keeps it (HandlerSpec.config_fields)"
        )
    return value


def derive_layout(config: Any, fields: ConfigFields | None = None) -> ModelLayout:
    """Read the layer layout of a transformers config, where ``fields`` (the handler's) say the numbers are."""
    fields = fields or ConfigFields()
    cfg = text_config(config)
    num_layers = int(_required(cfg, "num_hidden_layers", "every decoder config needs"))
    raw_types = getattr(cfg, "layer_types", None) or [FULL_ATTENTION] * num_layers
    if len(raw_types) != num_layers:
        raise ConfigError(f"config has {num_layers} layers but {len(raw_types)} layer_types; list one kind per layer")
    unknown = sorted(set(raw_types) - set(fields.layer_kinds))
    if unknown:
        raise ConfigError(
            f"config has layer_types {unknown}; the handler knows {sorted(fields.layer_kinds)} "
            "(declare the others in HandlerSpec.config_fields.layer_kinds)"
        )
    layer_types = tuple(fields.layer_kinds[t] for t in raw_types)

    moe = None
    expert_field = fields.expert_field(lambda name: getattr(cfg, name, None))
    if expert_field:
        num_experts = int(getattr(cfg, expert_field))
        why = f"an MoE config ({num_experts} experts in {expert_field}) needs"
        shared = fields.shared_expert_intermediate_size
        if isinstance(shared, str):
            shared = getattr(cfg, shared, 0)
        elif callable(shared):
            shared = shared(cfg)
        moe = MoELayout(
            num_experts=num_experts,
            top_k=int(_required(cfg, fields.experts_per_token, why)),
            expert_intermediate_size=int(_required(cfg, fields.expert_intermediate_size, why)),
            shared_expert_intermediate_size=int(shared or 0),
            dense_layers=tuple(sorted(set(fields.dense_layers(cfg)))) if fields.dense_layers else (),
        )
    return ModelLayout(num_layers=num_layers, layer_types=layer_types, moe=moe, mtp_layers=mtp_layers(config))


# Gated DeltaNet kernels carry the recurrent state between chunks of this many tokens (kernels.gdn.CHUNK_SIZE, fla's
# BT): a row of three chunks and one token crosses two chunk boundaries and starts a fourth chunk.
GDN_CHUNK = 64
# A long row on a GPU at real width is at least this long (RL rows are 1k-32k tokens).
REAL_WIDTH_LONG_ROW = 4096


def sliding_window(config: Any) -> int | None:
    """The sliding-attention window of the text config, None when no layer uses one (Qwen3's ``sliding_window``
    with ``use_sliding_window`` false is not a window)."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    kinds = getattr(cfg, "layer_types", None)
    if kinds and not any("sliding" in str(kind) for kind in kinds):
        return None
    return int(window)


def scaled_ropes(config: Any) -> dict[str | None, dict[str, Any]]:
    """The text config's scaled rotary embeddings (``rope_parameters`` or the older ``rope_scaling``): their parameters
    by the layer type they apply to (None: every layer), empty when the rotary embedding is plain (``rope_type``
    default, or no rotary parameters at all)."""
    cfg = text_config(config)
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(cfg, name, None)
        if not isinstance(value, Mapping):
            continue
        # Gemma 3 keeps one dict per attention kind ({"full_attention": {...}, "sliding_attention": {...}}).
        nested = {kind: p for kind, p in value.items() if isinstance(p, Mapping)}
        scaled = {
            kind: dict(p)
            for kind, p in (nested or {None: value}).items()
            if p.get("rope_type", p.get("type", "default")) not in (None, "default")
        }
        if scaled:
            return scaled
    return {}


def rope_scaling(config: Any) -> dict[str, Any] | None:
    """The parameters of the config's first scaled rotary embedding (:func:`scaled_ropes`), None when none is."""
    return next(iter(scaled_ropes(config).values()), None)


def length_structures(config: Any, layout: ModelLayout) -> dict[str, int]:
    """Each length-dependent structure of the model, with the shortest row that crosses it: ``gdn_chunks`` (three
    chunk boundaries of the GDN recurrence), ``sliding_window`` (window + 1: a query past the window), ``rope_scaling``
    (one position past ``original_max_position_embeddings``, where YaRN / dynamic NTK / Llama 3 scaling starts)."""
    out: dict[str, int] = {}
    if layout.gdn_layers:
        out["gdn_chunks"] = 3 * GDN_CHUNK + 1
    window = sliding_window(config)
    if window:
        out["sliding_window"] = window + 1
    rope = rope_scaling(config)
    original = (rope or {}).get("original_max_position_embeddings")
    if original:
        out["rope_scaling"] = int(original) + 1
    return out


def long_row_length(config: Any, layout: ModelLayout, *, floor: int = 0) -> int:
    """The length of a row that crosses every length-dependent structure (:func:`length_structures`) and is at least
    ``floor`` tokens (one GDN chunk and one token when the model has none)."""
    return max([GDN_CHUNK + 1, floor, *length_structures(config, layout).values()])
