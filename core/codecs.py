"""LoRA codecs: Megatron's fused LoRA tensors <-> a PEFT adapter with Hugging Face module names.

Pure tensor code (no Megatron import), so handlers can declare a codec anywhere.

Megatron side: one ``lora_A`` / ``lora_B`` pair per Megatron linear, keyed by the Megatron parameter name
(``decoder.layers.3.self_attention.linear_qkv.lora_A.weight``), in the canonical (tensor-parallel size 1)
layout. ``lora_A`` is [r, in], ``lora_B`` is [out, r]; the rows of ``lora_B`` follow the rows of the fused
base weight exactly as megatron-bridge lays them out:

* ``linear_qkv``: per query group ``[q heads (+ output-gate heads), k head, v head]`` (QKVMapping);
  Qwen3.5's gated ``q_proj`` keeps ``[q; gate]`` per head.
* ``linear_fc1`` (dense, shared expert, each expert): ``[gate; up]`` (GatedMLPMapping).
* GDN ``in_proj``: ``[q, k, v, z, b, a]``; ``in_proj_qkv`` is ``[q; k; v]`` (GDNLinearMappingSeparate).

A fused Megatron module shares one ``lora_A`` across the HF modules it covers, so :meth:`to_peft` writes
the same A for each of them, and :meth:`from_peft` refuses an adapter whose A differ (it cannot be
represented exactly in the fused layout).

PEFT side: ``base_model.model.<hf module>.lora_A.weight`` / ``lora_B.weight``; experts are addressed per
expert (``mlp.experts.<e>.gate_proj``), as the checkpoint and vLLM's fused-MoE LoRA name them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model_support.core.errors import ModelSupportError
from model_support.core.layout import ModelLayout, text_config

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_MEGATRON_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


class CodecError(ModelSupportError):
    """LoRA tensors do not fit the layout the codec expects."""


# How a fused Megatron output dimension splits into HF modules: (HF module suffix, row indices).
RowSplit = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class _Dims:
    heads: int
    groups: int
    head_dim: int
    output_gate: bool
    gdn_k: int  # GDN key heads x key head dim
    gdn_v: int  # GDN value heads x value head dim
    gdn_heads: int  # GDN value heads

    @classmethod
    def of(cls, config: Any) -> _Dims:
        cfg = text_config(config)
        heads = int(cfg.num_attention_heads)
        gdn_v_heads = int(getattr(cfg, "linear_num_value_heads", 0) or 0)
        return cls(
            heads=heads,
            groups=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            output_gate=bool(getattr(cfg, "attn_output_gate", False)),
            gdn_k=int(getattr(cfg, "linear_num_key_heads", 0) or 0) * int(getattr(cfg, "linear_key_head_dim", 0) or 0),
            gdn_v=gdn_v_heads * int(getattr(cfg, "linear_value_head_dim", 0) or 0),
            gdn_heads=gdn_v_heads,
        )


def _arange(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop)


def qkv_rows(d: _Dims) -> RowSplit:
    """Rows of Megatron's fused ``linear_qkv`` that form HF ``q_proj``, ``k_proj``, ``v_proj`` (in HF order)."""
    per_group = d.heads // d.groups
    q_width = 2 * d.head_dim if d.output_gate else d.head_dim
    group_rows = per_group * q_width + 2 * d.head_dim
    q, k, v = [], [], []
    for g in range(d.groups):
        base = g * group_rows
        for h in range(per_group):
            # Megatron holds a group's query heads, then (gated models) their gate heads; HF q_proj is
            # [q; gate] per head.
            q.append(_arange(base + h * d.head_dim, base + (h + 1) * d.head_dim))
            if d.output_gate:
                gate = base + per_group * d.head_dim + h * d.head_dim
                q.append(_arange(gate, gate + d.head_dim))
        kv = base + per_group * q_width
        k.append(_arange(kv, kv + d.head_dim))
        v.append(_arange(kv + d.head_dim, kv + 2 * d.head_dim))
    return [("q_proj", torch.cat(q)), ("k_proj", torch.cat(k)), ("v_proj", torch.cat(v))]


def gated_mlp_rows(out_rows: int) -> RowSplit:
    half = out_rows // 2
    return [("gate_proj", _arange(0, half)), ("up_proj", _arange(half, out_rows))]


def gdn_in_proj_rows(d: _Dims) -> RowSplit:
    qkv = 2 * d.gdn_k + d.gdn_v
    return [
        ("in_proj_qkv", _arange(0, qkv)),
        ("in_proj_z", _arange(qkv, qkv + d.gdn_v)),
        ("in_proj_b", _arange(qkv + d.gdn_v, qkv + d.gdn_v + d.gdn_heads)),
        ("in_proj_a", _arange(qkv + d.gdn_v + d.gdn_heads, qkv + d.gdn_v + 2 * d.gdn_heads)),
    ]


def _gated(_d: _Dims, rows: int) -> RowSplit:
    return gated_mlp_rows(rows)


@dataclass(frozen=True)
class _Module:
    """A Megatron LoRA module (path below ``decoder.layers.N.``), its HF parent module, and how it splits.

    ``split`` is a row split of lora_B (fused module) or the single HF module name. ``{e}`` is an expert index.
    """

    megatron: str
    hf_parent: str
    split: Callable[[_Dims, int], RowSplit] | str

    def _regex(self, template: str) -> re.Pattern[str]:
        return re.compile("^" + re.escape(template).replace(r"\{e\}", r"(?P<e>\d+)") + "$")

    def match_megatron(self, path: str) -> dict[str, str] | None:
        m = self._regex(self.megatron).match(path)
        return m.groupdict() if m else None

    def match_hf(self, parent: str) -> dict[str, str] | None:
        m = self._regex(self.hf_parent).match(parent)
        return m.groupdict() if m else None

    def names(self, dims: _Dims, rows: int) -> list[str]:
        return [self.split] if isinstance(self.split, str) else [n for n, _ in self.split(dims, rows)]


_MODULES = (
    _Module("self_attention.linear_qkv", "self_attn", lambda d, _n: qkv_rows(d)),
    _Module("self_attention.linear_proj", "self_attn", "o_proj"),
    _Module("self_attention.in_proj", "linear_attn", lambda d, _n: gdn_in_proj_rows(d)),
    _Module("self_attention.out_proj", "linear_attn", "out_proj"),
    _Module("mlp.linear_fc1", "mlp", _gated),
    _Module("mlp.linear_fc2", "mlp", "down_proj"),
    _Module("mlp.shared_experts.linear_fc1", "mlp.shared_expert", _gated),
    _Module("mlp.shared_experts.linear_fc2", "mlp.shared_expert", "down_proj"),
    _Module("mlp.experts.local_experts.{e}.linear_fc1", "mlp.experts.{e}", _gated),
    _Module("mlp.experts.local_experts.{e}.linear_fc2", "mlp.experts.{e}", "down_proj"),
)


def hf_layers_prefix(config: Any) -> str:
    """HF prefix of the decoder layers: ``model.layers.``, or ``model.language_model.layers.`` (multimodal)."""
    return "model.language_model.layers." if text_config(config) is not config else "model.layers."


class QwenLoraCodec:
    """The LoRA codec of the Qwen3 / Qwen3-MoE / Qwen3.5 families (megatron-bridge's fused layouts)."""

    def __init__(self, name: str = "qwen") -> None:
        self.name = name

    def _resolve(self, path: str) -> tuple[_Module, dict[str, str]]:
        for module in _MODULES:
            groups = module.match_megatron(path)
            if groups is not None:
                return module, groups
        raise CodecError(f"{self.name} codec: no HF module for Megatron LoRA module {path!r}")

    def to_peft(self, tensors: Mapping[str, torch.Tensor], config: Any, layout: ModelLayout) -> dict[str, torch.Tensor]:
        dims = _Dims.of(config)
        prefix = PEFT_PREFIX + hf_layers_prefix(config)
        pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            match = _MEGATRON_KEY.match(key)
            if not match:
                raise CodecError(f"{self.name} codec: not a Megatron LoRA tensor name: {key!r}")
            layer, path, which = match.groups()
            if int(layer) >= layout.num_layers:
                raise CodecError(f"{key!r}: layer {layer} but the model has {layout.num_layers}")
            pairs.setdefault((layer, path), {})[which] = value
        out: dict[str, torch.Tensor] = {}
        for (layer, path), pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise CodecError(f"decoder.layers.{layer}.{path}: needs both lora_A and lora_B")
            lora_a, lora_b = pair["A"], pair["B"]
            module, groups = self._resolve(path)
            where = f"{prefix}{layer}.{module.hf_parent.format(**groups)}."
            if isinstance(module.split, str):
                out[f"{where}{module.split}.lora_A.weight"] = lora_a.clone()
                out[f"{where}{module.split}.lora_B.weight"] = lora_b.clone()
                continue
            split = module.split(dims, lora_b.shape[0])
            covered = sum(len(rows) for _, rows in split)
            if covered != lora_b.shape[0]:
                raise CodecError(
                    f"decoder.layers.{layer}.{path}: lora_B has {lora_b.shape[0]} rows, the {self.name} layout "
                    f"for this config covers {covered}"
                )
            for hf_name, rows in split:
                out[f"{where}{hf_name}.lora_A.weight"] = lora_a.clone()
                out[f"{where}{hf_name}.lora_B.weight"] = lora_b[rows].clone()
        return out

    def from_peft(
        self, tensors: Mapping[str, torch.Tensor], config: Any, layout: ModelLayout
    ) -> dict[str, torch.Tensor]:
        dims = _Dims.of(config)
        prefix = PEFT_PREFIX + hf_layers_prefix(config)
        hf_key = re.compile(rf"^{re.escape(prefix)}(\d+)\.(.+)\.([A-Za-z_]+)\.lora_([AB])\.weight$")
        grouped: dict[tuple[str, str], dict[str, dict[str, torch.Tensor]]] = {}
        for key, value in tensors.items():
            match = hf_key.match(key)
            if not match:
                raise CodecError(f"{self.name} codec: not a PEFT LoRA tensor of this model: {key!r}")
            layer, parent, name, which = match.groups()
            grouped.setdefault((layer, parent), {}).setdefault(name, {})[which] = value
        out: dict[str, torch.Tensor] = {}
        for (layer, parent), modules in grouped.items():
            used: set[str] = set()
            for module in _MODULES:
                groups = module.match_hf(parent)
                if groups is None:
                    continue
                rows = sum(modules[n]["B"].shape[0] for n in ("gate_proj", "up_proj") if "B" in modules.get(n, {}))
                names = module.names(dims, rows)
                present = [n for n in names if n in modules]
                if not present:
                    continue
                if len(present) != len(names) or any(set(modules[n]) != {"A", "B"} for n in names):
                    raise CodecError(f"layer {layer} {parent}: needs lora_A and lora_B of all of {names}")
                lora_a = modules[names[0]]["A"]
                for n in names[1:]:
                    if not torch.equal(modules[n]["A"], lora_a):
                        raise CodecError(
                            f"layer {layer} {parent}.{n}: lora_A differs from {names[0]}'s; the fused Megatron "
                            f"module {module.megatron} has one lora_A"
                        )
                if isinstance(module.split, str):
                    lora_b = modules[module.split]["B"]
                else:
                    split = module.split(dims, rows)
                    lora_b = lora_a.new_empty((sum(len(r) for _, r in split), lora_a.shape[0]))
                    for n, r in split:
                        lora_b[r] = modules[n]["B"]
                target = f"decoder.layers.{layer}.{module.megatron.format(**groups)}"
                out[f"{target}.lora_A.weight"] = lora_a.clone()
                out[f"{target}.lora_B.weight"] = lora_b.clone()
                used.update(names)
            leftover = sorted(set(modules) - used)
            if leftover:
                raise CodecError(f"{self.name} codec: no Megatron module for layer {layer} {parent}.{leftover[0]}")
        return out


def save_peft_adapter(
    out_dir: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    base_model: str = "",
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
        "target_modules": sorted({key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for key in tensors}),
        "modules_to_save": None,
    }
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out_dir / ADAPTER_WEIGHTS))
    return out_dir


def load_peft_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config, tensors) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    config_path, weights = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not config_path.exists() or not weights.exists():
        raise CodecError(f"{adapter_dir} is not a PEFT adapter (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    return json.loads(config_path.read_text()), load_file(str(weights))
