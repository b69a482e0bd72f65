"""Live megatron-core model -> its checkpoint's tensors, LoRA merged, streamed without writing a checkpoint.

A trainer pushes these to a vLLM server after each update. The conversion is the model bridge's own export
(``stream_weights_megatron_to_hf``: TP gathers, QKV / gate-up / GDN splits, grouped experts, tied-embedding
aliases), fed one parameter at a time; each LoRA-wrapped linear contributes its merged local shard, which the
bridge gathers and splits like any weight. Names and dtypes are the checkpoint's own, and the tensors the model
does not hold (a vision tower, MTP layers that were not built) are read from the checkpoint unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from model_support.core.checkpoint import stored_tensors
from model_support.core.errors import ModelSupportError
from model_support.core.megatron.builder import MegatronModel, mapping_name, mapping_registry
from model_support.core.megatron.lora import LoraLinear, merged_weight
from model_support.core.megatron.names import global_name

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class HFExportError(ModelSupportError):
    """The live model's weights do not fit the checkpoint they are exported under."""


def _local_shards(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.nn.Module]]:
    """(name without LoRA's ``.base``, this rank's shard with LoRA merged, owning module) per base parameter.

    A wrapped linear's own weight gets the update merged; its other parameters (e.g. the ``post_layernorm``
    of a :class:`~model_support.core.megatron.spec.PostNormRowParallelLinear`) are exported unchanged.
    """
    wrapped = {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    for name, param in model.named_parameters():
        parts = name.split(".")
        owner = next((i for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in wrapped), None)
        if owner is None:
            yield name, param.detach(), model.get_submodule(name.rpartition(".")[0])
            continue
        if parts[owner] != "base":  # the adapter's own lora_A / lora_B
            continue
        prefix, inner = ".".join(parts[:owner]), parts[owner + 1 :]
        lora = wrapped[prefix]
        shard = param.detach()
        if inner == ["weight"]:
            shard = merged_weight(lora, shard)
        yield ".".join([prefix, *inner]), shard, lora.base.get_submodule(".".join(inner[:-1]))


def _tasks(local: dict[str, tuple[torch.Tensor, torch.nn.Module]], lookup) -> list:
    """One conversion task per parameter of the whole model, in the same order on every pipeline rank (the bridge's
    order): this rank's with their merged shard, the other stages' empty (the bridge broadcasts them from their
    owner), as megatron-bridge's ``build_conversion_tasks`` lays them out for its own wrappers."""
    import torch.distributed as dist
    from megatron.bridge.models.conversion.model_bridge import WeightConversionTask
    from megatron.bridge.models.conversion.utils import extract_sort_key
    from megatron.core import parallel_state

    names = list(local)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        stages: list[list[str]] = [[] for _ in range(group.size())]
        dist.all_gather_object(stages, names, group=group)
        names = sorted({name for stage in stages for name in stage}, key=extract_sort_key)
    tasks = []
    for name in names:
        shard, module = local.get(name, (None, None))
        mapping = lookup(mapping_name(name, lookup))
        tasks.append(
            WeightConversionTask(
                param_name=name, global_param_name=name, mapping=mapping, megatron_module=module, param_weight=shard
            )
        )
    return tasks


def hf_weights(built: MegatronModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``built``'s checkpoint exactly once, as ``(name in the files, tensor)``, LoRA merged in.

    Tensors the Megatron model holds come from the live model (cast to the dtype the checkpoint stores, on the
    model's device; they may share memory with its parameters), one converted group at a time; the others are
    read from the checkpoint files. A collective under tensor parallelism: every rank must iterate it to the end,
    and every rank gets the full tensors. Raises :class:`HFExportError` if the bridge exports a tensor the
    checkpoint lacks or with another shape.
    """
    from safetensors import safe_open

    checkpoint = built.checkpoint
    stored = stored_tensors(checkpoint.source_dir)
    registry = mapping_registry(built.bridge)
    registry.set_process_groups_from_pg_collection(built.provider._pg_collection)
    lookup = registry.megatron_to_hf_lookup
    # The bridge merges only its own PEFT wrappers (`.to_wrap.`/`.adapter.`); tasks for LoraLinear's are built here.
    tied = bool(built.provider.share_embeddings_and_output_weights)
    local = {
        global_name(chunk, name): (shard, module)
        for chunk in built.chunks
        for name, shard, module in _local_shards(chunk)
        if not (tied and name.startswith("output_layer."))  # the last stage's copy of the tied embedding
    }
    exported = built.bridge.stream_weights_megatron_to_hf(
        built.chunks,
        built.bridge.hf_pretrained,  # the config and the checkpoint's state, as the build read them
        cpu=False,
        show_progress=False,
        conversion_tasks=_tasks(local, lookup),
        merge_adapter_weights=False,
    )
    done: set[str] = set()
    for name, tensor in exported:
        raw = checkpoint.raw_key(name) if name in checkpoint else name
        if raw not in stored or raw in done:
            problem = "a second time" if raw in done else f"but {checkpoint.source_dir} does not have it"
            raise HFExportError(f"the bridge exports {name} {problem}")
        _, shape, code = stored[raw]
        if tuple(tensor.shape) != shape or code not in _DTYPES:
            raise HFExportError(f"the bridge exports {raw} as {tuple(tensor.shape)}, the checkpoint has {shape} {code}")
        done.add(raw)
        yield raw, tensor.to(_DTYPES[code])
    rest: dict[Path, list[str]] = {}
    for raw, (path, _, _) in stored.items():
        if raw not in done:
            rest.setdefault(path, []).append(raw)
    for path, keys in rest.items():
        with safe_open(path, "pt") as f:
            for key in keys:
                yield key, f.get_tensor(key)
