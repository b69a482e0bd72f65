"""LoRA targets read off a family's megatron-bridge mappings, for ``model-support new-handler``.

Every decoder-layer linear the bridge maps (``decoder.layers.*.<path>.<linear>.weight``) is a Megatron LoRA target;
the HF modules it covers are the weights its mapping reads (``q_proj``, ``k_proj``, ``v_proj`` for a ``QKVMapping``).
The scope follows the Megatron path (``self_attention`` / ``mlp`` / ``mlp.experts`` / ``mlp.shared_experts``; a
linear-attention layer's ``in_proj`` / ``out_proj`` is Gated DeltaNet). HF linear modules of the model that no
mapping reads are reported as unmapped, so the generated declaration never claims more than the bridge knows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from model_support.core import targets as standard
from model_support.core.errors import ModelSupportError
from model_support.core.layout import ModelLayout
from model_support.core.spec import LoraTarget, TargetScope

# Megatron's names for a linear module: linear_qkv, linear_fc1, linear_q_down_proj, ...; GDN's in_proj / out_proj.
_LINEAR = re.compile(r"^(linear_\w+|in_proj|out_proj)$")
_SCOPE_ORDER = (TargetScope.ATTENTION, TargetScope.GDN, TargetScope.MLP, TargetScope.EXPERT, TargetScope.SHARED_EXPERT)
# The standard target tuples, written by name in a generated declaration when they are exactly what the bridge maps.
_STANDARD = {
    "targets.ATTENTION": standard.ATTENTION,
    "targets.GATED_DELTANET": standard.GATED_DELTANET,
    "targets.DENSE_MLP": standard.DENSE_MLP,
    "targets.EXPERTS": standard.EXPERTS,
    "targets.SHARED_EXPERT": standard.SHARED_EXPERT,
}


class BridgeTargetsError(ModelSupportError):
    """The family's bridge cannot be read (megatron-bridge missing, or no bridge for the architecture)."""


@dataclass(frozen=True)
class BridgeTargets:
    """What a family's bridge maps: the LoRA targets, how to write them, and the HF linears it does not map."""

    bridge: str
    targets: tuple[LoraTarget, ...]
    unmapped: tuple[str, ...]

    def expression(self) -> str:
        """The ``lora_targets=`` expression: standard tuples by name, the rest as explicit ``LoraTarget`` entries."""
        parts = []
        for scope in _SCOPE_ORDER:
            group = tuple(t for t in self.targets if t.scope is scope)
            if not group:
                continue
            name = next((n for n, tuple_ in _STANDARD.items() if set(tuple_) == set(group)), None)
            parts.append(
                name
                or "("
                + "".join(f"LoraTarget({t.megatron!r}, {t.hf!r}, TargetScope.{t.scope.name}), " for t in group)
                + ")"
            )
        return " + ".join(parts)


def _scope(path: str, linear: str, layout: ModelLayout) -> TargetScope | None:
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


def bridge_targets(config: Any, layout: ModelLayout, hf_linears: set[str]) -> BridgeTargets:
    """The LoRA targets of ``config``'s family by its megatron-bridge mappings; ``hf_linears`` are the leaf names of
    the HF model's decoder-layer linear modules (those the bridge leaves unmapped are reported)."""
    try:
        from model_support.core.megatron.builder import MegatronBuildError, family_bridge

        model_bridge, tcfg = family_bridge(config)
    except ImportError as exc:
        missing = f"megatron-bridge is not installed ({exc}); pip install 'model-support[megatron]'"
        raise BridgeTargetsError(missing) from None
    except MegatronBuildError as exc:
        raise BridgeTargetsError(str(exc)) from None
    model_bridge.hf_pretrained = SimpleNamespace(config=tcfg, generation_config=None)
    found: dict[tuple[TargetScope, str], list[str]] = {}
    for mapping in model_bridge.mapping_registry().mappings:
        # Per-expert (local_experts.*.linear_fc1.weight) and grouped-GEMM (experts.linear_fc1.weight*) names alike.
        match = re.match(r"^decoder\.layers\.\*\.(.+)\.(\w+)\.weight\*?$", mapping.megatron_param)
        if not match or not _LINEAR.match(match.group(2)):
            continue
        path, linear = match.group(1) + ".", match.group(2)
        scope = _scope(path, linear, layout)
        if scope is None:
            continue
        hf = mapping.hf_param if isinstance(mapping.hf_param, dict) else {"": mapping.hf_param}
        names = found.setdefault((scope, linear), [])
        names += [m for m in map(_hf_module, hf.values()) if m not in names]
    order = {scope: i for i, scope in enumerate(_SCOPE_ORDER)}
    # A bridge maps every variant of its family (DeepSeek's q_proj where q_lora_rank is None); keep what this
    # config's model has. Experts are fused parameters in transformers, not linear modules: kept as mapped.
    result = tuple(
        LoraTarget(linear, tuple(names), scope)
        for (scope, linear), names in sorted(found.items(), key=lambda item: order[item[0][0]])
        if scope is TargetScope.EXPERT or hf_linears & set(names)
    )
    mapped = {name for target in result for name in target.hf}
    return BridgeTargets(type(model_bridge).__name__, result, tuple(sorted(hf_linears - mapped)))
