"""LoRA codecs and PEFT's on-disk adapter format.

A codec maps Megatron's fused LoRA tensors to a PEFT adapter with Hugging Face module names and back. Megatron
side: one ``lora_A`` [r, in] / ``lora_B`` [out, r] pair per Megatron linear, keyed by the Megatron parameter name
(``decoder.layers.3.self_attention.linear_qkv.lora_A.weight``), in the canonical (tensor-parallel size 1) layout;
the rows of ``lora_B`` follow the rows of the fused base weight. PEFT side:
``base_model.model.<hf module>.lora_A.weight`` / ``lora_B.weight``, experts addressed per expert
(``mlp.experts.<e>.gate_proj``), as the checkpoint, vLLM's fused-MoE LoRA and the merged-weight exporter name them.

:class:`BridgeLoraCodec` derives every split from the model family's megatron-bridge mapping registry, with no row
tables of its own. For a Megatron LoRA module ``decoder.layers.N.<path>`` it takes the bridge mapping of the base
parameter ``decoder.layers.N.<path>.weight``: the very object that loads and exports that weight (``QKVMapping``,
``GatedMLPMapping``, ``GDNLinearMappingSeparate``, the per-expert ``GatedMLPMapping`` / ``AutoMapping``,
``AutoMapping`` for a 1:1 linear). It learns the mapping's split once per config and shape by running the
mapping's own ``megatron_to_hf`` on a probe: an integer tensor of the base weight's shape whose every row holds
its row index. Each HF tensor the mapping returns then lists the fused rows it is made of. The probe must come
back as a partition of the rows (every row in exactly one HF tensor, whole and unchanged); a mapping that does
anything else is not a row split, and the codec refuses the module instead of guessing.

A mapping that stores each expert's rows as the columns of one stacked tensor (gpt-oss's ``experts.gate_up_proj``
[experts, in, out]) is split the same way; the experts' LoRA of such a tensor is written in PEFT's
``target_parameters`` layout: one A [r * experts, in] expert by expert, one B [out, r * experts] with expert e's
rank k in column k * experts + e, under ``<experts module>(.base_layer)*`` (PEFT nests the parameters' wrappers
in the order the module registers them, the first innermost).

``lora_B`` has the row structure of the base weight, so an HF module's B is ``lora_B[rows]``; the ``lora_A`` of
a fused module is shared, so :meth:`BridgeLoraCodec.to_peft` writes the same A for each HF module and
:meth:`BridgeLoraCodec.from_peft` refuses A that differ (they cannot be represented exactly in the fused layout).
``from_peft`` finds the Megatron module of an HF name with the bridge's reverse lookup and scatters the B's back
into their rows: the exact inverse.

Megatron is imported on the first conversion, never when a codec is created (handlers create it at import).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from model_support.core.errors import ModelSupportError
from model_support.core.layout import ModelLayout, text_config

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class CodecError(ModelSupportError):
    """LoRA tensors do not fit the layout the codec expects."""


def hf_layers_prefix(config: Any) -> str:
    """HF prefix of the decoder layers: ``model.layers.``, or ``model.language_model.layers.`` (multimodal)."""
    return "model.language_model.layers." if text_config(config) is not config else "model.layers."


_MEGATRON_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_DECODER = "decoder.layers."
_WEIGHT = ".weight"
# Hand-written: the text model's bridge (the one the Megatron model is built with) names the decoder layers
# model.layers.; PEFT names use the checkpoint's own prefix (model.language_model.layers. if multimodal).
_HF_LAYERS = "model.layers."
# A layer or expert number inside a parameter name: the split of a mapping does not depend on it.
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")

if TYPE_CHECKING:  # torch is imported where tensors are handled: a handler declaring its codec stays light
    import torch

    # (role in the mapping's ``hf_param``, fused rows of that HF tensor); role "" for a mapping with one HF tensor.
    _RowSplit = list[tuple[str, torch.Tensor]]

# A stacked expert tensor (gpt-oss's ``experts.gate_up_proj`` [experts, in, out]) under the decoder layers.
_STACKED = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<path>.+\.experts)\.(?P<param>\w+)$")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
# PEFT's key of a stacked parameter's LoRA (``target_parameters``): parameters wrap one another in the order the
# module registers them, the first innermost (``experts.base_layer.lora_A`` for gpt-oss's gate_up_proj).
PEFT_STACKED = re.compile(r"^(?P<module>.+\.experts)(?P<nest>(?:\.base_layer)*)\.lora_(?P<which>[AB])\.weight$")


class _OneRank:
    """A process group of this rank alone, for the mappings' TP / PP / EP groups.

    Canonical LoRA tensors are whole (the tensor-parallel size 1 layout) on every rank, so the mappings must
    neither shard nor gather them, whatever parallel state the process runs under.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _hf_params(mapping: Any) -> dict[str, str]:
    """The HF tensor names of a (resolved) mapping by role."""
    return {"": mapping.hf_param} if isinstance(mapping.hf_param, str) else dict(mapping.hf_param)


def _layer_of(megatron_name: str) -> int:
    return int(megatron_name[len(_DECODER) :].split(".", 1)[0])


@dataclass
class _Family:
    """The bridge of one config: its decoder-layer weight mappings, what they read, and the splits learnt so far."""

    codec: str  # the codec's name, for messages
    registry: Any  # MegatronMappingRegistry of the decoder layers' ``*.weight`` mappings
    module: SimpleNamespace  # what a mapping gets as the Megatron module
    layers_prefix: str  # the checkpoint's prefix of the decoder layers (PEFT names)
    # PEFT's target_parameters of the stacked expert tensors the bridge maps LoRA linears to (gpt-oss:
    # mlp.experts.gate_up_proj, mlp.experts.down_proj), in the order the transformers experts module registers them.
    stacked_params: tuple[str, ...] = ()
    splits: dict[tuple[str, int, int], _RowSplit] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Any, codec: str) -> _Family:
        from model_support.core.megatron.builder import MegatronBuildError, family_bridge, mapping_registry

        try:
            model_bridge, tcfg = family_bridge(config)
        except MegatronBuildError as exc:
            raise CodecError(f"{codec} codec: {exc}") from None
        from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

        # No checkpoint: a bridge that picks expert mappings by the checkpoint's keys (Qwen3.5-MoE) takes its default,
        # per-expert names (experts.<e>.gate_proj), which is how PEFT and vLLM address experts in any checkpoint.
        from model_support.core.megatron.state_source import hf_pretrained

        shim = hf_pretrained(tcfg)
        model_bridge.hf_pretrained = shim
        provider = model_bridge.provider_bridge(shim)
        # Parameters named `<module>.weight`: the linears LoRA wraps (not grouped-GEMM `weight<e>`), so the reverse
        # lookup of experts.<e>.gate_proj finds the per-expert module local_experts.<e>.linear_fc1.
        weights = [
            m
            for m in mapping_registry(model_bridge).mappings
            if m.megatron_param.startswith(_DECODER) and m.megatron_param.endswith(_WEIGHT)
        ]
        registry = MegatronMappingRegistry(*weights)
        one = _OneRank()
        registry.set_process_groups_from_pg_collection(SimpleNamespace(tp=one, pp=one, ep=one, expt_tp=one))
        # Hand-written: no live Megatron module exists here. The provider carries the sizes the mappings read, and
        # a canonical tensor is not tensor-parallel (AutoMapping then takes its replicated, pass-through delegate).
        module = SimpleNamespace(config=provider, tensor_model_parallel=False)
        return cls(codec, registry, module, hf_layers_prefix(config), _stacked_params(config, weights))

    def lookup(self, megatron_module: str) -> Any:
        """The mapping of ``<megatron_module>.weight`` (resolved for its layer / expert)."""
        mapping = self.registry.megatron_to_hf_lookup(megatron_module + _WEIGHT)
        if mapping is None:
            path = megatron_module[len(_DECODER) :].split(".", 1)[1]
            raise CodecError(f"{self.codec} codec: no HF module for Megatron LoRA module {path!r}")
        return mapping

    def reverse(self, peft_module: str) -> tuple[Any, str]:
        """(mapping, role) of the HF module named ``peft_module`` (below ``base_model.model.``)."""
        hf_name = _HF_LAYERS + peft_module[len(self.layers_prefix) :] + _WEIGHT
        mapping = self.registry.hf_to_megatron_lookup(hf_name)
        if mapping is None:
            raise CodecError(f"{self.codec} codec: no Megatron module for {peft_module}")
        role = next(role for role, name in _hf_params(mapping).items() if name == hf_name)
        return mapping, role

    def peft_module(self, mapping: Any, role: str) -> str:
        """The PEFT module name (below ``base_model.model.``) of the mapping's HF tensor ``role``."""
        hf_name = _hf_params(mapping)[role]
        if not (hf_name.startswith(_HF_LAYERS) and hf_name.endswith(_WEIGHT)):
            raise CodecError(
                f"{self.codec} codec: megatron-bridge maps {mapping.megatron_param} to {hf_name}, not to the weight "
                "of one HF linear module (a PEFT adapter needs one)"
            )
        return self.layers_prefix + hf_name[len(_HF_LAYERS) : -len(_WEIGHT)]

    def stacked(self, mapping: Any, role: str) -> str | None:
        """PEFT's module of the LoRA of the stacked expert tensor that is the mapping's HF tensor ``role`` (the
        experts module, ``.base_layer`` once per parameter registered after it), or None."""
        match = _STACKED.match(_hf_params(mapping)[role])
        if match is None:
            return None
        after = len(self.stacked_params) - 1 - self.stacked_params.index(f"{match['path']}.{match['param']}")
        return f"{self.layers_prefix}{match['layer']}.{match['path']}" + ".base_layer" * after

    def expert_module(self, stacked_tensor: str, expert: int) -> tuple[str, Any]:
        """The Megatron LoRA module (and its mapping) of one expert's slice of a stacked tensor (its PEFT name)."""
        hf_name = _HF_LAYERS + stacked_tensor[len(PEFT_PREFIX + self.layers_prefix) :]
        layer = hf_name[len(_HF_LAYERS) :].split(".", 1)[0]
        for linear in ("linear_fc1", "linear_fc2"):
            module = f"{_DECODER}{layer}.mlp.experts.local_experts.{expert}.{linear}"
            mapping = self.registry.megatron_to_hf_lookup(module + _WEIGHT)
            if mapping is not None and _hf_params(mapping).get("") == hf_name:
                return module, mapping
        raise CodecError(f"{self.codec} codec: no Megatron expert module for {hf_name} (expert {expert})")

    def split(self, mapping: Any, rows: int, cols: int) -> _RowSplit:
        """How the mapping splits a fused [rows, cols] weight: the fused rows of each HF tensor, in role order."""
        key = (_INDEX.sub("*", mapping.megatron_param), rows, cols)
        if key not in self.splits:
            self.splits[key] = self._derive(mapping, rows, cols)
        return self.splits[key]

    def _derive(self, mapping: Any, rows: int, cols: int) -> _RowSplit:
        import torch

        module, kind = mapping.megatron_param.removesuffix(_WEIGHT), type(mapping).__name__
        # Every row holds its index (a broadcast view: memory only where the mapping itself copies rows).
        probe = torch.arange(rows, dtype=torch.int32).unsqueeze(1).expand(rows, cols)
        try:
            parts = mapping.megatron_to_hf(probe, self.module)
        except Exception as exc:  # the bridge's shape errors (view, split, assert) do not name the module
            reason = str(exc).splitlines()[0] if str(exc) else ""
            raise CodecError(
                f"{module}: megatron-bridge's {kind} cannot split a [{rows}, {cols}] weight of this config "
                f"({type(exc).__name__}: {reason}); does the LoRA match the model?"
            ) from None
        order = list(_hf_params(mapping))
        roles = {name: role for role, name in _hf_params(mapping).items()}
        found: dict[str, torch.Tensor] = {}
        for name, part in parts.items():
            rows_of = None
            if name in roles and part.ndim == 2 and part.dtype == probe.dtype:
                if part.shape[1] == cols and torch.equal(part[:, 0], part[:, -1]):
                    rows_of = part[:, 0]
                # A stacked expert tensor holds each expert's weight as [in, out]: the fused rows are its columns.
                elif _STACKED.match(name) and part.shape[0] == cols and torch.equal(part[0], part[-1]):
                    rows_of = part[0]
            if rows_of is None:
                raise CodecError(
                    f"{module}: megatron-bridge's {kind} does more than select rows of the fused weight "
                    f"(it returns {name} {tuple(part.shape)}), so a LoRA B cannot be split with it"
                )
            found[roles[name]] = rows_of.long()
        used = torch.cat(list(found.values())).sort().values if found else torch.empty(0, dtype=torch.long)
        if set(found) != set(order) or not torch.equal(used, torch.arange(rows)):
            raise CodecError(
                f"{module}: megatron-bridge's {kind} does not place every row of the fused weight in exactly one "
                "HF tensor (unchanged), so a LoRA B cannot be split with it"
            )
        return [(role, found[role]) for role in order]


def _stacked_params(config: Any, mappings: list[Any]) -> tuple[str, ...]:
    """PEFT's target_parameters (``mlp.experts.gate_up_proj``) of the stacked expert tensors ``mappings`` read, in
    the order the transformers experts module registers them (the order PEFT nests their wrappers in)."""
    names = {
        f"{match['path']}.{match['param']}"
        for mapping in mappings
        for name in _hf_params(mapping).values()
        if (match := _STACKED.match(name.replace("*", "0")))
    }
    if not names:
        return ()
    from model_support.core.meta_model import build_meta_model

    path = next(iter(names)).rsplit(".", 1)[0]
    experts = next(m for n, m in build_meta_model(config).named_modules() if n.endswith(f".{path}"))
    return tuple(f"{path}.{n}" for n, _ in experts.named_parameters(recurse=False) if f"{path}.{n}" in names)


def stack_experts(factors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert LoRA factors (A_e [r, in], B_e [out, r], expert by expert) as PEFT's LoRA of a stacked tensor:
    A [r * E, in] expert by expert, B [out, r * E] with expert e's rank k in column k * E + e."""
    import torch

    return torch.cat([a for a, _ in factors]), torch.stack([b for _, b in factors], dim=-1).flatten(1)


def expert_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-expert factors (A_e, B_e) of PEFT's LoRA of a stacked tensor: the inverse of :func:`stack_experts`."""
    rank = lora_a.shape[0] // experts
    b = lora_b.reshape(lora_b.shape[0], rank, experts)
    return [(lora_a[e * rank : (e + 1) * rank], b[:, :, e]) for e in range(experts)]


class BridgeLoraCodec:
    """The LoRA codec of any family whose megatron-bridge mappings split fused weights by rows.

    Every split (fused QKV with or without output gate, gate/up of dense, shared-expert and expert MLPs, GDN
    ``in_proj``, 1:1 linears) and every HF name comes from the family's bridge, learnt per config on the first
    :meth:`to_peft` / :meth:`from_peft` and cached.
    """

    def __init__(self, name: str = "bridge") -> None:
        self.name = name
        self._families: dict[str, _Family] = {}

    def _family(self, config: Any) -> _Family:
        key = config.to_json_string()
        if key not in self._families:
            self._families[key] = _Family.of(config, self.name)
        return self._families[key]

    def target_parameters(self, config: Any) -> tuple[str, ...]:
        """PEFT's ``target_parameters`` of the family's stacked expert tensors (``mlp.experts.gate_up_proj``)."""
        return self._family(config).stacked_params

    def to_peft(self, tensors: Mapping[str, torch.Tensor], config: Any, layout: ModelLayout) -> dict[str, torch.Tensor]:
        """Megatron LoRA tensors (canonical layout) -> PEFT tensors named after the HF modules."""
        family = self._family(config)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            match = _MEGATRON_KEY.match(key)
            if not match:
                raise CodecError(f"{self.name} codec: not a Megatron LoRA tensor name: {key!r}")
            layer, path, which = match.groups()
            if int(layer) >= layout.num_layers:
                raise CodecError(f"{key!r}: layer {layer} but the model has {layout.num_layers}")
            pairs.setdefault(f"{_DECODER}{layer}.{path}", {})[which] = value
        out: dict[str, torch.Tensor] = {}
        stacked: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise CodecError(f"{module}: needs both lora_A and lora_B")
            lora_a, lora_b = pair["A"], pair["B"]
            mapping = family.lookup(module)
            for role, rows in family.split(mapping, lora_b.shape[0], lora_a.shape[1]):
                where = family.stacked(mapping, role)
                if where is not None:  # one expert's slice of a stacked tensor: written with the others below
                    expert = int(_LOCAL_EXPERT.search(module).group(1))  # type: ignore[union-attr]
                    stacked.setdefault(where, {})[expert] = (lora_a, lora_b[rows])
                    continue
                name = PEFT_PREFIX + family.peft_module(mapping, role)
                out[f"{name}.lora_A.weight"] = lora_a.clone()
                out[f"{name}.lora_B.weight"] = lora_b[rows].clone()
        for peft_module, by_expert in stacked.items():
            count = layout.moe.num_experts if layout.moe else 0
            if sorted(by_expert) != list(range(count)):
                raise CodecError(f"{peft_module}: LoRA of experts {sorted(by_expert)}, not of all {count}")
            name = PEFT_PREFIX + peft_module
            lora_a, lora_b = stack_experts([by_expert[e] for e in range(count)])
            out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = lora_a, lora_b
        return out

    @staticmethod
    def _from_stacked(
        family: _Family, tensors: Mapping[str, torch.Tensor], layout: ModelLayout
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the other PEFT tensors, the Megatron LoRA of each expert of the stacked parameters' LoRA in ``tensors``)."""
        rest, out = {}, {}
        count = layout.moe.num_experts if layout.moe else 0
        for key, value in tensors.items():
            target = stacked_target(key, family.stacked_params)
            if target is None:
                rest[key] = value
                continue
            if target[1] == "B":
                continue  # read with its A
            lora_a, lora_b = value, tensors[key[: -len("A.weight")] + "B.weight"]
            if count == 0 or lora_a.shape[0] % count or lora_b.shape[1] != lora_a.shape[0]:
                raise CodecError(
                    f"{key}: {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} is no LoRA of {count} experts"
                )
            for expert, (a, b) in enumerate(expert_factors(lora_a, lora_b, count)):
                module, mapping = family.expert_module(target[0], expert)
                ((_, rows),) = family.split(mapping, b.shape[0], a.shape[1])
                fused = b.new_empty(b.shape)
                fused[rows] = b
                out[f"{module}.lora_A.weight"] = a.clone()
                out[f"{module}.lora_B.weight"] = fused
        return rest, out

    def from_peft(
        self, tensors: Mapping[str, torch.Tensor], config: Any, layout: ModelLayout
    ) -> dict[str, torch.Tensor]:
        """PEFT tensors -> Megatron LoRA tensors (canonical layout); the exact inverse of :meth:`to_peft`."""
        import torch

        family = self._family(config)
        peft_key = re.compile(rf"^{re.escape(PEFT_PREFIX + family.layers_prefix)}(\d+\..+)\.lora_([AB])\.weight$")
        tensors, out = self._from_stacked(family, tensors, layout)
        grouped: dict[str, tuple[Any, dict[str, dict[str, torch.Tensor]]]] = {}
        for key, value in tensors.items():
            match = peft_key.match(key)
            if not match:
                raise CodecError(f"{self.name} codec: not a PEFT LoRA tensor of this model: {key!r}")
            peft_module, which = match.groups()
            mapping, role = family.reverse(family.layers_prefix + peft_module)
            module = mapping.megatron_param.removesuffix(_WEIGHT)
            if _layer_of(module) >= layout.num_layers:
                raise CodecError(f"{key!r}: layer {_layer_of(module)} but the model has {layout.num_layers}")
            grouped.setdefault(module, (mapping, {}))[1].setdefault(role, {})[which] = value
        for module, (mapping, by_role) in grouped.items():
            names = {role: family.peft_module(mapping, role) for role in _hf_params(mapping)}
            if set(by_role) != set(names) or any(set(pair) != {"A", "B"} for pair in by_role.values()):
                raise CodecError(f"{module}: needs lora_A and lora_B of all of {list(names.values())}")
            first, *others = names
            lora_a = by_role[first]["A"]
            for role in others:
                if not torch.equal(by_role[role]["A"], lora_a):
                    leaf = names[first].rsplit(".", 1)[-1]
                    raise CodecError(
                        f"{names[role]}: lora_A differs from {leaf}'s; the fused Megatron module {module} has one "
                        "lora_A"
                    )
            rank = lora_a.shape[0]
            rows = sum(pair["B"].shape[0] for pair in by_role.values())
            lora_b = by_role[first]["B"].new_empty((rows, rank))
            for role, index in family.split(mapping, rows, lora_a.shape[1]):
                part = by_role[role]["B"]
                if tuple(part.shape) != (len(index), rank):
                    raise CodecError(
                        f"{names[role]}: lora_B is {tuple(part.shape)}, the bridge's split of {module} needs "
                        f"{(len(index), rank)}"
                    )
                lora_b[index] = part
            out[f"{module}.lora_A.weight"] = lora_a.clone()
            out[f"{module}.lora_B.weight"] = lora_b
        return out


def stacked_target(key: str, target_parameters: Sequence[str]) -> tuple[str, str] | None:
    """(the stacked tensor's name, ``"A"`` or ``"B"``) that a PEFT key of a stacked parameter's LoRA addresses (e.g.
    ``...mlp.experts.base_layer.lora_A.weight`` -> ``...mlp.experts.gate_up_proj``); None for any other key.
    ``target_parameters``: the adapter's, in the order the experts module registers them (the exporter writes them
    so), which is how PEFT nests their wrappers."""
    match = PEFT_STACKED.match(key) if target_parameters else None
    if match is None:
        return None
    params = [name.rsplit(".", 1)[-1] for name in target_parameters]
    return f"{match['module']}.{params[len(params) - 1 - match['nest'].count('.base_layer')]}", match["which"]


def save_peft_adapter(
    out_dir: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    base_model: str = "",
    target_parameters: tuple[str, ...] = (),
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's on-disk LoRA format).

    ``target_modules`` is derived from the tensors themselves (their leaf module names), so the config can
    never list a module the adapter does not hold, nor miss one it does.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "target_modules": sorted(
            {key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for key in tensors if not PEFT_STACKED.match(key)}
        ),
        "modules_to_save": None,
    }
    if target_parameters:  # stacked expert tensors, in the order their module registers them (PEFT nests them so)
        config["target_parameters"] = list(target_parameters)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out_dir / ADAPTER_WEIGHTS))
    return out_dir


def peft_rank_and_scale(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """The rank and the scale PEFT and vLLM (its ``PEFTHelper``) give ``module`` of an adapter (its name in the
    adapter's tensors, without PEFT's prefix): ``rank_pattern`` / ``alpha_pattern`` overrides matched as PEFT's
    ``get_pattern_key`` matches them (a key matches a suffix of the name at a "." boundary; the first wins), and
    ``alpha / sqrt(r)`` under ``use_rslora``, else ``alpha / r``. Written by hand: PEFT is a development dependency,
    and a trainer exports and merges adapters without it."""

    def override(patterns: Mapping[str, Any] | None, default: Any) -> Any:
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    rank = int(override(config.get("rank_pattern"), config["r"]))
    alpha = float(override(config.get("alpha_pattern"), config["lora_alpha"]))
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_peft_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config, tensors) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    config_path, weights = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not config_path.exists() or not weights.exists():
        raise CodecError(f"{adapter_dir} is not a PEFT adapter (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    return json.loads(config_path.read_text()), load_file(str(weights))
