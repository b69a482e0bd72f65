"""The language-model tensors of a safetensors checkpoint, read lazily, one tensor at a time."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from model_support.core.errors import ModelSupportError

_VL_PREFIX = "model.language_model."
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ModelSupportError):
    """The checkpoint's weights cannot be read."""


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(model_dir.glob("*.safetensors"))


def stored_tensors(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """File, shape and safetensors dtype (``"BF16"`` ...) of every tensor, by its name in the files (headers only)."""
    from safetensors import safe_open

    out = {}
    for path in weight_files(model_dir):
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                view = f.get_slice(key)
                out[key] = (path, tuple(view.get_shape()), view.get_dtype())
    return out


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
        if not weight_files(model_dir):
            raise CheckpointError(f"no safetensors weights in {model_dir}")
        self._where: dict[str, tuple[Path, str]] = {}
        stored = stored_tensors(model_dir)
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
        from safetensors import safe_open

        path, key = self._where[name]
        with safe_open(path, "pt") as f:
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
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name][0], []).append(name)
        for path, group in by_file.items():
            with safe_open(path, "pt") as f:
                for name in group:
                    yield name, f.get_tensor(self._where[name][1])
