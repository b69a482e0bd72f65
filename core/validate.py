"""Checks a handler declaration against a model built from a config."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from model_support.core.errors import ModelSupportError
from model_support.core.layout import ModelLayout
from model_support.core.spec import HandlerSpec, LoraTarget, TargetScope, Topology

# The parent module each scope's HF modules live under, in transformers decoder layers.
SCOPE_PARENTS: dict[TargetScope, tuple[str, ...]] = {
    TargetScope.ATTENTION: ("self_attn",),
    TargetScope.GDN: ("linear_attn",),
    TargetScope.MLP: ("mlp",),
    TargetScope.SHARED_EXPERT: ("shared_expert", "shared_experts"),
    TargetScope.EXPERT: ("experts",),
}
# transformers >= 5 stores experts as fused 3-D parameters instead of per-expert modules.
_FUSED_EXPERT_PARAMS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def build_meta_model(config: Any) -> Any:
    """The model class named by the config's architectures, built without allocating weights."""
    import torch
    import transformers

    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        return cls(config)


def _present(target: LoraTarget, hf: str, modules: set[str], params: set[str]) -> bool:
    parents = "|".join(map(re.escape, SCOPE_PARENTS[target.scope]))
    if target.scope is TargetScope.EXPERT:
        per_expert = re.compile(rf"(^|\.)({parents})\.\d+\.{re.escape(hf)}$")
        fused = re.compile(rf"(^|\.)({parents})\.{_FUSED_EXPERT_PARAMS.get(hf, hf)}$")
        return any(per_expert.search(m) for m in modules) or any(fused.search(p) for p in params)
    pattern = re.compile(rf"(^|\.)({parents})\.{re.escape(hf)}$")
    return any(pattern.search(m) for m in modules)


def missing_targets(spec: HandlerSpec, model: Any) -> list[str]:
    """HF target modules the declaration names that the model does not have."""
    modules = {name for name, _ in model.named_modules()}
    params = {name for name, _ in model.named_parameters()}
    return [f"{t.scope}:{hf}" for t in spec.lora_targets for hf in t.hf if not _present(t, hf, modules, params)]


class TargetCoverageError(ModelSupportError):
    """LoRA tensors (an adapter) leave a declared target without any module."""


def uncovered_targets(spec: HandlerSpec, module_names: Iterable[str]) -> list[str]:
    """Declared HF targets (``scope:name``) that none of ``module_names`` (full module paths, as in a
    checkpoint's or an adapter's tensor names) addresses."""
    modules = set(module_names)
    return [f"{t.scope}:{hf}" for t in spec.lora_targets for hf in t.hf if not _present(t, hf, modules, set())]


def modules_under(scope: TargetScope, module_names: Iterable[str]) -> list[str]:
    """The distinct leaf module names found under ``scope``'s parents (e.g. ``w1, w2, w3`` under ``experts.N``)."""
    parents = "|".join(map(re.escape, SCOPE_PARENTS[scope]))
    pattern = re.compile(rf"(^|\.)({parents})(\.\d+)?\.(\w+)$")
    return sorted({m.group(4) for name in module_names if (m := pattern.search(name))})


def checkpoint_modules(tensor_names: Iterable[str]) -> set[str]:
    """Module paths of a checkpoint's (or adapter's) weight tensors: ``a.b.q_proj.weight`` -> ``a.b.q_proj``."""
    out = set()
    for name in tensor_names:
        for suffix in (".lora_A.weight", ".lora_B.weight", ".weight"):
            if name.endswith(suffix):
                out.add(name[: -len(suffix)])
                break
    return out


def layout_problems(spec: HandlerSpec, layout: ModelLayout) -> list[str]:
    """Where the declaration's topology disagrees with what the config describes."""
    problems = []
    if spec.topology is Topology.MOE and layout.moe is None:
        problems.append("handler declares MoE but the config has no experts")
    if spec.topology is Topology.DENSE and layout.moe is not None:
        problems.append(f"handler declares dense but the config has {layout.moe.num_experts} experts")
    if spec.linear_attention and not layout.gdn_layers:
        problems.append("handler declares GDN linear attention but the config has no linear_attention layers")
    if not spec.linear_attention and layout.gdn_layers:
        problems.append(f"config has {len(layout.gdn_layers)} linear_attention layers the handler does not declare")
    has_shared = any(t.scope is TargetScope.SHARED_EXPERT for t in spec.lora_targets)
    if layout.moe is not None and layout.moe.has_shared_expert != has_shared:
        problems.append(
            "config has a shared expert the handler does not target"
            if layout.moe.has_shared_expert
            else "handler targets a shared expert the config does not have"
        )
    return problems
