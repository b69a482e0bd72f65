"""LoRA on megatron-core's tensor-parallel linears, with base weights frozen.

:class:`LoraLinear` wraps a ``ColumnParallelLinear`` or ``RowParallelLinear`` in place and adds
``scale * B(A(x))``:

* column-parallel (``linear_qkv``, ``linear_fc1``, GDN ``in_proj``): A [r, in] is replicated, B holds
  this rank's output rows; ``copy_to_tensor_model_parallel_region`` after A all-reduces A's gradient.
* row-parallel (``linear_proj``, ``linear_fc2``, GDN ``out_proj``): A holds this rank's input columns,
  B [out, r] is replicated; ``reduce_from_tensor_model_parallel_region`` sums the partial A(x).
* with sequence parallelism the base linears gather / reduce-scatter along the sequence, and the LoRA branch does
  the same with its rank-r activations: a column-parallel A sees this rank's sequence shard (A(x) is gathered), a
  row-parallel A(x) is reduce-scattered. The replicated factor (A of a column, B of a row) then gets the gradient
  of this rank's tokens only; it is marked ``sequence_parallel`` as megatron-core marks its norms, and
  :func:`sync_sequence_parallel_grads` (or megatron-core's ``finalize_model_grads`` in a trainer) sums it.
* expert linears do their communication in the token dispatcher, which gives every expert-tensor-parallel rank
  the same tokens and sums their row-parallel outputs; their LoRA needs none in the forward. Under expert tensor
  parallelism the replicated factor's gradient (A of a column, B of a row) is summed over the shards in the
  backward. :func:`lora_state` names experts by their global index and gathers
  them from every expert-parallel rank.
* under pipeline parallelism each rank holds some layers (in one chunk, or one per virtual stage): every function
  here takes a model or a rank's list of chunks, names layers by their global index, and :func:`lora_state`
  gathers every stage's LoRA.

:func:`lora_state` / :func:`load_lora_state` move LoRA tensors between the ranks' shards and the
canonical (TP=1) layout the codecs use. A fused output dimension is sharded per section
(``[gate; up]`` of fc1, ``[q, k, v, z, b, a]`` of GDN ``in_proj``), as Megatron shards the base weight;
``linear_qkv`` shards by query group, i.e. contiguously.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
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


# A model on one rank: one megatron-core model, or the rank's chunks (one per virtual pipeline stage).
Chunks = torch.nn.Module | Sequence[torch.nn.Module]


def chunk_list(model: Chunks) -> list[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


class LoraLinear(torch.nn.Module):
    """A frozen tensor-parallel linear plus a trainable low-rank update."""

    def __init__(self, base: torch.nn.Module, rank: int, alpha: float, sections: list[int]) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        if not isinstance(base, ColumnParallelLinear | RowParallelLinear):
            raise LoraError(f"LoRA wraps ColumnParallelLinear / RowParallelLinear, not {type(base).__name__}")
        # Expert linears (reduced over the expert data-parallel group) leave their communication to the token
        # dispatcher under expert or expert tensor parallelism.
        self.expert = bool(getattr(base, "is_expert", False))
        self.local = bool(getattr(base, "explicit_expert_comm", False))
        self.base = base
        self.column = isinstance(base, ColumnParallelLinear)
        self.group = base.tp_group
        self.tp = self.group.size()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.local
        weight = base.weight
        out_local, in_local = weight.shape
        self.sections = sections  # full-size row sections of the fused output (column-parallel only)
        # The adapter is kept in float32 whatever the base dtype (PEFT's autocast_adapter_dtype does the same):
        # bf16 adapter weights would round away most optimizer updates.
        self.lora_A = torch.nn.Linear(in_local, rank, bias=False, device=weight.device, dtype=torch.float32)
        self.lora_B = torch.nn.Linear(rank, out_local, bias=False, device=weight.device, dtype=torch.float32)
        torch.nn.init.zeros_(self.lora_B.weight)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        replicated = self.lora_A.weight if self.column else self.lora_B.weight
        replicated.sequence_parallel = self.sequence_parallel
        self.enabled = True  # False: the base linear alone (:func:`lora_disabled`)

    def reset_parameters(self) -> None:
        """A fresh adapter: A drawn as ``torch.nn.Linear`` draws it, B = 0 (so the model is unchanged)."""
        self.lora_A.reset_parameters()
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        # A projection with its own output norm takes the update before that norm, as the merged weight would.
        post_norm = getattr(self.base, "post_layernorm", None)
        out, bias = (self.base if post_norm is None else self.base.project)(x, *args, **kwargs)
        if not self.enabled:
            return (out if post_norm is None else post_norm(out)), bias
        weight_a, weight_b = self.lora_A.weight, self.lora_B.weight
        if self.local and self.tp > 1:
            # Expert tensor parallel: the dispatcher gives every rank the same tokens, sums the row-parallel outputs
            # and, backward, the input gradients. The replicated factor (A of a column, B of a row) gets this
            # shard's part of its gradient, summed over the shards here.
            if self.column:
                weight_a = _SumGradient.apply(weight_a, self.group)
            else:
                weight_b = _SumGradient.apply(weight_b, self.group)
        hidden = torch.nn.functional.linear(x.to(weight_a.dtype), weight_a)
        if not self.local and self.column:
            if self.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(hidden, group=self.group)
            else:
                hidden = copy_to_tensor_model_parallel_region(hidden, group=self.group)
        elif not self.local:
            if self.sequence_parallel:
                hidden = reduce_scatter_to_sequence_parallel_region(hidden, group=self.group)
            else:
                hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.group)
        out = out + (self.scale * torch.nn.functional.linear(hidden, weight_b)).to(out.dtype)
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
        return _gather_rows(local, self.sections, self.group)

    def canonical_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of (A, B) in the TP=1 layout."""
        (rank, cols), (rows, _) = self.lora_A.weight.shape, self.lora_B.weight.shape
        return (rank, cols if self.column else cols * self.tp), (rows * self.tp if self.column else rows, rank)

    def canonical(self, grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], B [out, r]) in the TP=1 layout, on every rank; with ``grads``, their gradients (zeros where
        none) in that layout."""
        a, b = self.lora_A.weight.detach(), self.lora_B.weight.detach()
        if grads:
            a, b = (
                torch.zeros_like(w) if w.grad is None else w.grad.detach()
                for w in (self.lora_A.weight, self.lora_B.weight)
            )
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


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (a replicated weight fed partial inputs)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    shards = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(shards, t.contiguous(), group=group)
    return shards


def _gather_rows(local: torch.Tensor, sections: list[int], group) -> torch.Tensor:
    """The whole of a column-parallel tensor from each rank's rows: every full-size row section of a fused output
    (``sections``) is split across the ranks, so the shards interleave section by section."""
    shards, tp = _all_gather(local, group), group.size()
    pieces, offset = [], 0
    for size in sections:
        chunk = size // tp
        pieces.extend(shard[offset : offset + chunk] for shard in shards)
        offset += chunk
    return torch.cat(pieces)


def canonical_weight(name: str, linear: torch.nn.Module, parent: torch.nn.Module) -> torch.Tensor:
    """A tensor-parallel linear's weight in the TP=1 layout (``name``: the linear's module name, ``parent``: the
    module holding it), its shards gathered over its tensor-parallel group: every rank of the group calls it."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    weight, group = linear.weight.detach(), linear.tp_group
    if group is None or group.size() == 1:
        return weight
    if isinstance(linear, ColumnParallelLinear):
        return _gather_rows(weight, _sections(name, linear, parent, group.size()), group)
    return torch.cat(_all_gather(weight, group), dim=1)


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


def apply_lora(model: Chunks, spec: HandlerSpec, *, rank: int = 8, alpha: float = 16.0) -> LoraReport:
    """Wrap every module the handler declares a LoRA target for; freeze everything else. Modules are reported under
    the single-rank model's names."""
    from model_support.core.megatron.gdn import GDN_MODULES
    from model_support.core.megatron.names import global_name

    wrapped: dict[str, LoraLinear] = {}
    per_target: dict[str, list[str]] = {}
    for chunk in chunk_list(model):
        for param in chunk.parameters():
            param.requires_grad_(False)
        modules = dict(chunk.named_modules())
        done: set[str] = set()  # a module two targets name is wrapped once
        for target in spec.lora_targets:
            scope = _SCOPE_PARENT[target.scope]
            pattern = re.compile(rf"^decoder\.layers\.\d+\.{scope}\.{re.escape(target.megatron)}$")
            hits = per_target.setdefault(target_key(target), [])
            for name, module in modules.items():
                if not pattern.match(name) or name in done:
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
                done.add(name)
                wrapped[global_name(chunk, name)] = lora
                hits.append(global_name(chunk, name))
    return LoraReport(wrapped, per_target)


def lora_modules(model: Chunks) -> dict[str, LoraLinear]:
    """This rank's LoRA modules under the single-rank model's names (global layer and expert indices)."""
    from model_support.core.megatron.names import global_name

    return {
        global_name(chunk, name): m
        for chunk in chunk_list(model)
        for name, m in chunk.named_modules()
        if isinstance(m, LoraLinear)
    }


def _spread_over() -> list[tuple[object, Callable[[str], bool]]]:
    """The groups whose ranks hold different parts of the model, with which tensors each splits: the expert-parallel
    group splits the experts, the pipeline-parallel group the layers (experts already gathered)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return []
    groups: list[tuple[object, Callable[[str], bool]]] = []
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        groups.append((parallel_state.get_expert_model_parallel_group(), lambda name: ".local_experts." in name))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        groups.append((parallel_state.get_pipeline_model_parallel_group(), lambda name: True))
    return groups


def lora_state(model: Chunks, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Canonical LoRA tensors keyed ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``, the whole model's on
    every rank (tensor-parallel shards gathered, experts of every expert-parallel rank, layers of every pipeline
    stage); with ``grads``, their gradients as the ranks hold them (zeros where none)."""
    out = {}
    for name, module in lora_modules(model).items():
        a, b = module.canonical(grads)
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a, b
    device = next(iter(out.values())).device if out else torch.device("cpu")
    for group, split in _spread_over():
        parts: list[dict[str, torch.Tensor]] = [{} for _ in range(group.size())]
        dist.all_gather_object(parts, {k: v.cpu() for k, v in out.items() if split(k)}, group=group)
        for part in parts:
            out.update({k: v.to(device) for k, v in part.items()})
    return out


def load_lora_state(model: Chunks, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load canonical LoRA tensors (exact inverse of :func:`lora_state`); every LoRA module must be covered, and
    every tensor must belong to a LoRA module of the model (on some expert-parallel or pipeline rank)."""
    modules = lora_modules(model)
    expected = {f"{n}.lora_{w}.weight" for n in modules for w in "AB"}
    for group, split in _spread_over():
        names: list[set[str]] = [set() for _ in range(group.size())]
        dist.all_gather_object(names, {n for n in expected if split(n)}, group=group)
        expected |= set().union(*names)
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise LoraError(f"LoRA tensors do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    # Every tensor checked before any is loaded: a refusal half-way would leave the model half-loaded.
    for name, module in modules.items():
        for factor, want in zip("AB", module.canonical_shapes(), strict=True):
            tensor = tensors[f"{name}.lora_{factor}.weight"]
            if tuple(tensor.shape) != want:
                raise LoraError(f"{name}.lora_{factor}.weight is {list(tensor.shape)}, the model's is {list(want)}")
    refuse_nonfinite(tensors)
    for name, module in modules.items():
        module.load_canonical(tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"])


def refuse_nonfinite(tensors: Mapping[str, torch.Tensor], where: str = "") -> None:
    """A one-line :class:`LoraError` naming the first tensor holding a NaN or infinite value (``where``: its source,
    before the name)."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise LoraError(f"{where}{name} holds non-finite values; nothing was loaded")


def sync_sequence_parallel_grads(model: Chunks) -> None:
    """Sum the gradients of LoRA factors marked ``sequence_parallel`` over the tensor-parallel group (each rank saw
    its own sequence shard), as megatron-core's ``finalize_model_grads`` does for a trainer's wrapped model."""
    for module in lora_modules(model).values():
        for param in (module.lora_A.weight, module.lora_B.weight):
            if getattr(param, "sequence_parallel", False) and param.grad is not None:
                dist.all_reduce(param.grad, group=module.group)


def reduce_lora_grads(model: Chunks) -> None:
    """The batch's LoRA gradients on every rank (see :func:`model_support.core.api.reduce_lora_grads`)."""
    from megatron.core import parallel_state

    sync_sequence_parallel_grads(model)
    scale = 1.0 / parallel_state.get_data_parallel_world_size()
    dense = parallel_state.get_data_parallel_group(with_context_parallel=True)
    expert = parallel_state.get_expert_data_parallel_group()
    for module in lora_modules(model).values():
        for param in (module.lora_A.weight, module.lora_B.weight):
            if param.grad is not None:
                param.grad *= scale
                dist.all_reduce(param.grad, group=expert if module.expert else dense)


@contextmanager
def lora_disabled(model: Chunks) -> Iterator[None]:
    """Every LoRA module of ``model`` computes its base linear alone while the context is open (this rank's modules:
    every rank enters it, so the layers' communication stays matched)."""
    modules = list(lora_modules(model).values())
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


def merged_weight(module: LoraLinear, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (this rank's shard of ``module``'s base weight) with the module's update merged in, rounded to the
    weight's dtype: what a merged export or push holds."""
    delta = module.lora_B.weight.detach().float() @ module.lora_A.weight.detach().float()
    return (weight.detach().float() + module.scale * delta).to(weight.dtype)


@contextmanager
def lora_merged(model: Chunks) -> Iterator[None]:
    """Every LoRA module of ``model`` computes with its update merged into its base weight (:func:`merged_weight`,
    in the base's dtype) and the adapter off: the policy a merged push serves. The base weights are kept in host
    memory meanwhile and put back on exit; every rank enters it around the same calls."""
    kept: list[tuple[LoraLinear, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for module in lora_modules(model).values():
                weight = module.base.weight
                kept.append((module, weight.detach().to("cpu", copy=True)))
                weight.copy_(merged_weight(module, weight))
                module.enabled = False
        yield
    finally:
        with torch.no_grad():
            for module, saved in kept:
                module.base.weight.copy_(saved)
                module.enabled = True


def counted_grads(model: Chunks) -> list[torch.Tensor]:
    """This rank's LoRA gradients that a norm over the whole model counts here, so that every distinct element is
    counted on exactly one rank: a sharded factor (B of a column-parallel linear, A of a row-parallel one) on each
    rank of its tensor-parallel (expert: expert-tensor-parallel) group, the other factor, a replica on every rank of
    that group, on its first rank only; pipeline stages and expert-parallel ranks hold different modules, and
    data-parallel replicas (with the context-parallel ranks; expert data-parallel for experts) count on their first
    only. The gradients must be reduced first (:func:`reduce_lora_grads`)."""
    from megatron.core import parallel_state

    owner = {
        False: parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0,
        True: parallel_state.get_expert_data_parallel_rank() == 0,
    }
    counted = []
    for module in lora_modules(model).values():
        if not owner[module.expert]:
            continue
        sharded, replicated = (
            (module.lora_B.weight, module.lora_A.weight)
            if module.column
            else (module.lora_A.weight, module.lora_B.weight)
        )
        for param in (sharded, replicated) if module.group.rank() == 0 else (sharded,):
            if param.grad is not None:
                counted.append(param.grad)
    return counted


def lora_grad_norm(model: Chunks) -> torch.Tensor:
    """The L2 norm of the whole model's LoRA gradients (fp32 scalar, the same on every rank): the squares of
    :func:`counted_grads` summed over every rank."""
    device = next(iter(lora_modules(model).values())).lora_A.weight.device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in counted_grads(model):
        squares += grad.double().pow(2).sum()
    dist.all_reduce(squares)
    return squares.sqrt().float()


def fresh_factors(
    name: str, seed: int, shape_a: tuple[int, int], shape_b: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh adapter's canonical (A, B) for module ``name`` (its single-rank name): A drawn as PEFT (and
    ``torch.nn.Linear``) draws it, uniform in +-1/sqrt(in), from a generator seeded by ``seed`` and ``name``; B = 0,
    so the wrapped module computes what it did before."""
    key = int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")
    gen = torch.Generator().manual_seed(key)
    a = (torch.rand(shape_a, generator=gen) * 2 - 1) / shape_a[1] ** 0.5
    return a, torch.zeros(shape_b)


def fresh_lora(model: Chunks, *, seed: int) -> None:
    """Give every LoRA module of this rank a fresh adapter (:func:`fresh_factors`): the same canonical adapter on
    every rank and in every parallel layout for one ``seed``, drawn for this rank's modules only (no communication)."""
    for name, module in lora_modules(model).items():
        module.load_canonical(*fresh_factors(name, seed, *module.canonical_shapes()))


def random_lora_state(model: Chunks, *, seed: int, b_std: float = 0.02) -> dict[str, torch.Tensor]:
    """Canonical LoRA tensors with a random, non-zero B (the same on every rank and in every layout, given
    ``seed``: drawn over the whole model's modules in name order)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = lora_state(model)
    out = {}
    for name in sorted({k.rsplit(".lora_", 1)[0] for k in shapes}):
        a, b = shapes[f"{name}.lora_A.weight"], shapes[f"{name}.lora_B.weight"]
        out[f"{name}.lora_A.weight"] = torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5
        out[f"{name}.lora_B.weight"] = torch.randn(b.shape, generator=gen) * b_std
    return out
