"""Merged-weight export: base checkpoint + LoRA adapter -> a Hugging Face checkpoint vLLM can serve.

Streaming: base tensors are read one at a time from the memory-mapped safetensors files, the adapter delta
(``alpha / r * B @ A``, ``alpha / sqrt(r)`` under rsLoRA) is added to the tensor it belongs to, and tensors are
written in shards of at most ``max_shard_bytes``; at most one shard and one tensor are in memory, never the
model twice. Names stay the checkpoint's own (HF names).

Atomic: everything is written to a hidden sibling directory and moved into place with one ``rename`` after the
index (``model.safetensors.index.json``) is written, so a crash leaves either no export or a complete one; a
leftover hidden directory is not an export (no index at the final path) and is removed on the next attempt.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from model_support.core.checkpoint import weight_files
from model_support.core.codecs import PEFT_PREFIX, CodecError, load_peft_adapter, peft_rank_and_scale
from model_support.core.outputs import claim_staging, release
from model_support.core.serving.errors import ExportError

INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = weight_files(model_dir)
    if not files:
        raise ExportError(f"{model_dir} has no safetensors checkpoint")
    return files


def base_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time, in file order."""
    from safetensors import safe_open

    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, fh.get_tensor(name)


def adapter_deltas(adapter_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{"<module>.weight": (A, B, scale)}`` from a PEFT LoRA adapter directory, each module scaled as PEFT and vLLM
    scale it (:func:`~model_support.core.codecs.peft_rank_and_scale`)."""
    try:
        config, tensors = load_peft_adapter(Path(adapter_dir))
    except CodecError as exc:
        raise ExportError(str(exc)) from exc
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key, lora_a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        lora_b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if lora_b is None:
            raise ExportError(f"adapter {adapter_dir} has {key} but no matching lora_B")
        out[f"{module}.weight"] = (lora_a, lora_b, peft_rank_and_scale(config, module)[1])
    return out


def _merged(tensor: torch.Tensor, delta: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
    """``W + scale * B @ A`` in fp32, rounded to ``W``'s dtype (as a server merging the adapter holds it)."""
    lora_a, lora_b, scale = delta
    return (tensor.float() + scale * (lora_b.float() @ lora_a.float())).to(tensor.dtype)


def merged_tensors(model_dir: Path, adapter_dir: Path | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with the adapter merged in; fails if an adapter module is not in the checkpoint."""
    deltas = adapter_deltas(adapter_dir) if adapter_dir is not None else {}
    for name, tensor in base_tensors(model_dir):
        if name in deltas:
            tensor = _merged(tensor, deltas.pop(name))
        yield name, tensor
    if deltas:
        raise ExportError(f"adapter modules not in the checkpoint {model_dir}: {', '.join(sorted(deltas)[:3])}")


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group a tensor stream into dicts of at most ``max_bytes`` (a larger tensor gets a bucket of its own)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


class CheckpointWriter:
    """Writes shards into a hidden staging directory; :meth:`commit` publishes the complete checkpoint."""

    def __init__(self, out_dir: Path, *, support_from: Path | None = None) -> None:
        self.out_dir = Path(out_dir)
        if (self.out_dir / INDEX).exists() or (self.out_dir.exists() and any(self.out_dir.iterdir())):
            raise ExportError(f"{self.out_dir} already exists; choose a new directory for the export")
        self.staging = self.out_dir.with_name(f".{self.out_dir.name}.partial")
        self._lock: int | None = claim_staging(self.staging, self.out_dir, ExportError)
        self.support_from = support_from
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self._shards: list[str] = []

    def write_shard(self, tensors: Mapping[str, torch.Tensor]) -> str:
        from safetensors.torch import save_file

        name = f"shard-{len(self._shards) + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.staging / name), metadata={"format": "pt"})
        self._shards.append(name)
        for key, value in tensors.items():
            if key in self.weight_map:
                raise ExportError(f"tensor {key} written twice")
            self.weight_map[key] = name
            self.total_bytes += value.numel() * value.element_size()
        return name

    def commit(self) -> Path:
        """Name the shards ``model-0000i-of-0000n``, write the index and config files, move into place."""
        if not self._shards:
            raise ExportError("no tensors were written")
        count = len(self._shards)
        final = {old: f"model-{i:05d}-of-{count:05d}.safetensors" for i, old in enumerate(self._shards, 1)}
        for old, new in final.items():
            os.replace(self.staging / old, self.staging / new)
        if self.support_from is not None:
            for item in self.support_from.iterdir():
                if item.is_file() and not item.name.endswith(".safetensors") and item.name != INDEX:
                    shutil.copy2(item, self.staging / item.name)
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {k: final[v] for k, v in sorted(self.weight_map.items())},
        }
        (self.staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        self._release()
        _fsync_dir(self.staging)
        if self.out_dir.exists():
            self.out_dir.rmdir()  # empty (checked in __init__)
        os.replace(self.staging, self.out_dir)
        _fsync_dir(self.out_dir.parent)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            release(self.staging, self._lock)
            self._lock = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    shards: Iterable[Mapping[str, torch.Tensor]],
    out_dir: Path,
    *,
    support_from: Path | None = None,
    check: Callable[[Mapping[str, str]], None] | None = None,
) -> Path:
    """Write each dict of ``shards`` as one shard and publish the checkpoint at ``out_dir`` atomically.

    ``check`` sees the tensor -> shard map before anything is published and may refuse it by raising; any failure
    leaves nothing at ``out_dir`` (and no staging directory).
    """
    writer = CheckpointWriter(Path(out_dir), support_from=support_from)
    try:
        for shard in shards:
            writer.write_shard(shard)
        if check is not None:
            check(writer.weight_map)
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def checkpoint_names(model_dir: Path) -> set[str]:
    """The names of every tensor of the checkpoint (read from the safetensors headers)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as fh:
            names.update(fh.keys())
    return names


def merged_subset(
    model_dir: Path,
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
    names: Iterable[str],
    held_in: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``names`` of the checkpoint's tensors (those it has) with ``deltas`` (:func:`adapter_deltas`) merged as
    :func:`merged_tensors` merges them, reading only those tensors. ``held_in``: each base tensor first rounded to
    that dtype, as a model trained in it holds the checkpoint (a bf16 trainer on an fp32 checkpoint)."""
    from safetensors import safe_open

    wanted = set(names)
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as fh:
            for name in wanted.intersection(fh.keys()):
                tensor = fh.get_tensor(name)
                if held_in is not None and tensor.is_floating_point():
                    tensor = tensor.to(held_in).to(tensor.dtype)
                yield name, _merged(tensor, deltas[name]) if name in deltas else tensor


def export_merged(
    model_dir: Path, adapter_dir: Path | None, out_dir: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> Path:
    """Write base + adapter, merged, as a sharded safetensors checkpoint with index at ``out_dir`` (atomically)."""
    model_dir, adapter_dir = Path(model_dir), None if adapter_dir is None else Path(adapter_dir)
    shards = buckets(merged_tensors(model_dir, adapter_dir), max_shard_bytes)
    return write_checkpoint(shards, Path(out_dir), support_from=model_dir)
