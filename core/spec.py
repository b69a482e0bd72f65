"""The handler specification: one frozen, typed declaration per model family.

A handler says which Hugging Face architectures it claims and everything the training stack
needs to know about them. Numbers that depend on one checkpoint (layer count, expert count, which
layers are Gated DeltaNet) are not part of the declaration: :func:`model_support.core.layout.derive_layout`
reads them from the config.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from model_support.core.layout import ConfigFields, ModelLayout, derive_layout, text_config
from model_support.core.parallel import DIMENSIONS, ParallelLayout

if TYPE_CHECKING:
    import torch


class SpecError(ValueError):
    """A handler declaration is inconsistent."""


class Topology(StrEnum):
    DENSE = "dense"
    MOE = "moe"


class TargetScope(StrEnum):
    """Where a LoRA target lives in a decoder layer."""

    ATTENTION = "attention"  # full-attention layers
    GDN = "gdn"  # Gated DeltaNet (linear attention) layers
    MLP = "mlp"  # dense MLP
    EXPERT = "expert"  # routed MoE experts (one adapter per expert on disk)
    SHARED_EXPERT = "shared_expert"  # always-on shared expert of an MoE block


@dataclass(frozen=True)
class LoraTarget:
    """One Megatron module and the Hugging Face / vLLM modules it covers.

    ``hf`` lists module names as they appear in a PEFT adapter on disk (``q_proj``...). A fused
    Megatron module (``linear_qkv``) covers several HF modules; the codec splits it.
    """

    megatron: str
    hf: tuple[str, ...]
    scope: TargetScope

    def __post_init__(self) -> None:
        if not self.megatron or not self.hf:
            raise SpecError("a LoRA target needs a Megatron name and at least one HF module name")


# The LoRA linears of a decoder layer: the weight matrices of megatron-core's linear modules, named ``linear_*``
# (linear_qkv, linear_proj, linear_fc1, linear_fc2, MLA's linear_q_down_proj ...) or, in Gated DeltaNet,
# ``in_proj`` / ``out_proj``. These are the modules LoRA wraps on the Megatron side and PEFT / vLLM address as HF
# linears. Every other parameter the bridge maps is not one: routers (``mlp.router``: the expert choice, which
# vLLM's LoRA never adapts), norms (``*_layernorm``, a fused linear's ``layer_norm_weight``: per-channel scales),
# GDN's depthwise ``conv1d``, ``A_log`` and ``dt_bias``, a shared expert's gate vector, and, outside the decoder
# layers, the embedding and the output layer (vocab-sized, not LoRA targets here).
LORA_LINEAR = re.compile(r"^(linear_\w+|in_proj|out_proj)$")


@dataclass(frozen=True)
class LoraExclusion:
    """A LoRA linear megatron-bridge maps that the family deliberately does not train, and why.

    The `architecture` stage fails a model in which the bridge maps a linear (:data:`LORA_LINEAR`) of ``scope``
    that is neither a :class:`LoraTarget` nor excluded here.
    """

    megatron: str
    scope: TargetScope
    reason: str


@dataclass(frozen=True)
class VllmLora:
    """Whether vLLM can serve a LoRA adapter for this family natively, and why not if not."""

    native: bool
    reason: str


@dataclass(frozen=True)
class DependencyFloor:
    """A minimum version of a package, with the reason it is needed.

    ``extra`` names the optional extra that installs the package (``None``: a core requirement).
    """

    package: str
    minimum: str
    reason: str
    extra: str | None = None


@dataclass(frozen=True)
class RuntimePolicy:
    """How the training/serving stack must run this family."""

    disable_mtp_for_training: bool = False
    # GDN kernel backend: "auto" lets model_support.kernels.select_backend decide.
    gdn_backend: str = "auto"
    # vLLM's dtype on its CPU build where the checkpoint's own cannot run there (None: the checkpoint's), and
    # why; the serving stages print both, and judge with that dtype's tolerances.
    cpu_serving_dtype: str | None = None
    cpu_serving_reason: str = ""
    # Why vLLM's CPU build cannot take this family's weights in place (measured; "" where it can): the serving
    # stages then serve the policy from its merged weights written as a checkpoint, and rl_trainability skips.
    cpu_inplace_reload_gap: str = ""
    # Limits replacing a stage's own, keyed "stage.metric" (e.g. "merged_serving.prompt_logprob_max_abs_err"), and
    # why; the stage's report names each one beside its default limit and this reason.
    tolerances: Mapping[str, float] = field(default_factory=dict)
    tolerance_reason: str = ""
    # Parallel dimensions ("tensor_parallel", "sequence_parallel", "expert_parallel") the family cannot train in,
    # with why: build_model refuses a layout using one, and parallel_parity names it instead of checking it.
    parallel_limits: Mapping[str, str] = field(default_factory=dict)

    def refused(self, layout: ParallelLayout) -> str | None:
        """Why this family cannot train in ``layout`` (None: it can)."""
        used = layout.used()
        reasons = [f"{dim.replace('_', ' ')}: {why}" for dim, why in self.parallel_limits.items() if dim in used]
        return "; ".join(reasons) or None


@dataclass(frozen=True)
class ConfigRequirement:
    """A text-config field whose other values the family's build does not implement, and why.

    The `architecture` stage fails a config whose ``field`` holds a value outside ``allowed`` (an absent field
    counts as ``None``).
    """

    field: str
    allowed: tuple[Any, ...]
    reason: str

    def __call__(self, text: Any) -> str | None:
        value = getattr(text, self.field, None)
        if value in self.allowed:
            return None
        allowed = " or ".join(repr(v) for v in self.allowed)
        return f"config sets {self.field}={value!r}, the handler supports only {allowed}: {self.reason}"


@runtime_checkable
class LoraCodec(Protocol):
    """Converts LoRA tensors between Megatron's fused layout and the PEFT adapter on disk.

    ``to_peft`` maps Megatron LoRA tensors (keyed by Megatron parameter name) to PEFT tensors
    keyed by HF module names; ``from_peft`` is its exact inverse.
    """

    name: str

    def to_peft(
        self, tensors: Mapping[str, torch.Tensor], config: Any, layout: ModelLayout
    ) -> dict[str, torch.Tensor]: ...

    def from_peft(
        self, tensors: Mapping[str, torch.Tensor], config: Any, layout: ModelLayout
    ) -> dict[str, torch.Tensor]: ...


_NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class HandlerSpec:
    """The declaration of one model family."""

    name: str
    description: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    topology: Topology
    lora_targets: tuple[LoraTarget, ...]
    vllm_lora: VllmLora
    linear_attention: bool = False
    codec: LoraCodec | None = None
    dependencies: tuple[DependencyFloor, ...] = ()
    runtime: RuntimePolicy = field(default_factory=RuntimePolicy)
    # A config.json of a real checkpoint of the family: `check <handler> --tiny` replicates it.
    reference_config: Path | None = None
    # Where the family's config keeps its layout numbers, where it differs from transformers' common names.
    config_fields: ConfigFields = field(default_factory=ConfigFields)
    # Text-config fields the tiny replica sets after the generic shrink (sizes a kernel needs, family fields the
    # generic shrink does not know): {field: value}.
    tiny_config: Mapping[str, Any] = field(default_factory=dict)
    # "package.module:function" returning the megatron-core layer spec (a ModuleSpec, or, given the provider's config
    # and vp_stage, the TransformerBlockSubmodules of this pipeline stage's layers: core.megatron.spec.stage_layers
    # cuts a per-layer list) where the family needs modules of its own; imported only when a Megatron model is built.
    # None: model-support's local spec.
    megatron_layer_spec: str | None = None
    # What one checkpoint's config may ask that the handler cannot build as declared (a value the bridge ignores, a
    # pattern it hardcodes): ConfigRequirement entries, or functions of the text config returning why (None: fine).
    # The `architecture` stage fails a config with the reasons.
    config_requirements: tuple[ConfigRequirement | Callable[[Any], str | None], ...] = ()
    # LoRA linears megatron-bridge maps that the family leaves untrained, each with why; the `architecture` stage
    # fails a mapped linear of the model that is neither in lora_targets nor here.
    lora_exclusions: tuple[LoraExclusion, ...] = ()

    def __post_init__(self) -> None:
        problems = declaration_problems(self)
        if problems:
            raise SpecError(f"handler {self.name!r}: " + "; ".join(problems))

    def targets(self, *scopes: TargetScope) -> tuple[LoraTarget, ...]:
        return tuple(t for t in self.lora_targets if not scopes or t.scope in scopes)

    @property
    def hf_target_modules(self) -> tuple[str, ...]:
        """PEFT ``target_modules``: every HF module name, in declaration order, once."""
        return tuple(dict.fromkeys(name for t in self.lora_targets for name in t.hf))

    def config_problems(self, config: Any) -> list[str]:
        """What :attr:`config_requirements` refuse in ``config`` (a transformers config; its text part is checked)."""
        text = text_config(config)
        return [reason for check in self.config_requirements if (reason := check(text))]

    def layout(self, config: Any) -> ModelLayout:
        """The layer layout of one checkpoint's config, read where this family keeps it."""
        return derive_layout(config, self.config_fields)

    @property
    def megatron_target_modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.megatron for t in self.lora_targets))


def declaration_problems(spec: HandlerSpec) -> list[str]:
    """Static consistency checks of a declaration (no model needed)."""
    problems: list[str] = []
    if not _NAME.match(spec.name):
        problems.append("name must be lower-case letters, digits, '_', '-' or '.'")
    if not spec.architectures:
        problems.append("claims no architecture")
    if not spec.model_types:
        problems.append("claims no model_type")
    if not spec.lora_targets:
        problems.append("declares no LoRA target")
    if not isinstance(spec.topology, Topology):
        problems.append(f"topology must be a Topology, got {spec.topology!r}")
    scopes = {t.scope for t in spec.lora_targets}
    if TargetScope.EXPERT in scopes and spec.topology is not Topology.MOE:
        problems.append("expert LoRA targets need topology MOE")
    if TargetScope.SHARED_EXPERT in scopes and spec.topology is not Topology.MOE:
        problems.append("shared-expert LoRA targets need topology MOE")
    if spec.topology is Topology.MOE and TargetScope.EXPERT not in scopes:
        problems.append("an MoE handler must target the experts")
    if TargetScope.GDN in scopes and not spec.linear_attention:
        problems.append("GDN LoRA targets need linear_attention=True")
    if spec.linear_attention and TargetScope.GDN not in scopes:
        problems.append("a linear-attention (GDN) handler must target the GDN projections")
    seen: set[tuple[str, TargetScope]] = set()
    for target in spec.lora_targets:
        key = (target.megatron, target.scope)
        if key in seen:
            problems.append(f"Megatron target {target.megatron!r} ({target.scope}) declared twice")
        seen.add(key)
    if not spec.vllm_lora.native and not spec.vllm_lora.reason.strip():
        problems.append("a merged-only vLLM LoRA status needs a reason")
    serving_dtype = spec.runtime.cpu_serving_dtype
    if serving_dtype is not None and serving_dtype not in ("bfloat16", "float16", "float32"):
        problems.append(f"cpu_serving_dtype must be bfloat16, float16 or float32, got {serving_dtype!r}")
    if serving_dtype is not None and not spec.runtime.cpu_serving_reason.strip():
        problems.append("a cpu_serving_dtype needs a cpu_serving_reason")
    if spec.megatron_layer_spec is not None and not _IMPORT_PATH.match(spec.megatron_layer_spec):
        problems.append(f"megatron_layer_spec must be 'package.module:function', got {spec.megatron_layer_spec!r}")
    if not isinstance(spec.config_fields, ConfigFields):
        problems.append(f"config_fields must be a ConfigFields, got {type(spec.config_fields).__name__}")
    if not all(isinstance(k, str) for k in spec.tiny_config):
        problems.append("tiny_config keys must be config field names (str)")
    tolerances = spec.runtime.tolerances
    malformed = [k for k in tolerances if not re.fullmatch(r"[a-z_]+\.[a-z0-9_]+", k)]
    if malformed:
        problems.append(f"tolerances are keyed 'stage.metric', got {malformed}")
    if tolerances and not spec.runtime.tolerance_reason.strip():
        problems.append("tolerances need a tolerance_reason")
    limits = spec.runtime.parallel_limits
    unknown = sorted(set(limits) - set(DIMENSIONS))
    if unknown or not all(str(why).strip() for why in limits.values()):
        problems.append(f"parallel_limits map one of {', '.join(DIMENSIONS)} to a reason, got {dict(limits)}")
    for requirement in spec.config_requirements:
        declared = isinstance(requirement, ConfigRequirement) and requirement.allowed and requirement.reason.strip()
        if not (declared or (callable(requirement) and not isinstance(requirement, ConfigRequirement))):
            problems.append(
                "config_requirements must be ConfigRequirements (with allowed values and a reason) or functions of "
                "the text config"
            )
            break
    problems += _exclusion_problems(spec)
    if spec.codec is not None and not isinstance(spec.codec, LoraCodec):
        problems.append("codec does not implement LoraCodec (name, to_peft, from_peft)")
    return problems


def _exclusion_problems(spec: HandlerSpec) -> list[str]:
    """Each lora_exclusions entry names one LoRA linear of a scope, not targeted, with a reason."""
    problems: list[str] = []
    targeted = {(t.megatron, t.scope) for t in spec.lora_targets}
    seen: set[tuple[str, TargetScope]] = set()
    for exclusion in spec.lora_exclusions:
        if not isinstance(exclusion, LoraExclusion):
            problems.append(f"lora_exclusions must be LoraExclusion entries, got {exclusion!r}")
            continue
        key = (exclusion.megatron, exclusion.scope)
        where = f"lora exclusion {exclusion.megatron!r} ({exclusion.scope})"
        if not isinstance(exclusion.scope, TargetScope):
            problems.append(f"{where}: scope must be a TargetScope")
        if not LORA_LINEAR.match(exclusion.megatron or ""):
            problems.append(
                f"{where}: not a LoRA linear (linear_*, in_proj or out_proj); routers, norms and embeddings are never "
                "LoRA targets and need no exclusion"
            )
        if not str(exclusion.reason or "").strip():
            problems.append(f"{where} needs a reason")
        if key in targeted:
            problems.append(f"{where} is also a LoRA target")
        if key in seen:
            problems.append(f"{where} declared twice")
        seen.add(key)
    return problems
