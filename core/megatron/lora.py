"""LoRA on megatron-core's tensor-parallel linears, with base weights frozen.

:class:`LoraLinear` wraps a ``ColumnParallelLinear`` or ``RowParallelLinear`` in place and adds
``scale * B(A(x))``:

* column-parallel (``linear_qkv``, ``linear_fc1``, GDN ``in_proj``): A [r, in] is replicated, B holds
  this rank's output rows; ``copy_to_tensor_model_parallel_region`` after A all-reduces A's gradient.
* row-parallel (``linear_proj``, ``linear_fc2``, GDN ``out_proj``): A holds this rank's input columns,
  B [out, r] is replicated; ``reduce_from_tensor_model_parallel_region`` sums the partial A(x).

:func:`lora_state` / :func:`load_lora_state` move LoRA tensors between the ranks' shards and the
canonical (TP=1) layout the codecs use. A fused output dimension is sharded per section
(``[gate; up]`` of fc1, ``[q, k, v, z, b, a]`` of GDN ``in_proj``), as Megatron shards the base weight;
``linear_qkv`` shards by query group, i.e. contiguously.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model_support.core.errors import ModelSupportError
from model_support.core.spec import HandlerSpec, LoraTarget, TargetScope

# Where each scope's modules sit below ``decoder.layers.N.`` (the parent of the Megatron leaf name).
_SCOPE_PARENT = {
    TargetScope.ATTENTION: r"self_attention",
    TargetScope.GDN: r"self_attention",
    TargetScope.MLP: r"mlp",
    TargetScope.EXPERT: r"mlp\.experts\.local_experts\.\d+",
    TargetScope.SHARED_EXPERT: r"mlp\.shared_experts",
}


class LoraError(ModelSupportError):
    """LoRA could not be applied as declared."""


class LoraLinear(torch.nn.Module):
    """A frozen tensor-parallel linear plus a trainable low-rank update."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, sections: list[int]) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        if not isinstance(base, ColumnParallelLinear | RowParallelLinear):
            raise LoraError(f"LoRA wraps ColumnParallelLinear / RowParallelLinear, not {type(base).__name__}")
        if getattr(base, "explicit_expert_comm", False):
            # Expert linears under expert tensor parallelism leave their communication to the token
            # dispatcher; the LoRA branch's copy/reduce would double it. Not supported yet.
            raise LoraError("LoRA on expert linears with expert tensor parallelism > 1 is not supported")
        self.base = base
        self.column = isinstance(base, ColumnParallelLinear)
        self.group = base.tp_group
        self.tp = self.group.size()
        weight = base.weight
        out_local, in_local = weight.shape
        self.sections = sections  # full-size row sections of the fused output (column-parallel only)
        # The adapter is kept in float32 whatever the base dtype (PEFT's autocast_adapter_dtype does the same):
        # bf16 adapter weights would round away most optimizer updates.
        self.lora_A = torch.nn.Linear(in_local, rank, bias=False, device=weight.device, dtype=torch.float32)
        self.lora_B = torch.nn.Linear(rank, out_local, bias=False, device=weight.device, dtype=torch.float32)
        torch.nn.init.zeros_(self.lora_B.weight)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank

    def reset_parameters(self) -> None:
        """A fresh adapter: A drawn as ``torch.nn.Linear`` draws it, B = 0 (so the model is unchanged)."""
        self.lora_A.reset_parameters()
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        # A projection with its own output norm takes the update before that norm, as the merged weight would.
        post_norm = getattr(self.base, "post_layernorm", None)
        out, bias = (self.base if post_norm is None else self.base.project)(x, *args, **kwargs)
        hidden = self.lora_A(x.to(self.lora_A.weight.dtype))
        if self.column:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.group)
        else:
            hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.group)
        out = out + (self.scale * self.lora_B(hidden)).to(out.dtype)
        return (out if post_norm is None else post_norm(out)), bias

    # --- canonical <-> shard ---------------------------------------------------------------------------------
    def _row_shard(self, full: torch.Tensor) -> torch.Tensor:
        rank = self.group.rank()
        parts = []
        start = 0
        for size in self.sections:
            chunk = size // self.tp
            parts.append(full[start + rank * chunk : start + (rank + 1) * chunk])
            start += size
        return torch.cat(parts)

    def _row_gather(self, local: torch.Tensor) -> torch.Tensor:
        shards = _all_gather(local, self.group)
        pieces, offset = [], 0
        for size in self.sections:
            chunk = size // self.tp
            pieces.extend(shard[offset : offset + chunk] for shard in shards)
            offset += chunk
        return torch.cat(pieces)

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], B [out, r]) in the TP=1 layout, on every rank."""
        a, b = self.lora_A.weight.detach(), self.lora_B.weight.detach()
        if self.tp == 1:
            return a.clone(), b.clone()
        if self.column:
            return a.clone(), self._row_gather(b)
        return torch.cat(_all_gather(a, self.group), dim=1), b.clone()

    def load_canonical(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.tp > 1:
            if self.column:
                b = self._row_shard(b)
            else:
                cols = a.shape[1] // self.tp
                rank = self.group.rank()
                a = a[:, rank * cols : (rank + 1) * cols]
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    shards = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(shards, t.contiguous(), group=group)
    return shards


@dataclass
class LoraReport:
    """What :func:`apply_lora` did: wrapped module names per declared target."""

    wrapped: dict[str, LoraLinear]
    per_target: dict[str, list[str]]  # "scope:megatron" -> module names


def _sections(name: str, module: torch.nn.Module, parent: torch.nn.Module, tp: int) -> list[int]:
    full = module.weight.shape[0] * tp
    if name.endswith("in_proj") and hasattr(parent, "sections"):
        return [s * tp for s in parent.sections]
    if name.endswith("linear_fc1") and getattr(module.config, "gated_linear_unit", False):
        return [full // 2, full // 2]
    return [full]


def target_key(target: LoraTarget) -> str:
    return f"{target.scope}:{target.megatron}"


def apply_lora(model: torch.nn.Module, spec: HandlerSpec, *, rank: int = 8, alpha: float = 16.0) -> LoraReport:
    """Wrap every module the handler declares a LoRA target for; freeze everything else."""
    from model_support.core.megatron.gdn import GDN_MODULES

    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    wrapped: dict[str, LoraLinear] = {}
    per_target: dict[str, list[str]] = {}
    for target in spec.lora_targets:
        pattern = re.compile(rf"^decoder\.layers\.\d+\.{_SCOPE_PARENT[target.scope]}\.{re.escape(target.megatron)}$")
        hits = []
        for name, module in modules.items():
            if not pattern.match(name) or name in wrapped:
                continue
            parent_name, leaf = name.rsplit(".", 1)
            parent = modules[parent_name]
            is_gdn = isinstance(parent, GDN_MODULES)
            if target.scope is TargetScope.GDN and not is_gdn:
                continue
            if target.scope is TargetScope.ATTENTION and is_gdn:
                continue
            if target.scope is TargetScope.MLP and "experts" in parent_name:
                continue
            tp = module.tp_group.size()
            lora = LoraLinear(module, rank, alpha, _sections(name, module, parent, tp))
            setattr(parent, leaf, lora)
            wrapped[name] = lora
            hits.append(name)
        per_target[target_key(target)] = hits
    return LoraReport(wrapped, per_target)


def lora_modules(model: torch.nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def lora_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Canonical LoRA tensors keyed ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``."""
    out = {}
    for name, module in lora_modules(model).items():
        a, b = module.canonical()
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a, b
    return out


def load_lora_state(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load canonical LoRA tensors (exact inverse of :func:`lora_state`); every LoRA module must be covered."""
    modules = lora_modules(model)
    expected = {f"{n}.lora_{w}.weight" for n in modules for w in "AB"}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise LoraError(f"LoRA tensors do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, module in modules.items():
        module.load_canonical(tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"])


def random_lora_state(model: torch.nn.Module, *, seed: int, b_std: float = 0.02) -> dict[str, torch.Tensor]:
    """Canonical LoRA tensors with a random, non-zero B (same on every rank and TP size, given ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in sorted(lora_modules(model).items()):
        a, b = module.canonical()
        out[f"{name}.lora_A.weight"] = torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5
        out[f"{name}.lora_B.weight"] = torch.randn(b.shape, generator=gen) * b_std
    return out
