"""Which files a safetensors checkpoint is, their headers checked, and its language-model tensors read lazily.

Every reader of a model directory (the architecture and weights stages, the transformers reference, the Megatron
model's bridge, the merged export) takes its files from :func:`weight_files`:

- with ``model.safetensors.index.json``: the files its ``weight_map`` names;
- without one: ``model.safetensors``;
- nothing else: an adapter's ``adapter_model.safetensors`` or any other ``*.safetensors`` next to it is no weight.

A directory that transformers (``model.safetensors`` first, else the index) and vLLM (the index's files, else every
``*.safetensors``) would read differently is refused (:class:`CheckpointError`) rather than resolved by a guess: an
index next to a ``model.safetensors`` that it does not list as its only file, or ``model-<i>-of-<n>.safetensors``
shards without their index. So is a file outside the model directory (an absolute or ``..`` name in the index, a
symlink that leads out), except a Hugging Face cache snapshot's links into its repository's ``blobs``.

:func:`read_header` checks a file's header as safetensors does when it opens the file, in words that name the file
and the problem; :func:`open_weights` opens one for reading, its errors named the same way.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import Any

import torch

from model_support.core.errors import ModelSupportError
from model_support.core.model_files import check_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")
_VL_PREFIX = "model.language_model."
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_REDO = "re-download or re-save it"
_HEADER_LIMIT = 100_000_000  # the largest header safetensors reads
_LFS_POINTER = b"version https://git-lfs"
# Bits per element of each safetensors dtype.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "I32": 32, "U32": 32, "I64": 64, "U64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8, "F16": 16, "BF16": 16, "F32": 32, "F64": 64,
}  # fmt: skip
FLOAT_DTYPES = frozenset(name for name in _DTYPE_BITS if name.startswith(("F", "BF")))


class CheckpointError(ModelSupportError):
    """The checkpoint's weights cannot be read, or which files they are is ambiguous."""


def _inside(model_dir: Path, path: Path) -> Path:
    """``path`` (a file of ``model_dir``), refused when a symlink leads it out of the model directory, or it is not
    a regular file."""
    if not path.exists():
        raise CheckpointError(f"{path} is missing or not a file; {_REDO}")
    check_file(model_dir, path, CheckpointError)
    return path


def _index_files(model_dir: Path, index: Path) -> list[str]:
    """The file names ``index``'s ``weight_map`` lists, each a relative path inside the model directory."""
    _inside(model_dir, index)
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:  # ValueError: not JSON or not UTF-8; AttributeError: no object
        raise CheckpointError(f"{index} is not a JSON object ({str(exc).splitlines()[0]}); {_REDO}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to file names; {_REDO}")
    if not weight_map:
        raise CheckpointError(f"{index} lists no files in its weight_map; {_REDO}")
    names = sorted({PurePath(name).as_posix() for name in weight_map.values()})  # "./x" and "x" are one file
    for name in names:
        if PurePath(name).is_absolute() or ".." in PurePath(name).parts:
            raise CheckpointError(
                f"{index} names {name} as a shard, a path outside {model_dir}; an index names files in its own "
                "directory: re-download the checkpoint or fix the index"
            )
    return names


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of the checkpoint in ``model_dir`` (none: a config without weights), by the rule in this
    module's docstring; :class:`CheckpointError` for a directory that rule refuses (the message says what to do)."""
    index, single = model_dir / INDEX, model_dir / SINGLE
    has_single = os.path.lexists(single)
    if os.path.lexists(index):
        names = _index_files(model_dir, index)
        if has_single and names != [SINGLE]:
            listed = f"lists it with {len(names) - 1} other file(s)" if SINGLE in names else "does not list it"
            raise CheckpointError(
                f"{model_dir} holds both {INDEX} and {SINGLE}, and the index {listed}: transformers would load "
                f"{SINGLE}, vLLM and this check the files the index lists; remove the stale one"
            )
        return [_inside(model_dir, model_dir / name) for name in names]
    shards = sorted(p.name for p in model_dir.glob("model-*-of-*.safetensors") if _SHARD.match(p.name))
    if shards and has_single:
        raise CheckpointError(
            f"{model_dir} holds {SINGLE} and {len(shards)} shard(s) ({shards[0]} ...) but no {INDEX}: transformers "
            f"would load {SINGLE}, vLLM every *.safetensors; remove the stale one(s)"
        )
    if shards:
        raise CheckpointError(
            f"{model_dir} holds {len(shards)} shard(s) ({shards[0]} ...) but no {INDEX}, without which transformers "
            "cannot load them; restore the index (re-download, or re-save with save_pretrained)"
        )
    return [_inside(model_dir, single)] if has_single else []


def _entry(info: Any) -> tuple[str, list[int], list[int]] | None:
    """``(dtype, shape, data_offsets)`` of a safetensors header entry; ``None`` where it is not one."""

    def sizes(value: Any) -> bool:
        return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)

    if not isinstance(info, dict):
        return None
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype in _DTYPE_BITS and sizes(shape) and sizes(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]:
        return dtype, shape, offsets
    return None


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and safetensors dtype (``"BF16"`` ...) of every tensor in the safetensors file ``path``, from its header,
    checked as safetensors checks it on opening the file: the header is a JSON object, each tensor's byte range holds
    exactly its elements, the ranges follow each other without gap or overlap and end where the file ends.
    """

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: {problem}; {_REDO}")

    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if f.read(len(_LFS_POINTER)) == _LFS_POINTER:
                raise CheckpointError(
                    f"{path}: a Git LFS pointer, not the weights; fetch them (git lfs pull) or re-download"
                )
            f.seek(0)
            length = int.from_bytes(f.read(8), "little")
            if size < 8:
                raise bad("empty (0 bytes)" if size == 0 else f"truncated ({size} bytes, too few for a header)")
            if length > _HEADER_LIMIT:
                raise bad(f"not a safetensors file (its first 8 bytes give a header of {length} bytes)")
            if 8 + length > size:
                raise bad(f"truncated (its header length says {8 + length} bytes, file has {size})")
            raw = f.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc}); check the file") from None
    try:
        header = json.loads(raw.decode("utf-8")) if raw.startswith(b"{") else None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise bad(f"bad header ({str(exc).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise bad("bad header (not a JSON object)")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise bad("bad header (__metadata__ is not a map of strings)")
            continue
        entry = _entry(info)
        if entry is None:
            raise bad(f"bad header entry for {name} ({json.dumps(info)[:120]})")
        dtype, shape, offsets = entry
        bits = math.prod(shape) * _DTYPE_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:
            raise bad(f"{name} is {dtype} {shape} ({bits / 8:g} bytes), but its offsets hold {offsets[1] - offsets[0]}")
        out[name] = (tuple(shape), dtype)
        spans.append((offsets[0], offsets[1], name))
    needed = 8 + length + max((stop for _, stop, _ in spans), default=0)
    if needed > size:
        raise bad(f"truncated (header says {needed} bytes, file has {size})")
    end, previous = 0, None
    for begin, stop, name in sorted(spans):
        if begin < end:
            raise bad(f"{name} (bytes {begin}-{stop}) overlaps {previous} (ending at byte {end})")
        if begin > end:
            raise bad(f"{begin - end} bytes between {previous or 'the header'} and {name} belong to no tensor")
        end, previous = stop, name
    if needed < size:
        raise bad(f"longer than its tensors (header says {needed} bytes, file has {size})")
    return out


def stored_tensors(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """File, shape and safetensors dtype (``"BF16"`` ...) of every tensor of the checkpoint's :func:`weight_files`, by
    its name in the files, from their checked headers (:func:`read_header`). A name two files hold is refused."""
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in weight_files(model_dir):
        for name, (shape, dtype) in read_header(path).items():
            if name in out:
                raise CheckpointError(
                    f"{name} is in both {out[name][0]} and {path}; one is stale: re-download the checkpoint"
                )
            out[name] = (path, shape, dtype)
    return out


@contextmanager
def open_weights(path: Path) -> Iterator[Any]:
    """``safetensors.safe_open(path)``, its errors and those of reads through it re-raised as :class:`CheckpointError`
    naming the file (the file changed or cannot be read since its header was checked)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({str(exc).splitlines()[0]}); {_REDO}") from None


class TextCheckpoint(Mapping):
    """The language-model tensors of a safetensors checkpoint, under text-model names (a read-only mapping).

    A bridge reads it through megatron-bridge's own state accessor
    (:func:`model_support.core.megatron.state_source.hf_pretrained`); it is also the state dict a bridge's
    ``maybe_modify_loaded_hf_weight`` reads. For a multimodal checkpoint (``model.language_model.*``), ``model.X``
    names are served from ``model.language_model.X``; vision and MTP tensors are dropped.
    :meth:`raw_key` gives the name a tensor has in the files (what transformers' loader expects).
    """

    def __init__(self, model_dir: Path, config: Any = None) -> None:
        self.config = config
        self.source_dir = model_dir
        stored = stored_tensors(model_dir)
        if not stored:
            files = ", ".join(p.name for p in weight_files(model_dir))
            raise CheckpointError(
                f"{model_dir}: {files} hold(s) no tensors; {_REDO}"
                if files
                else f"no safetensors weights in {model_dir} (no {SINGLE} or {INDEX})"
            )
        self._where: dict[str, tuple[Path, str]] = {}
        raw = {key: path for key, (path, _, _) in stored.items()}
        multimodal = any(k.startswith(_VL_PREFIX) for k in raw)
        for key, path in raw.items():
            if multimodal and key.startswith(_VL_PREFIX):
                self._where["model." + key[len(_VL_PREFIX) :]] = (path, key)
            elif key.startswith(("model.", "lm_head.")) and not (multimodal and key.startswith("model.")):
                self._where[key] = (path, key)
        self._shapes = {name: stored[key][1] for name, (_, key) in self._where.items()}
        self.multimodal = multimodal

    def get_all_keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, key = self._where[name]
        with open_weights(path) as f:
            return f.get_tensor(key)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the safetensors header (no tensor data is read)."""
        return self._shapes[name]

    def raw_key(self, name: str) -> str:
        return self._where[name][1]

    def layer_of(self, name: str) -> int | None:
        """The decoder layer a text-model tensor belongs to (``None``: embedding, final norm, LM head)."""
        match = _LAYER.match(name)
        return int(match.group(1)) if match else None

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(raw key, tensor)`` for ``names``, opening each file once."""
        for name, tensor in self.read_named(names):
            yield self.raw_key(name), tensor

    def read_named(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(text-model name, tensor)`` for ``names``, opening each file once."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name][0], []).append(name)
        for path, group in by_file.items():
            with open_weights(path) as f:
                for name in group:
                    yield name, f.get_tensor(self._where[name][1])
