"""Up-front checks of a config.json, before transformers or any builder sees it.

transformers validates configs lazily and raises its own exception types (``StrictDataclass...``
validation errors, IndexErrors, or none at all while it allocates a billion layers); these checks turn
the ordinary mistakes into one line naming the field, what it holds and what is allowed. The maxima are
sanity bounds well above every released checkpoint, not limits of the project.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_support.core.errors import ConfigError
from model_support.core.tiny import text_section

# Integer fields of a text config: (smallest, largest) allowed value.
_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 24),
    "num_experts": (1, 4096),
    "num_local_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 20),
    "linear_num_key_heads": (1, 1024),
    "linear_num_value_heads": (1, 1024),
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_conv_kernel_dim": (1, 64),
    "max_position_embeddings": (1, 1 << 24),
}


def _int_field(text: Mapping[str, Any], name: str, where: str) -> int | None:
    value = text.get(name)
    if value is None:
        return None
    low, high = _BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: `{name}` must be an integer, got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ConfigError(f"{where}: `{name}` is {value}; it must be between {low} and {high}")
    return value


def check_config(raw: dict[str, Any], where: str) -> None:
    """Raise :class:`ConfigError` (one line) for a config.json dict a model cannot be built from.

    ``where`` names the file in the message.
    """
    archs = raw.get("architectures")
    if archs is not None and (
        not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs)
    ):
        raise ConfigError(
            f'{where}: `architectures` must be a non-empty list of class names, e.g. ["Qwen3ForCausalLM"]; '
            f"got {archs!r}"
        )
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"{where}: `model_type` must be a string, got {model_type!r}")
    if "text_config" in raw and not isinstance(raw["text_config"], dict | type(None)):
        raise ConfigError(f"{where}: `text_config` must be an object, got {type(raw['text_config']).__name__}")
    text = text_section(raw)
    values = {name: _int_field(text, name, where) for name in _BOUNDS}
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
    if heads and kv_heads and heads % kv_heads:
        raise ConfigError(
            f"{where}: `num_attention_heads` ({heads}) is not a multiple of `num_key_value_heads` ({kv_heads})"
        )
    hidden = values["hidden_size"]
    if heads and hidden and values["head_dim"] is None and hidden % heads:
        raise ConfigError(
            f"{where}: `hidden_size` ({hidden}) is not a multiple of `num_attention_heads` ({heads}) and no "
            "`head_dim` is given"
        )
    k_heads, v_heads = values["linear_num_key_heads"], values["linear_num_value_heads"]
    if k_heads and v_heads and v_heads % k_heads:
        raise ConfigError(
            f"{where}: `linear_num_value_heads` ({v_heads}) is not a multiple of `linear_num_key_heads` ({k_heads})"
        )
    experts = values["num_experts"] or values["num_local_experts"]
    top_k = values["num_experts_per_tok"]
    if experts and top_k and top_k > experts:
        raise ConfigError(f"{where}: `num_experts_per_tok` ({top_k}) is larger than the number of experts ({experts})")
    layer_types = text.get("layer_types")
    layers = values["num_hidden_layers"]
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ConfigError(f"{where}: `layer_types` must be a list of strings, got {layer_types!r}")
        if layers is not None and len(layer_types) != layers:
            raise ConfigError(
                f"{where}: `layer_types` lists {len(layer_types)} layers but `num_hidden_layers` is {layers}"
            )
