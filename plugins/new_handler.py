"""``model-support new-handler``: generate a handler plugin package from the cookiecutter template.

The family's config.json (of a real checkpoint) decides the declaration's starting point:
architecture, model_type, dense or MoE, shared expert, dense layers of an MoE model, layer kinds, Gated DeltaNet
layers, MTP. Where the config keeps its layout numbers is read off the config, checked against the Megatron model
megatron-bridge's provider builds for it (where the family has a bridge); options name the fields outright. The
config is shipped in the package as the reference config, next to a tiny config fixture for the package's own tests.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated, Any

import typer

from model_support.core.errors import ConfigError, ModelSupportError
from model_support.core.layout import FULL_ATTENTION, LINEAR_ATTENTION, ConfigFields
from model_support.core.spec import LoraTarget
from model_support.plugins.bridge_targets import BridgeTargets

if TYPE_CHECKING:
    from model_support.core.layout import ModelLayout

TEMPLATE = Path(__file__).with_name("template")

# Config fields that may hold each layout number, the most specific name first: transformers' common names,
# megatron-bridge's (its CONFIG_MAPPING), then families' own (GLM / DeepSeek n_routed_experts, gpt-oss
# experts_per_token, Mixtral / gpt-oss / OLMoE experts as wide as intermediate_size).
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token")
_EXPERT_WIDTH = ("moe_intermediate_size", "intermediate_size")
_SHARED_WIDTH = ("shared_expert_intermediate_size",)
# Shared experts counted, each as wide as a routed expert (GLM-4.5, DeepSeek).
_SHARED_COUNT = ("n_shared_experts",)
# The dense layers of an MoE model: a count of leading layers, or a list of layer indices (Qwen3-MoE).
_DENSE_COUNT = ("first_k_dense_replace",)
_DENSE_LIST = ("mlp_only_layers",)
# layer_types entries that are a layer kind model-support builds under another name: a sliding-window layer is a
# full-attention layer (its window is a length structure of the config, not another module).
_KNOWN_KINDS = {"sliding_attention": FULL_ATTENTION}
# megatron-bridge is installed with --no-deps (.ci/requirements-megatron.txt pins it), so model-support's own
# requirements cannot state it: this is the release the project tests.
MEGATRON_BRIDGE_FLOOR = "0.6.2"


class NewHandlerError(ModelSupportError):
    pass


@dataclass(frozen=True)
class LayoutOptions:
    """Config fields named on the command line for the layout, overriding what new-handler derives (None: derive)."""

    experts: str | None = None
    experts_per_token: str | None = None
    expert_width: str | None = None
    shared_expert_width: str | None = None
    shared_experts: str | None = None
    dense_layers: str | None = None
    # layer_types entry -> the kind model-support builds it as.
    layer_kinds: Mapping[str, str] = field(default_factory=dict)

    def moe_options(self) -> list[str]:
        """The MoE options given, as typed on the command line."""
        given = {
            "--experts-per-token-field": self.experts_per_token,
            "--expert-width-field": self.expert_width,
            "--shared-expert-width-field": self.shared_expert_width,
            "--shared-experts-field": self.shared_experts,
            "--dense-layers-field": self.dense_layers,
        }
        return [f"{option} {name}" for option, name in given.items() if name]


@dataclass(frozen=True)
class BridgeLayout:
    """The MoE numbers megatron-bridge's provider builds the family's Megatron model with (experts 0: dense)."""

    bridge: str
    num_experts: int
    top_k: int
    expert_width: int
    shared_width: int
    dense_layers: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"megatron-bridge's {self.bridge}"


def bridge_layout(config: Any) -> BridgeLayout:
    """The layout numbers of ``config``'s family by its megatron-bridge provider.

    Raises :class:`~model_support.plugins.bridge_targets.BridgeTargetsError` where no bridge can be read.
    """
    from model_support.core.megatron.imports import MegatronUnavailableError
    from model_support.plugins.bridge_targets import BridgeTargetsError

    try:
        from model_support.core.megatron.builder import MegatronBuildError, family_bridge

        model_bridge, tcfg = family_bridge(config)
        provider = model_bridge.provider_bridge(SimpleNamespace(config=tcfg, generation_config=None))
    except MegatronUnavailableError as exc:
        raise BridgeTargetsError(str(exc)) from None
    except ImportError as exc:
        if (exc.name or "megatron").split(".")[0] == "megatron":
            raise BridgeTargetsError(
                f"megatron-bridge is not installed ({exc}); pip install 'model-support[megatron]'"
            ) from None
        # megatron-bridge imports; the family's bridge needs a package this machine lacks.
        architecture = (getattr(config, "architectures", None) or ["this architecture"])[0]
        raise BridgeTargetsError(
            f"megatron-bridge's bridge for {architecture} does not import here ({exc}): install "
            f"{exc.name or 'what it names'} to read the Megatron model it builds"
        ) from None
    except MegatronBuildError as exc:
        raise BridgeTargetsError(str(exc)) from None
    experts = int(provider.num_moe_experts or 0)
    freq = provider.moe_layer_freq
    # megatron-core's moe_layer_freq: one 0/1 per layer (1: MoE), or N (every N-th layer from layer 0 is MoE).
    pattern = list(freq) if isinstance(freq, list | tuple) else [int(i % freq == 0) for i in range(provider.num_layers)]
    return BridgeLayout(
        bridge=type(model_bridge).__name__,
        num_experts=experts,
        top_k=int(provider.moe_router_topk or 0) if experts else 0,
        expert_width=int(provider.moe_ffn_hidden_size or 0) if experts else 0,
        shared_width=int(provider.moe_shared_expert_intermediate_size or 0) if experts else 0,
        dense_layers=tuple(i for i, moe in enumerate(pattern) if not moe) if experts else (),
    )


@dataclass
class LayoutDeclaration:
    """A generated handler's ``config_fields=``: ConfigFields keyword arguments as source, the small named functions
    they use, and where the numbers were checked."""

    note: str
    kwargs: dict[str, str] = field(default_factory=dict)
    functions: list[str] = field(default_factory=list)

    def expression(self) -> str:
        """``ConfigFields(...)`` as the template writes it after ``config_fields=`` (4-space indented; one line where
        it fits 120 columns)."""
        if not self.kwargs:
            return ""
        args = [f"{name}={value}" for name, value in self.kwargs.items()]
        one_line = f"ConfigFields({', '.join(args)})"
        if len(f"    config_fields={one_line},") <= 120:
            return one_line
        return "ConfigFields(\n" + "".join(f"        {arg},\n" for arg in args) + "    )"

    def source(self) -> str:
        """The functions, each followed by two blank lines (ruff's layout), for above the HandlerSpec."""
        return "".join(f"{function}\n\n" for function in self.functions)

    def config_fields(self) -> ConfigFields:
        """The ConfigFields the generated handler declares: its source executed, so the layout new-handler reads and
        checks is the one the file gives."""
        namespace: dict[str, Any] = {"ConfigFields": ConfigFields, "Any": Any}
        exec(f"{self.source()}CONFIG_FIELDS = {self.expression() or 'ConfigFields()'}", namespace)
        return namespace["CONFIG_FIELDS"]


def _py(value: str | tuple[str, ...] | Mapping[str, str]) -> str:
    """A field name, a tuple or a mapping of them as Python source, double-quoted as ruff formats it."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return f"({', '.join(map(_py, value))},)"
    return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _sets(fields: Mapping[str, Any], names: Sequence[str]) -> str:
    """What the config sets of ``names``, by its own field names."""
    set_ = [f"{name}={fields[name]!r}" for name in names if name in fields]
    return f"the config sets {', '.join(set_)}" if set_ else f"the config sets none of {', '.join(names)}"


def _named(fields: Mapping[str, Any], name: str, option: str, accept: Callable[[Any], bool], what: str) -> str:
    """A field named by an option: the config must set it to ``what``."""
    if not name.isidentifier():
        raise NewHandlerError(f"{option} {name!r} is not a config field name")
    if name not in fields:
        raise NewHandlerError(f"{option} {name}: the config has no field {name}")
    if not accept(fields[name]):
        raise NewHandlerError(f"{option} {name}: the config sets {name}={fields[name]!r}, not {what}")
    return name


def _field(
    fields: Mapping[str, Any],
    names: Sequence[str],
    noun: str,
    option: str,
    bridge: BridgeLayout | None,
    number: str,
    accept: Callable[[Any], bool] = _positive,
) -> str:
    """The field holding the ``noun``: with a bridge the first of ``names`` holding the bridge's ``number`` (a
    :class:`BridgeLayout` attribute); without one (hand-written fallback) the first the config sets acceptably."""
    if bridge:
        want = getattr(bridge, number)
        found = next((name for name in names if fields.get(name) == want), None)
        where = f"{bridge.label} builds the Megatron model with {noun} {want}"
    else:
        found = next((name for name in names if accept(fields.get(name))), None)
        where = f"no field gives the {noun}"
    if found is None:
        raise NewHandlerError(f"{where}, {_sets(fields, names)}; pass {option} NAME (the config field holding it)")
    return found


def _experts(fields: Mapping[str, Any], bridge: BridgeLayout | None, option: str | None) -> str | None:
    """The field holding the routed expert count (None: a dense model)."""
    if option:
        return _named(fields, option, "--experts-field", _positive, "an expert count")
    if bridge:
        return (
            _field(fields, _EXPERTS, "expert count", "--experts-field", bridge, "num_experts")
            if bridge.num_experts
            else None
        )
    set_ = [name for name in _EXPERTS if _positive(fields.get(name))]
    if len({fields[name] for name in set_}) > 1:
        raise NewHandlerError(f"{_sets(fields, set_)}: which is the expert count? pass --experts-field NAME")
    return set_[0] if set_ else None


def _layer_kinds(kinds: Sequence[str], chosen: Mapping[str, str], declaration: LayoutDeclaration) -> None:
    """Declare ``layer_kinds`` where the config's layer_types name a kind model-support builds under another name."""
    default = ConfigFields().layer_kinds
    built = (FULL_ATTENTION, LINEAR_ATTENTION)
    unused = sorted(set(chosen) - set(kinds))
    if unused:
        raise NewHandlerError(f"--layer-kind {', '.join(unused)}: the config's layer_types has no such entry")
    mapping: dict[str, str] = {}
    for kind in dict.fromkeys(kinds):
        as_ = chosen.get(kind) or default.get(kind) or _KNOWN_KINDS.get(kind)
        if as_ is None:
            raise NewHandlerError(
                f"the config's layer_types has {kind!r}, not a layer kind model-support builds ({' or '.join(built)});"
                f" pass --layer-kind {kind}={FULL_ATTENTION} (or ={LINEAR_ATTENTION}) to say which it is"
            )
        if as_ not in built:
            raise NewHandlerError(f"--layer-kind {kind}={as_}: model-support builds {' or '.join(built)}")
        mapping[kind] = as_
    if any(default.get(kind) != as_ for kind, as_ in mapping.items()):
        declaration.kwargs["layer_kinds"] = _py(mapping)


def _shared_expert(
    fields: Mapping[str, Any], width_field: str, bridge: BridgeLayout | None, options: LayoutOptions
) -> tuple[str, bool] | None:
    """The field giving the shared expert's width, and whether it counts shared experts of the routed width
    (``width_field``) rather than holding the width; None: no shared expert."""
    if options.shared_expert_width and options.shared_experts:
        raise NewHandlerError("pass one of --shared-expert-width-field and --shared-experts-field")
    if options.shared_expert_width:
        return _named(fields, options.shared_expert_width, "--shared-expert-width-field", _positive, "a width"), False
    if options.shared_experts:
        return _named(fields, options.shared_experts, "--shared-experts-field", _positive, "a count"), True
    width = fields[width_field]
    if bridge:
        if not bridge.shared_width:
            return None
        named = next((n for n in _SHARED_WIDTH if fields.get(n) == bridge.shared_width), None)
        counted = next(
            (n for n in _SHARED_COUNT if _positive(fields.get(n)) and fields[n] * width == bridge.shared_width), None
        )
        if named or counted:
            return (named, False) if named else (counted, True)
        raise NewHandlerError(
            f"{bridge.label} builds a shared expert {bridge.shared_width} wide, {_sets(fields, _SHARED_WIDTH)} and "
            f"{_sets(fields, _SHARED_COUNT)} (routed experts {width_field}={width}); pass "
            "--shared-expert-width-field NAME (the field holding its width) or --shared-experts-field NAME (the field "
            f"counting shared experts {width_field} wide)"
        )
    # Hand-written fallback: a width field the config sets, else a count of routed-width shared experts.
    named = next((n for n in _SHARED_WIDTH if _positive(fields.get(n))), None)
    counted = next((n for n in _SHARED_COUNT if _positive(fields.get(n))), None)
    return (named, False) if named else (counted, True) if counted else None


def _shared_expert_function(count: str, width: str) -> str:
    return (
        "def _shared_expert_width(cfg: Any) -> int:\n"
        f'    """{count} shared experts, each {width} wide."""\n'
        f"    return cfg.{count} * cfg.{width}\n"
    )


def _dense_layers(fields: Mapping[str, Any], bridge: BridgeLayout | None, option: str | None) -> str | None:
    """The field saying which MoE layers have a dense MLP (a count of leading layers or a list; None: none)."""

    def layers(value: Any) -> tuple[int, ...] | None:
        if _positive(value):
            return tuple(range(value))
        if isinstance(value, list) and value and all(isinstance(i, int) and i >= 0 for i in value):
            return tuple(sorted(set(value)))
        return None

    names = _DENSE_COUNT + _DENSE_LIST
    if option:
        return _named(fields, option, "--dense-layers-field", layers, "a count of leading layers or a list of layers")
    if bridge:
        if not bridge.dense_layers:
            return None
        found = next((name for name in names if layers(fields.get(name)) == bridge.dense_layers), None)
        if found is None:
            raise NewHandlerError(
                f"{bridge.label} builds a dense MLP in layers {list(bridge.dense_layers)}, {_sets(fields, names)}; "
                "pass --dense-layers-field NAME (a field counting the leading dense layers, or listing them)"
            )
        return found
    # Hand-written fallback: the first such field the config sets.
    return next((name for name in names if layers(fields.get(name))), None)


def _dense_layers_function(name: str, value: Any) -> str:
    if isinstance(value, list):
        return (
            "def _dense_layers(cfg: Any) -> list[int]:\n"
            f'    """The layers {name} lists have a dense MLP instead of experts."""\n'
            f"    return list(cfg.{name})\n"
        )
    return (
        "def _dense_layers(cfg: Any) -> range:\n"
        f'    """The layers below {name} have a dense MLP instead of experts."""\n'
        f"    return range(cfg.{name})\n"
    )


class _OpenQuestions:
    """What the config leaves open, gathered over the whole declaration so that one run names all of it (each
    question's own line, with the option that settles it)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def answer[T](self, find: Callable[..., T], *args: Any) -> T | None:
        """``find(*args)``, or None with its question kept when it raises :class:`NewHandlerError`."""
        try:
            return find(*args)
        except NewHandlerError as exc:
            self.lines.append(str(exc))
            return None

    def settle(self) -> None:
        """Raise one error naming every open question (the first alone when there is one)."""
        if len(self.lines) == 1:
            raise NewHandlerError(self.lines[0])
        if self.lines:
            numbered = "; ".join(f"({i}) {line}" for i, line in enumerate(self.lines, 1))
            raise NewHandlerError(f"{len(self.lines)} things the config leaves open: {numbered}")


def declare_layout(
    fields: Mapping[str, Any], kinds: Sequence[str], bridge: BridgeLayout | None, options: LayoutOptions
) -> LayoutDeclaration:
    """Where the config keeps its layout, as the ConfigFields a handler declares (only what differs from the
    defaults). ``fields`` are the text config's fields by config.json's names, ``kinds`` its layer_types."""
    note = (
        f"checked against the Megatron model {bridge.label} builds"
        if bridge
        else "not checked against a bridge (none could be read)"
    )
    declaration = LayoutDeclaration(f"Where the config keeps its layout, {note}; the rest: the defaults.")
    open_ = _OpenQuestions()
    open_.answer(_layer_kinds, kinds, options.layer_kinds, declaration)
    experts = open_.answer(_experts, fields, bridge, options.experts)
    if experts is None:
        if not open_.lines and options.moe_options():
            raise NewHandlerError(f"{', '.join(options.moe_options())}: the config has no experts (a dense model)")
        open_.settle()  # the expert count open: the other MoE fields cannot be told apart from it
        return declaration
    if options.experts_per_token:
        top_k = open_.answer(
            _named, fields, options.experts_per_token, "--experts-per-token-field", _positive, "an expert count"
        )
    else:
        top_k = open_.answer(
            _field,
            fields,
            _EXPERTS_PER_TOKEN,
            "experts per token",
            "--experts-per-token-field",
            bridge,
            "top_k",
            lambda value: _positive(value) and value <= fields[experts],
        )
    if options.expert_width:
        width = open_.answer(_named, fields, options.expert_width, "--expert-width-field", _positive, "a width")
    else:
        width = open_.answer(
            _field, fields, _EXPERT_WIDTH, "expert width", "--expert-width-field", bridge, "expert_width"
        )
    # A shared expert may be counted in routed widths: asked once the routed width is known.
    shared = open_.answer(_shared_expert, fields, width, bridge, options) if width else None
    dense = open_.answer(_dense_layers, fields, bridge, options.dense_layers)
    open_.settle()
    defaults = ConfigFields()
    if defaults.expert_field(fields.get) != experts:
        declaration.kwargs["experts"] = _py((experts,))
    if top_k != defaults.experts_per_token:
        declaration.kwargs["experts_per_token"] = _py(top_k)
    if width != defaults.expert_intermediate_size:
        declaration.kwargs["expert_intermediate_size"] = _py(width)
    if shared and shared[1]:  # a count of shared experts: their width is a function of the config
        declaration.functions.append(_shared_expert_function(shared[0], width))
        declaration.kwargs["shared_expert_intermediate_size"] = "_shared_expert_width"
    elif shared:
        declaration.kwargs["shared_expert_intermediate_size"] = _py(shared[0])
    if dense:
        declaration.functions.append(_dense_layers_function(dense, fields[dense]))
        declaration.kwargs["dense_layers"] = "_dense_layers"
        if isinstance(fields[dense], list):  # a replica cut to fewer layers keeps the listed layers it has
            declaration.kwargs["layer_lists"] = _py((dense,))
    # Keep the keyword arguments in ConfigFields' own order.
    order = list(ConfigFields.__dataclass_fields__)
    declaration.kwargs = dict(sorted(declaration.kwargs.items(), key=lambda item: order.index(item[0])))
    return declaration


def _bridge_disagreements(layout: ModelLayout, bridge: BridgeLayout) -> list[str]:
    """Where the declared layout differs from the Megatron model the bridge builds."""
    moe = layout.moe
    ours = (
        (
            moe.num_experts,
            moe.top_k,
            moe.expert_intermediate_size,
            moe.shared_expert_intermediate_size,
            moe.dense_layers,
        )
        if moe
        else (0, 0, 0, 0, ())
    )
    theirs = (bridge.num_experts, bridge.top_k, bridge.expert_width, bridge.shared_width, bridge.dense_layers)
    labels = ("experts", "experts per token", "expert width", "shared expert width", "dense layers")
    return [f"{label} {a} (bridge: {b})" for label, a, b in zip(labels, ours, theirs, strict=True) if a != b]


def _named_fields(raw_text: Mapping[str, Any], text: Any) -> dict[str, Any]:
    """The text config's fields under the names config.json uses, plus the defaults its transformers class adds for
    fields the file leaves out (a class's alias of a config.json name is that name, not a field of its own)."""
    aliases = getattr(text, "attribute_map", {}) or {}
    own = {aliases.get(name, name) for name in raw_text}
    defaults = {name: value for name, value in text.to_dict().items() if name not in own}
    return {**defaults, **raw_text}


def tiny_config(raw: dict[str, Any], fields: ConfigFields | None = None) -> dict[str, Any]:
    """The config a tiny replica of ``raw`` gets (what ``model-support tiny`` writes), without weights; ``fields``
    are the handler's (where the config keeps its expert count, its layer lists)."""
    from model_support.core.tiny import SPECIAL_TOKENS, build_tokenizer, shrink_config

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(Path(tmp))
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return shrink_config(raw, math.ceil(len(tokenizer) / 64) * 64, token_ids, fields)


def tested_minimum(package: str) -> str:
    """The oldest ``package`` release model-support tests: the lower bound (or pin) of its requirement in
    pyproject.toml, as the installed distribution's metadata states it."""
    from packaging.requirements import Requirement

    for line in metadata.requires("model-support") or ():
        requirement = Requirement(line)
        if requirement.name == package:
            bounds = [spec.version for spec in requirement.specifier if spec.operator in (">=", "==", "~=")]
            if bounds:
                return bounds[0]
    raise NewHandlerError(f"model-support's requirements state no minimum {package}")


def _first_line(text: str) -> str:
    """The first line of a message (its statement; the rest is detail), as one line without a trailing colon."""
    first = next((line for line in str(text).splitlines() if line.strip()), "")
    return " ".join(first.split()).rstrip(":")


def _literal(text: str) -> str:
    """``text`` as one line safe inside a double-quoted string and a docstring of the generated files."""
    return " ".join(text.split()).replace("\\", "/").replace('"', "'")


def template_context(
    config: str,
    name: str | None = None,
    description: str | None = None,
    author: str = "",
    options: LayoutOptions | None = None,
) -> dict[str, Any]:
    """The cookiecutter variables for a handler of the family ``config`` (a config.json, model dir or cached id);
    ``options`` name layout fields outright."""
    from model_support.core.discovery import load_config, locate
    from model_support.core.layout import derive_layout, text_config
    from model_support.core.spec import _NAME
    from model_support.core.tiny import text_section
    from model_support.plugins.bridge_targets import BridgeTargetsError

    source = locate(config)
    if not source.architectures or not source.model_type:
        raise NewHandlerError(f"{config}: config.json must name `architectures` and `model_type`")
    name = name or source.model_type.replace("_", "-")
    if not _NAME.match(name):
        raise NewHandlerError(
            f"handler name {name!r} must be lower-case letters, digits, '_', '-' or '.' (starting with a letter)"
        )
    with tempfile.TemporaryDirectory() as tmp:  # the config file may have any name; transformers wants config.json
        (Path(tmp) / "config.json").write_text(json.dumps(source.raw_config))
        transformers_config = load_config(locate(tmp))
    text = text_config(transformers_config)
    try:
        bridge: BridgeLayout | None = bridge_layout(transformers_config)
    except BridgeTargetsError:  # the targets' note says why
        bridge = None
    try:
        declaration = declare_layout(
            _named_fields(text_section(source.raw_config), text),
            getattr(text, "layer_types", None) or (),
            bridge,
            options or LayoutOptions(),
        )
        fields = declaration.config_fields()
        layout = derive_layout(transformers_config, fields)
    except (NewHandlerError, ConfigError) as exc:
        raise NewHandlerError(f"{config}: cannot read the layer layout ({exc})") from None
    disagreements = _bridge_disagreements(layout, bridge) if bridge else []
    if disagreements:
        raise NewHandlerError(
            f"{config}: the declared layout differs from the Megatron model {bridge.label} builds: "
            f"{'; '.join(disagreements)}; fix the field options"
        )
    architecture = source.architectures[0]
    targets = _targets(transformers_config, layout)
    return {
        "handler_name": name,
        "description": _literal(description or f"{architecture} ({source.model_type})."),
        "architecture": architecture,
        "model_type": source.model_type,
        "topology": "moe" if layout.moe else "dense",
        "linear_attention": bool(layout.gdn_layers),
        "_config_fields": declaration.expression(),
        "_config_functions": declaration.source(),
        "_layout_note": declaration.note,
        **targets,
        "disable_mtp_for_training": layout.mtp_layers > 0,
        # The native_vllm_lora stage holds this to account against the installed vLLM.
        "vllm_lora_native": True,
        "vllm_lora_reason": f"vLLM's {architecture} implements SupportsLoRA",
        "transformers_floor": tested_minimum("transformers"),
        "_megatron_core_floor": tested_minimum("megatron-core"),
        "_megatron_bridge_floor": MEGATRON_BRIDGE_FLOOR,
        "author": _literal(author),
        "_reference_config_json": json.dumps(source.raw_config, indent=2),
        "_tiny_config_json": json.dumps(tiny_config(source.raw_config, fields), indent=2),
    }


def _decoder_linears(config: Any) -> set[str]:
    """Leaf names of the HF model's decoder-layer linear modules (built on the meta device)."""
    import torch

    from model_support.core.validate import build_meta_model

    model = build_meta_model(config)
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if ".layers." in name and isinstance(module, torch.nn.Linear)
    }


def _stored_expert_targets(config: Any) -> tuple[LoraTarget, ...] | None:
    """Expert targets under the names a checkpoint stores where transformers fuses the experts in memory and reads
    other names (Mixtral's ``w1``, ``w3`` / ``w2``): the sources of its own conversion into ``experts.gate_up_proj``
    (gate then up: Megatron's ``linear_fc1``) and ``experts.down_proj`` (``linear_fc2``). None: the standard names."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    from model_support.core.spec import TargetScope
    from model_support.core.validate import build_meta_model

    sources: dict[str, tuple[str, ...]] = {}
    for conversion in get_model_conversion_mapping(build_meta_model(config)):
        if not isinstance(conversion, WeightConverter) or len(conversion.target_patterns) != 1:
            continue
        fused = conversion.target_patterns[0].rsplit(".", 1)[-1]
        names = [re.fullmatch(r"\.experts\.\*\.(\w+)\.weight", p) for p in conversion.source_patterns]
        if fused in ("gate_up_proj", "down_proj") and all(names):
            sources[fused] = tuple(m.group(1) for m in names if m)
    standard = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    if set(sources) != set(standard) or sources == standard:
        return None
    return (
        LoraTarget("linear_fc1", sources["gate_up_proj"], TargetScope.EXPERT),
        LoraTarget("linear_fc2", sources["down_proj"], TargetScope.EXPERT),
    )


def _fallback_targets(config: Any, layout: Any) -> BridgeTargets:
    """The standard targets the layout implies, where no bridge can be read; experts under the names the checkpoint
    stores where transformers' conversion reads others."""
    from model_support.core import targets

    found = targets.ATTENTION + (targets.GATED_DELTANET if layout.gdn_layers else ())
    if layout.moe:
        found += _stored_expert_targets(config) or targets.EXPERTS
        found += targets.SHARED_EXPERT if layout.moe.has_shared_expert else ()
    else:
        found += targets.DENSE_MLP
    return BridgeTargets("", found, ())


def _targets(config: Any, layout: Any) -> dict[str, Any]:
    """The template's LoRA-target variables: from the family's megatron-bridge mappings, or (no bridge) the standard
    targets the layout implies, with a one-line note (the template wraps it into comment lines) that says which."""
    from model_support.plugins.bridge_targets import BridgeTargetsError, bridge_targets

    try:
        found = bridge_targets(config, layout, _decoder_linears(config))
    except BridgeTargetsError as exc:
        fallback = _fallback_targets(config, layout)
        return {
            "_lora_targets": fallback.expression(),
            "_target_constants": fallback.definitions(),
            "_explicit_targets": bool(fallback.definitions()),
            "_targets_note": f"Not derived from a bridge: {_first_line(str(exc))}. "
            + (
                "Expert names: those transformers' checkpoint conversion reads. "
                if fallback.definitions()
                else "Check these names against the checkpoint."
            ),
            "_bridge": "",
        }
    unmapped = f" Not mapped by it (no LoRA here): {', '.join(found.unmapped)}." if found.unmapped else ""
    definitions = found.definitions()
    return {
        "_lora_targets": found.expression(),
        "_target_constants": definitions,
        "_explicit_targets": bool(definitions),
        "_targets_note": f"Derived from megatron-bridge's {found.bridge} mappings.{unmapped}",
        "_bridge": found.bridge,
    }


def generate(context: dict[str, Any], output_dir: Path, no_input: bool = True, overwrite: bool = False) -> Path:
    """Run the cookiecutter template; returns the generated package directory."""
    try:
        from cookiecutter.exceptions import CookiecutterException
        from cookiecutter.main import cookiecutter
    except ImportError:
        raise NewHandlerError("cookiecutter is not installed: pip install 'model-support[dev]'") from None

    with tempfile.TemporaryDirectory() as scratch:
        # Written where nothing else is, and copied to output_dir only once its handler loads.
        try:
            trial = Path(
                cookiecutter(
                    str(TEMPLATE),
                    no_input=no_input,
                    extra_context=context,
                    output_dir=str(Path(scratch) / "package"),
                    # No user config, and the replay file goes to a scratch directory.
                    default_config={"replay_dir": scratch, "cookiecutters_dir": scratch},
                )
            )
        except CookiecutterException as exc:
            raise NewHandlerError(f"the plugin template failed: {exc}") from None
        check_loads(trial)
        target = output_dir / trial.name
        if target.exists() and not overwrite:
            raise NewHandlerError(f"{target} already exists; pass --overwrite or choose another --output-dir")
        shutil.copytree(trial, target, dirs_exist_ok=True)
    return target


def check_loads(package: Path) -> None:
    """Import a generated package's handler in a child process (so this one keeps no module of it): a
    :class:`NewHandlerError` naming the error's last line when it does not load."""
    name = next((package / "src").iterdir()).name
    probe = f"import sys; sys.path.insert(0, {str(package / 'src')!r}); import {name}.handler as h; h.HANDLER"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise NewHandlerError(
            f"the handler it would write does not load ({last}); nothing was written: the options of "
            "`model-support new-handler --help` settle what the config leaves open (docs/adding-a-model.md)"
        )


def _layer_kind_options(values: Sequence[str]) -> dict[str, str]:
    """``--layer-kind KIND=AS`` values as {KIND: AS}."""
    kinds = {}
    for value in values:
        kind, sep, as_ = (part.strip() for part in value.partition("="))
        if not (sep and kind and as_):
            raise NewHandlerError(f"--layer-kind {value!r}: write it KIND=AS, e.g. sliding_attention={FULL_ATTENTION}")
        kinds[kind] = as_
    return kinds


_FIELD = "Config field holding"


def new_handler(
    config: Annotated[
        str, typer.Option("--config", "-c", help="config.json, model directory or cached hub id of the family.")
    ],
    name: Annotated[str | None, typer.Option(help="Handler name (default: the config's model_type).")] = None,
    description: Annotated[str | None, typer.Option(help="One-line description of the family.")] = None,
    author: Annotated[str, typer.Option(help="Package author.")] = "",
    output_dir: Annotated[Path, typer.Option("--output-dir", "-o", help="Where to create the package.")] = Path("."),
    no_input: Annotated[bool, typer.Option("--no-input", help="Do not prompt; use the flags and the config.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Overwrite an existing package directory.")] = False,
    experts_field: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help=f"{_FIELD} the routed expert count (e.g. num_local_experts, n_routed_experts)."
        ),
    ] = None,
    experts_per_token_field: Annotated[
        str | None,
        typer.Option(metavar="NAME", help=f"{_FIELD} the experts each token is routed to (e.g. experts_per_token)."),
    ] = None,
    expert_width_field: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help=f"{_FIELD} a routed expert's intermediate width (e.g. moe_intermediate_size)."
        ),
    ] = None,
    shared_expert_width_field: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help=f"{_FIELD} the shared expert's intermediate width (e.g. shared_expert_intermediate_size).",
        ),
    ] = None,
    shared_experts_field: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help=f"{_FIELD} the number of shared experts, each as wide as a routed one (e.g. n_shared_experts).",
        ),
    ] = None,
    dense_layers_field: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help=f"{_FIELD} the MoE model's dense-MLP layers: a count of leading layers (e.g. first_k_dense_replace) "
            "or a list of layer indices (e.g. mlp_only_layers).",
        ),
    ] = None,
    layer_kind: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KIND=AS",
            help=f"Build layer_types entry KIND as {FULL_ATTENTION} or {LINEAR_ATTENTION} (e.g. "
            f"sliding_attention={FULL_ATTENTION}); repeatable.",
        ),
    ] = None,
) -> None:
    """Generate a handler plugin package (pyproject entry point, declaration, reference config, tests).

    Where the config keeps its layout (expert count and widths, dense layers, layer kinds) is derived from the config
    and checked against megatron-bridge's provider; the field options and --layer-kind name it outright.
    """
    from model_support.core.registry import load_registry

    options = LayoutOptions(
        experts=experts_field,
        experts_per_token=experts_per_token_field,
        expert_width=expert_width_field,
        shared_expert_width=shared_expert_width_field,
        shared_experts=shared_experts_field,
        dense_layers=dense_layers_field,
        layer_kinds=_layer_kind_options(layer_kind or ()),
    )
    context = template_context(config, name, description, author, options)
    claims = load_registry().claims.get(context["architecture"], [])
    for entry in claims:
        typer.echo(
            f"warning: {context['architecture']} is already claimed by {entry.label()}; "
            "installing both makes the architecture a conflict (settle it with MODEL_SUPPORT_PREFER)",
            err=True,
        )
    package = generate(context, output_dir, no_input=no_input, overwrite=overwrite)
    typer.echo(f"created {package}")
    typer.echo(f"next: pip install -e {package} && model-support list && pytest {package}")
