"""The LoRA linears megatron-bridge maps for one config, read off the family's own mapping registry.

Every decoder-layer parameter mapping whose Megatron module is a LoRA linear (:data:`~model_support.core.spec.
LORA_LINEAR`: ``decoder.layers.*.<path>.<linear>.weight``) gives one :class:`MappedLinear`: the Megatron module, its
scope (from the Megatron path: ``self_attention`` / ``mlp`` / ``mlp.experts`` / ``mlp.shared_experts``; a
linear-attention layer's ``in_proj`` / ``out_proj`` is Gated DeltaNet) and the HF weights the mapping reads
(``q_proj``, ``k_proj``, ``v_proj`` for a ``QKVMapping``) - the same mappings the codec splits LoRA tensors with and
the builder loads weights with. ``model-support new-handler`` writes its declaration from them; the `architecture`
stage checks a declaration against them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from model_support.core.layout import ModelLayout
from model_support.core.spec import LORA_LINEAR, TargetScope

# A decoder-layer weight: per-expert (local_experts.*.linear_fc1.weight) and grouped-GEMM (experts.linear_fc1.weight*)
# names alike.
_DECODER_WEIGHT = re.compile(r"^decoder\.layers\.\*\.(.+)\.(\w+)\.weight\*?$")
# megatron-core's MoE router weight, which a bridge maps from the family's own router (or gate) module.
_ROUTER_WEIGHT = "decoder.layers.*.mlp.router.weight"


@dataclass(frozen=True)
class MappedLinear:
    """One LoRA linear of the family's Megatron layers and the HF weights its bridge mapping reads."""

    megatron: str  # the Megatron module's leaf name (linear_fc1)
    scope: TargetScope
    hf: tuple[str, ...]  # the HF modules' leaf names, in the mapping's order (gate_proj, up_proj)
    hf_params: tuple[str, ...]  # the HF weight names, ``*`` for a layer or expert number
    mapping: str  # the mapping's class (GatedMLPMapping)

    @property
    def key(self) -> tuple[str, TargetScope]:
        return self.megatron, self.scope


def linear_scope(path: str, linear: str, layout: ModelLayout) -> TargetScope | None:
    """The scope of the Megatron linear ``<path>.<linear>`` of a decoder layer (``path`` ends with a dot)."""
    if path.startswith("mlp.shared_experts."):
        return TargetScope.SHARED_EXPERT
    if path.startswith("mlp.experts."):
        return TargetScope.EXPERT
    if path.startswith("mlp."):
        return TargetScope.MLP
    if path.startswith("self_attention."):
        return TargetScope.GDN if layout.gdn_layers and linear in ("in_proj", "out_proj") else TargetScope.ATTENTION
    return None


def _hf_module(name: str) -> str:
    """``model.layers.*.self_attn.q_proj.weight`` -> ``q_proj``."""
    return name.removesuffix(".weight").rsplit(".", 1)[-1]


def mapped_linears(mappings: Iterable[Any], layout: ModelLayout) -> tuple[MappedLinear, ...]:
    """The LoRA linears among a bridge's ``mappings``, one per (Megatron linear, scope), in mapping order."""
    found: dict[tuple[str, TargetScope], tuple[dict[str, None], dict[str, None], str]] = {}
    for mapping in mappings:
        match = _DECODER_WEIGHT.match(mapping.megatron_param)
        if not match or not LORA_LINEAR.match(match.group(2)):
            continue
        linear = match.group(2)
        scope = linear_scope(match.group(1) + ".", linear, layout)
        if scope is None:
            continue
        params = mapping.hf_param if isinstance(mapping.hf_param, dict) else {"": mapping.hf_param}
        names, hf_params, _ = found.setdefault((linear, scope), ({}, {}, type(mapping).__name__))
        names.update(dict.fromkeys(map(_hf_module, params.values())))
        hf_params.update(dict.fromkeys(params.values()))
    return tuple(
        MappedLinear(linear, scope, tuple(names), tuple(hf_params), kind)
        for (linear, scope), (names, hf_params, kind) in found.items()
    )


def bridge_linears(config: Any, layout: ModelLayout, checkpoint: Any = None) -> tuple[str, tuple[MappedLinear, ...]]:
    """(the bridge's class name, the LoRA linears it maps) for ``config``'s family.

    Without ``checkpoint`` the mappings are the codec's (a bridge that picks expert mappings by the checkpoint's
    keys takes its per-expert default: how PEFT and vLLM address experts); with one (a
    :class:`~model_support.core.checkpoint.TextCheckpoint`) they are those the builder loads that checkpoint with.
    Raises :class:`~model_support.core.megatron.imports.MegatronUnavailableError` without megatron-bridge and
    :class:`~model_support.core.megatron.builder.MegatronBuildError` where it has no bridge for the architecture.
    """
    bridge, mappings = _bridge_mappings(config, checkpoint)
    return bridge, mapped_linears(mappings, layout)


def _bridge_mappings(config: Any, checkpoint: Any = None) -> tuple[str, list[Any]]:
    """(the bridge's class name, its parameter mappings) for ``config``'s family (see :func:`bridge_linears`)."""
    from model_support.core.megatron.builder import family_bridge, mapping_registry
    from model_support.core.megatron.state_source import hf_pretrained

    model_bridge, tcfg = family_bridge(config)
    model_bridge.hf_pretrained = hf_pretrained(tcfg, checkpoint)
    return type(model_bridge).__name__, list(mapping_registry(model_bridge).mappings)


def router_modules(mappings: Iterable[Any]) -> tuple[str, ...]:
    """The HF modules a bridge's ``mappings`` load megatron-core's MoE router from, as paths inside a decoder layer
    (``model.layers.*.mlp.gate.weight`` -> ``mlp.gate``)."""
    found: dict[str, None] = {}
    for mapping in mappings:
        if mapping.megatron_param == _ROUTER_WEIGHT and isinstance(mapping.hf_param, str):
            found[mapping.hf_param.split("layers.*.", 1)[-1].removesuffix(".weight")] = None
    return tuple(found)


def bridge_routers(config: Any) -> tuple[str, ...]:
    """:func:`router_modules` of ``config``'s family bridge (the same errors as :func:`bridge_linears`)."""
    return router_modules(_bridge_mappings(config)[1])
