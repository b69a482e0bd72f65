"""LoRA targets read off a family's megatron-bridge mappings, for ``model-support new-handler``.

Every decoder-layer LoRA linear the bridge maps (:func:`model_support.core.bridge_linears.bridge_linears`) is a
Megatron LoRA target; the HF modules it covers are the weights its mapping reads (``q_proj``, ``k_proj``, ``v_proj``
for a ``QKVMapping``). HF linear modules of the model that no mapping reads are reported as unmapped, so the generated
declaration never claims more than the bridge knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from model_support.core import targets as standard
from model_support.core.errors import ModelSupportError
from model_support.core.layout import ModelLayout
from model_support.core.megatron.imports import MegatronUnavailableError
from model_support.core.spec import LoraTarget, TargetScope

_SCOPE_ORDER = (TargetScope.ATTENTION, TargetScope.GDN, TargetScope.MLP, TargetScope.EXPERT, TargetScope.SHARED_EXPERT)
# The standard target tuples, written by name in a generated declaration when they are exactly what the bridge maps.
_STANDARD = {
    "targets.ATTENTION": standard.ATTENTION,
    "targets.GATED_DELTANET": standard.GATED_DELTANET,
    "targets.DENSE_MLP": standard.DENSE_MLP,
    "targets.EXPERTS": standard.EXPERTS,
    "targets.SHARED_EXPERT": standard.SHARED_EXPERT,
}


def _names(names: tuple[str, ...]) -> str:
    """A tuple of names as ruff formats it: ``("w2",)``, ``("w1", "w3")``."""
    return "(" + ", ".join(map(json.dumps, names)) + ("," if len(names) == 1 else "") + ")"


class BridgeTargetsError(ModelSupportError):
    """The family's bridge cannot be read (megatron-bridge missing, or no bridge for the architecture)."""


@dataclass(frozen=True)
class BridgeTargets:
    """What a family's bridge maps: the LoRA targets, how to write them, and the HF linears it does not map."""

    bridge: str
    targets: tuple[LoraTarget, ...]
    unmapped: tuple[str, ...]

    def _groups(self) -> list[tuple[TargetScope, str | None, tuple[LoraTarget, ...]]]:
        """Per scope (in declaration order): the standard tuple's name that is exactly its targets, or None."""
        out = []
        for scope in _SCOPE_ORDER:
            group = tuple(sorted((t for t in self.targets if t.scope is scope), key=lambda t: t.megatron))
            if group:
                out.append((scope, next((n for n, t in _STANDARD.items() if set(t) == set(group)), None), group))
        return out

    def expression(self) -> str:
        """The ``lora_targets=`` expression: standard tuples by name, the others by the constants of
        :meth:`definitions`."""
        return " + ".join(name or f"{scope.name}_TARGETS" for scope, name, _ in self._groups())

    def definitions(self) -> str:
        """Module-level constants (``EXPERT_TARGETS = (LoraTarget(...), ...)``, one entry a line, each followed by two
        blank lines) for the scopes whose targets are no standard tuple."""
        out = []
        for scope, name, group in self._groups():
            if name is None:
                entries = "".join(
                    f"    LoraTarget({json.dumps(t.megatron)}, {_names(t.hf)}, TargetScope.{scope.name}),\n"
                    for t in group
                )
                out.append(f"{scope.name}_TARGETS = (\n{entries})\n\n\n")
        return "".join(out)


def bridge_targets(config: Any, layout: ModelLayout, hf_linears: set[str]) -> BridgeTargets:
    """The LoRA targets of ``config``'s family by its megatron-bridge mappings; ``hf_linears`` are the leaf names of
    the HF model's decoder-layer linear modules (those the bridge leaves unmapped are reported)."""
    from model_support.core.bridge_linears import bridge_linears

    try:
        from model_support.core.megatron.builder import MegatronBuildError

        bridge, linears = bridge_linears(config, layout)
    except (ImportError, MegatronUnavailableError) as exc:
        missing = f"megatron-bridge is not installed ({exc}); pip install 'model-support[megatron]'"
        raise BridgeTargetsError(missing) from None
    except MegatronBuildError as exc:
        raise BridgeTargetsError(str(exc)) from None
    order = {scope: i for i, scope in enumerate(_SCOPE_ORDER)}
    # A bridge maps every variant of its family (DeepSeek's q_proj where q_lora_rank is None); keep what this
    # config's model has. Experts are fused parameters in transformers, not linear modules: kept as mapped.
    result = tuple(
        LoraTarget(linear.megatron, linear.hf, linear.scope)
        for linear in sorted(linears, key=lambda linear: order[linear.scope])
        if linear.scope is TargetScope.EXPERT or hf_linears & set(linear.hf)
    )
    mapped = {name for target in result for name in target.hf}
    return BridgeTargets(bridge, result, tuple(sorted(hf_linears - mapped)))
