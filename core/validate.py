"""Checks a handler declaration against a model built from a config."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from model_support.core.errors import ModelSupportError
from model_support.core.layout import ConfigFields, ModelLayout, text_config
from model_support.core.meta_model import build_meta_model as build_meta_model  # where stages and plugins import it
from model_support.core.spec import HandlerSpec, LoraTarget, TargetScope, Topology

if TYPE_CHECKING:
    from pathlib import Path

    from model_support.core.bridge_linears import MappedLinear
    from model_support.core.checkpoint import TextCheckpoint

# The parent module each scope's HF modules live under, in transformers decoder layers.
SCOPE_PARENTS: dict[TargetScope, tuple[str, ...]] = {
    TargetScope.ATTENTION: ("self_attn",),
    TargetScope.GDN: ("linear_attn",),
    TargetScope.MLP: ("mlp",),
    TargetScope.SHARED_EXPERT: ("shared_expert", "shared_experts"),
    TargetScope.EXPERT: ("experts",),
}
# Checkpoints that store experts as fused 3-D tensors (Qwen3.5-MoE's) are addressed per expert by PEFT and vLLM.
_FUSED_EXPERT_PARAMS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_LISTED = 3  # wrongly stored tensors named one by one; the rest are counted


def _present(target: LoraTarget, hf: str, modules: set[str], params: set[str]) -> bool:
    parents = "|".join(map(re.escape, SCOPE_PARENTS[target.scope]))
    if target.scope is TargetScope.EXPERT:
        per_expert = re.compile(rf"(^|\.)({parents})\.\d+\.{re.escape(hf)}$")
        fused = re.compile(rf"(^|\.)({parents})\.{_FUSED_EXPERT_PARAMS.get(hf, hf)}$")
        return any(per_expert.search(m) for m in modules) or any(fused.search(p) for p in params)
    pattern = re.compile(rf"(^|\.)({parents})\.{re.escape(hf)}$")
    return any(pattern.search(m) for m in modules)


def stored_state(model: Any) -> dict[str, Any]:
    """The tensors a checkpoint of ``model`` stores, by name (on the meta device for a :func:`build_meta_model`):
    its state dict under transformers' own reverse conversion, as ``save_pretrained`` writes it (Mixtral's
    ``block_sparse_moe.experts.<e>.w1`` for the fused ``mlp.experts.gate_up_proj`` it builds in memory). PEFT, vLLM
    and the exporter address these names; their shapes are those the config implies."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def names_of(state: Iterable[str]) -> tuple[set[str], set[str]]:
    """(module paths, tensor names) of a :func:`stored_state`."""
    names = set(state)
    return checkpoint_modules(names), names


def stored_names(model: Any) -> tuple[set[str], set[str]]:
    """(module paths, tensor names) of what a checkpoint of ``model`` stores (:func:`stored_state`)."""
    return names_of(stored_state(model))


def stored_tensor_problems(
    expected: Mapping[str, Any], stored: Mapping[str, tuple[Path, tuple[int, ...], str]]
) -> tuple[list[str], int]:
    """(problems, tensors checked): each checkpoint tensor (``stored``, as ``checkpoint.stored_tensors`` gives them)
    named as one of ``expected`` (:func:`stored_state`) must have that tensor's shape, the shape the config implies,
    and be stored in a floating-point dtype where that tensor is floating point. Tensors of other names (a quantized
    checkpoint's scales, MTP layers) are the bridge's to read or ignore."""
    from model_support.core.checkpoint import FLOAT_DTYPES

    problems, checked = [], 0
    for name, (path, shape, dtype) in stored.items():
        want = expected.get(name)
        if want is None:
            continue
        checked += 1
        if tuple(want.shape) != shape:
            problems.append(
                f"{name} in {path.name} is {list(shape)}, the config implies {list(want.shape)}: the checkpoint does "
                "not match its config.json"
            )
        elif want.is_floating_point() and dtype not in FLOAT_DTYPES:
            problems.append(
                f"{name} in {path.name} is stored as {dtype}, not as floating point: re-save the checkpoint in "
                "BF16, F16 or F32"
            )
    if len(problems) > _LISTED:
        problems[_LISTED:] = [f"{len(problems) - _LISTED} more tensor(s) of another shape or dtype"]
    return problems, checked


def missing_targets(spec: HandlerSpec, stored: tuple[set[str], set[str]]) -> list[str]:
    """HF target modules the declaration names that a checkpoint of the model does not store (``stored``: the
    model's :func:`stored_names`)."""
    modules, params = stored
    return [f"{t.scope}:{hf}" for t in spec.lora_targets for hf in t.hf if not _present(t, hf, modules, params)]


class TargetCoverageError(ModelSupportError):
    """LoRA tensors (an adapter) leave a declared target without any module."""


def uncovered_targets(spec: HandlerSpec, module_names: Iterable[str], tensor_names: Iterable[str] = ()) -> list[str]:
    """Declared HF targets (``scope:name``) that none of ``module_names`` (full module paths, as in a
    checkpoint's or an adapter's tensor names) addresses, nor (experts) a stacked tensor of ``tensor_names``."""
    modules, tensors = set(module_names), set(tensor_names)
    return [f"{t.scope}:{hf}" for t in spec.lora_targets for hf in t.hf if not _present(t, hf, modules, tensors)]


def adapter_targets(adapter_config: Mapping[str, Any], tensor_names: Iterable[str]) -> tuple[set[str], set[str]]:
    """(module paths, stacked tensor names) a PEFT adapter's tensors address: a stacked parameter's LoRA
    (``target_parameters``: ``...experts.base_layer.lora_A.weight``) addresses the tensor it wraps."""
    from model_support.core.codecs import stacked_target

    stacked = adapter_config.get("target_parameters") or ()
    modules, tensors = set(), set()
    for name in tensor_names:
        target = stacked_target(name, stacked)
        if target:
            tensors.add(target[0])
        else:
            modules |= checkpoint_modules([name])
    return modules, tensors


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


# --- the declaration against megatron-bridge's mappings and the checkpoint's tensor shapes ---------------------------


def _names(names: Iterable[str]) -> str:
    return ", ".join(names) or "none"


def target_name_problems(spec: HandlerSpec, bridge: str, linears: Sequence[MappedLinear]) -> list[str]:
    """Declared targets whose HF modules are not those the bridge's mapping of their Megatron linear reads (the
    modules the codec writes that linear's LoRA under), or whose Megatron linear the bridge does not map."""
    mapped = {linear.key: linear for linear in linears}
    problems = []
    for target in spec.lora_targets:
        linear = mapped.get((target.megatron, target.scope))
        if linear is None:
            known = _names(m.megatron for m in linears if m.scope is target.scope)
            problems.append(
                f"LoRA target {target.scope}:{target.megatron}: {bridge} maps no {target.scope} linear named "
                f"{target.megatron} (its {target.scope} linears: {known})"
            )
        elif sorted(target.hf) != sorted(linear.hf):
            problems.append(
                f"LoRA target {target.scope}:{target.megatron} declares HF modules {_names(target.hf)}, but {bridge}'s "
                f"{linear.mapping} of {target.megatron} reads {_names(linear.hf)}"
            )
    return problems


def model_linears(linears: Sequence[MappedLinear], stored: tuple[set[str], set[str]]) -> list[MappedLinear]:
    """The mapped linears the transformers ``model`` has (a bridge maps every variant of its family: DeepSeek's
    ``q_proj`` where ``q_lora_rank`` is None, the dense MLP of an MoE family whose configs may have none)."""
    modules, params = stored
    return [
        linear
        for linear in linears
        if any(_present(LoraTarget(linear.megatron, linear.hf, linear.scope), hf, modules, params) for hf in linear.hf)
    ]


def coverage_problems(
    spec: HandlerSpec, bridge: str, linears: Sequence[MappedLinear], present: Sequence[MappedLinear]
) -> tuple[list[str], list[str]]:
    """(problems, detail lines): every LoRA linear the bridge maps and the model has (``present``) is a declared
    target or a declared exclusion; every exclusion names a linear the bridge maps."""
    targeted = {(t.megatron, t.scope) for t in spec.lora_targets}
    excluded = {(e.megatron, e.scope): e for e in spec.lora_exclusions}
    uncovered = [linear for linear in present if linear.key not in targeted and linear.key not in excluded]
    problems = [
        f"{bridge} maps {linear.scope} linear {linear.megatron} ({_names(linear.hf)}) of this model, which the handler "
        "neither targets nor lists in lora_exclusions (with the reason it is not trained)"
        for linear in uncovered
    ]
    mapped = {linear.key for linear in linears}
    in_model = {linear.key for linear in present}
    details = []
    for key, exclusion in excluded.items():
        where = f"{exclusion.scope}:{exclusion.megatron}"
        if key not in mapped:
            problems.append(f"lora exclusion {where}: {bridge} maps no such linear")
        elif key in in_model:
            details.append(f"not trained (lora_exclusions): {where}: {exclusion.reason}")
        else:
            details.append(f"lora exclusion {where}: this model has no such linear")
    return problems, details


def _hf_tensors(linear: MappedLinear, checkpoint: TextCheckpoint) -> dict[int, dict[int | None, str]]:
    """The checkpoint tensors ``linear``'s mapping reads: {layer: {expert (None: not per expert): tensor name}}."""
    out: dict[int, dict[int | None, str]] = {}
    for pattern in linear.hf_params:
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")
        for name in checkpoint:
            if match := regex.match(name):
                expert = int(match.group(2)) if match.lastindex and match.lastindex > 1 else None
                out.setdefault(int(match.group(1)), {})[expert] = name
    return out


def _declared(fields: ConfigFields, name: str) -> str:
    value = getattr(fields, name)
    return f"config_fields.{name} ({getattr(value, '__name__', None) if callable(value) else repr(value)})"


def _down_width(shape: tuple[int, ...], hidden: int) -> int:
    """The width of a down projection's tensor: its dimension other than the hidden size, whichever way it is stored
    ([hidden, width], stacked [experts, hidden, width], or gpt-oss's [experts, width, hidden])."""
    return shape[-2] if shape[-1] == hidden else shape[-1]


def checkpoint_size_problems(
    spec: HandlerSpec, config: Any, layout: ModelLayout, linears: Sequence[MappedLinear], checkpoint: TextCheckpoint
) -> tuple[list[str], list[str]]:
    """(problems, detail lines): the MoE sizes the layout derives from the config through the declaration (expert
    count and width, shared-expert width, which layers are dense) against the shapes of the checkpoint tensors that
    the bridge's mappings of ``linear_fc2`` (an MLP's down projection: [hidden, width]) read."""
    moe = layout.moe
    if moe is None:
        return [], []
    fc2 = {linear.scope: linear for linear in linears if linear.megatron == "linear_fc2"}
    if TargetScope.EXPERT not in fc2:
        return [], ["MoE sizes not checked against the checkpoint: the bridge maps no routed-expert linear_fc2"]
    problems = []
    fields = spec.config_fields
    experts = _hf_tensors(fc2[TargetScope.EXPERT], checkpoint)
    expert_layers = {layer: experts[layer] for layer in sorted(experts) if layer < layout.num_layers}
    # Per layer: a tensor, its shape and the expert count: the experts named (experts.<e>.down_proj.weight), or the
    # first dimension of one stacked tensor of all experts ([experts, hidden, width]).
    found: dict[int, tuple[str, tuple[int, ...], int]] = {}
    for layer, tensors in expert_layers.items():
        name = next(iter(tensors.values()))
        shape = checkpoint.shape(name)
        found[layer] = (name, shape, len(tensors) if None not in tensors else shape[0])
    count_field = fields.expert_field(lambda name: getattr(text_config(config), name, None))
    miscounted = next(((layer, name, n) for layer, (name, _, n) in found.items() if n != moe.num_experts), None)
    if miscounted:
        layer, name, count = miscounted
        problems.append(
            f"expert count: config {count_field} (config_fields.experts) = {moe.num_experts}, the checkpoint holds "
            f"{count} experts in layer {layer} ({name} ...)"
        )
    width, hidden = moe.expert_intermediate_size, text_config(config).hidden_size
    widths = {name: _down_width(shape, hidden) for name, shape, _ in found.values()}
    other_width = next(((name, shape) for name, shape, _ in found.values() if widths[name] != width), None)
    if other_width:
        name, shape = other_width
        problems.append(
            f"expert width: config {fields.expert_intermediate_size} (config_fields.expert_intermediate_size) = "
            f"{width}, the checkpoint's {name} is {list(shape)} (width {widths[name]})"
        )
    dense = sorted(set(range(layout.num_layers)) - set(expert_layers))
    if not expert_layers:
        problems.append(
            f"the checkpoint holds no routed-expert tensor the bridge reads ({fc2[TargetScope.EXPERT].hf_params[0]}), "
            f"though the config has {moe.num_experts} experts"
        )
    elif dense != sorted(moe.dense_layers):
        problems.append(
            f"dense layers: {_declared(fields, 'dense_layers')} gives {sorted(moe.dense_layers)}, the checkpoint has "
            f"no routed experts ({fc2[TargetScope.EXPERT].hf_params[0]}) in layers {dense}"
        )
    shared, shared_width = fc2.get(TargetScope.SHARED_EXPERT), moe.shared_expert_intermediate_size
    declared = f"shared-expert width: {_declared(fields, 'shared_expert_intermediate_size')} gives {shared_width}"
    if shared is None and moe.has_shared_expert:
        problems.append(f"{declared}, but megatron-bridge maps no shared expert of this family")
    elif shared is not None:
        by_layer = _hf_tensors(shared, checkpoint)
        names = [name for layer in sorted(by_layer) if layer < layout.num_layers for name in by_layer[layer].values()]
        wrong = next((name for name in names if _down_width(checkpoint.shape(name), hidden) != shared_width), None)
        if wrong:
            shape = checkpoint.shape(wrong)
            problems.append(
                f"{declared}, the checkpoint's {wrong} is {list(shape)} (width {_down_width(shape, hidden)})"
            )
        elif not names and moe.has_shared_expert:
            problems.append(f"{declared}, the checkpoint holds no shared-expert tensor ({shared.hf_params[0]})")
    if problems:
        return problems, []
    checked = f"{moe.num_experts} experts of width {width} in {len(expert_layers)} layer(s), dense layers {dense}"
    if moe.has_shared_expert:
        checked += f", shared expert of width {shared_width}"
    return [], [f"MoE sizes match the checkpoint's tensor shapes: {checked}"]
