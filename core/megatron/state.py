"""Saving a LoRA training run's state and resuming it exactly: the adapter, the optimizer, the RNGs and the step.

A state is a directory: every rank writes its own ``rank-NNNNN.pt`` (its LoRA tensors as it holds them, i.e. its
tensor-parallel shards, expert-parallel experts and pipeline stage's layers; its optimizer's ``state_dict``; its RNG
states) and rank 0 a ``manifest.json`` (format, step, model, world size and parallel layout). The directory is
written under a hidden sibling name and renamed into place once every rank's file is complete, so a failure on any
rank leaves nothing at the path. The ranks must share the file system. A state resumes only the model, LoRA shapes
and parallel layout it was saved from (the optimizer's moments are per-rank shards); anything else is refused
before the model, the optimizer or the RNGs are touched.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model_support.core.errors import ModelSupportError
from model_support.core.megatron.lora import Chunks, lora_modules
from model_support.core.outputs import claim_staging, release, sweep

FORMAT = "model-support-train-state/2"
MANIFEST = "manifest.json"


class StateError(ModelSupportError):
    """A training state cannot be saved, or does not fit the model it is loaded into."""


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _world() -> tuple[int, int]:
    """(rank, world size); a process without torch.distributed is a world of one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _layout() -> dict[str, int]:
    """The parallel sizes the ranks' shards depend on (all 1 without megatron-core's parallel state)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"world": _world()[1]}
    return {
        "world": _world()[1],
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _describe(layout: dict[str, int]) -> str:
    """``2 ranks (tp2)``: the world size and the parallel sizes above 1."""
    parts = [f"{k}{v}" for k, v in layout.items() if k != "world" and v > 1]
    ranks = f"{layout['world']} rank" + ("s" if layout["world"] > 1 else "")
    return ranks + (f" ({', '.join(parts)})" if parts else "")


def _all_agree(error: str | None) -> None:
    """Raise :class:`StateError` on every rank when any rank reports an error (the lowest rank's)."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise StateError(first)


def _attempt(action: Callable[[], Any]) -> tuple[Any, str | None]:
    """``action()``'s result, or its error as one line (for :func:`_all_agree`)."""
    try:
        return action(), None
    except StateError as exc:
        return None, str(exc)
    except Exception as exc:  # every rank must learn of it, or the others would wait in the next collective
        text = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"rank {_world()[0]} could not save or load its state: {type(exc).__name__}: {text}"


def _lora_tensors(chunks: Chunks) -> dict[str, torch.Tensor]:
    """This rank's LoRA parameters under their single-rank module names (shards as this rank holds them)."""
    return {
        f"{name}.lora_{w}.weight": getattr(module, f"lora_{w}").weight
        for name, module in lora_modules(chunks).items()
        for w in "AB"
    }


def _base_fingerprint(chunks: Chunks) -> str:
    """A digest of the frozen base weights this rank holds (names, shapes, dtypes and up to 4096 values of each,
    evenly spread): a state is resumed on the checkpoint it was trained on, not another of the same shapes."""
    import hashlib

    digest = hashlib.sha256()
    for chunk in chunks if isinstance(chunks, list) else [chunks]:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                continue
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu()
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _rng_states() -> dict[str, Any]:
    """Every RNG a step may draw from: torch's CPU and current CUDA device's, Python's, numpy's (when installed) and
    megatron-core's tensor-parallel CUDA RNG tracker (when initialised). Plain tensors, tuples and numbers only, so
    the file loads with ``weights_only``."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import random as megatron_random

        states["cuda"] = torch.cuda.get_rng_state()
        # megatron-core has no public "is it initialised" that does not create a tracker as a side effect.
        if megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            states["megatron_cuda"] = megatron_random.get_cuda_rng_tracker().get_states()
    try:
        import numpy as np
    except ImportError:
        return states
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    states["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    if "megatron_cuda" in states:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(states["megatron_cuda"])
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def save_state(chunks: Chunks, optimizer: torch.optim.Optimizer, path: Path, *, step: int, model: str) -> Path:
    """Write this run's state at ``path`` (a new directory) atomically; every rank calls it. ``model`` names the
    model (the handler) for :func:`load_state`'s check. Returns ``path``."""
    path = Path(path)
    rank = _world()[0]
    staging = path.parent / f".{path.name}.partial"

    held: list[int] = []  # rank 0's lock on the staging directory while the ranks write into it

    def prepare() -> None:
        if path.exists():
            raise StateError(f"{path} already exists: save each state to a new path (or remove the old one)")
        sweep(path.parent, ".*.partial")  # the leftovers of killed saves (and exports) here
        held.append(claim_staging(staging, path, StateError))

    _all_agree(_attempt(prepare)[1] if rank == 0 else None)
    shard = {
        "lora": {k: v.detach().cpu() for k, v in _lora_tensors(chunks).items()},
        "optimizer": optimizer.state_dict(),
        "rng": _rng_states(),
        "base": _base_fingerprint(chunks),
    }
    _, error = _attempt(lambda: torch.save(shard, staging / _rank_file(rank)))
    try:
        _all_agree(error)
    except StateError:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            release(staging, held.pop())
        raise

    def publish() -> None:
        release(staging, held.pop())
        manifest = {
            "format": FORMAT,
            "step": step,
            "model": model,
            "layout": _layout(),
            "optimizer": type(optimizer).__name__,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        staging.rename(path)

    error = _attempt(publish)[1] if rank == 0 else None
    if error is not None:
        shutil.rmtree(staging, ignore_errors=True)
    _all_agree(error)
    return path


def _read(chunks: Chunks, optimizer: torch.optim.Optimizer, path: Path, model: str) -> dict[str, Any]:
    """This rank's shard of the state at ``path``, once everything in it is known to fit (else :class:`StateError`)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise StateError(f"{path} holds no training state ({MANIFEST} missing): give the directory save_state wrote")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise StateError(f"{path} is in format {manifest.get('format')!r}, not {FORMAT!r}: save it again")
    if manifest["model"] != model:
        raise StateError(
            f"the state at {path} was saved from {manifest['model']}, this model is {model}: load it into the model "
            "it was saved from"
        )
    if manifest["layout"] != _layout():
        raise StateError(
            f"the state at {path} was saved by {_describe(manifest['layout'])}, this run is "
            f"{_describe(_layout())}: resume in the layout it was saved in"
        )
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise StateError(f"the state at {path} has step {step!r}, not a count of steps: it was changed after saving")
    if manifest.get("optimizer") != type(optimizer).__name__:
        raise StateError(
            f"the state at {path} holds a {manifest.get('optimizer')} optimizer, this one is "
            f"{type(optimizer).__name__}: build the optimizer it was saved with"
        )
    shard = torch.load(path / _rank_file(_world()[0]), map_location="cpu", weights_only=True)
    missing = [key for key in ("lora", "optimizer", "rng", "base") if key not in shard]
    missing += [f"rng.{key}" for key in ("torch", "python") if key not in shard.get("rng", {})]
    if missing:
        raise StateError(f"{path / _rank_file(_world()[0])} lacks {', '.join(missing)}: it was changed after saving")
    if shard["base"] != _base_fingerprint(chunks):
        raise StateError(
            f"the state at {path} was trained on other base weights than this model's (same names and shapes, other "
            "values): load it into the checkpoint it was trained on"
        )
    saved = {k: tuple(v.shape) for k, v in shard["lora"].items()}
    here = {k: tuple(v.shape) for k, v in _lora_tensors(chunks).items()}
    if saved != here:
        differ = sorted(k for k in saved.keys() | here.keys() if saved.get(k) != here.get(k))
        name = differ[0]
        raise StateError(
            f"the state at {path} holds other LoRA tensors than this model ({name}: {saved.get(name)} saved, "
            f"{here.get(name)} here): apply_lora with the rank and targets it was saved with"
        )
    groups = [len(g["params"]) for g in shard["optimizer"]["param_groups"]]
    if groups != [len(g["params"]) for g in optimizer.param_groups]:
        raise StateError(
            f"the state at {path} holds an optimizer over parameter groups of {groups} parameters, this one's differ: "
            "build the optimizer over the same parameters, in the same order"
        )
    return shard | {"step": manifest["step"]}


def load_state(chunks: Chunks, optimizer: torch.optim.Optimizer, path: Path, *, model: str) -> int:
    """Load the state :func:`save_state` wrote at ``path`` into this rank's LoRA, ``optimizer`` and RNGs; every rank
    calls it. Returns the saved step. Refused (:class:`StateError`, nothing changed) unless it fits."""
    path = Path(path)
    shard, error = _attempt(lambda: _read(chunks, optimizer, path, model))
    _all_agree(error)
    # What is left to go wrong (an optimizer state of another shape, an RNG state torch refuses) is found while
    # loading: everything is put back as it was before the error is raised.
    lora = _lora_tensors(chunks)
    before = ({k: v.detach().clone() for k, v in lora.items()}, copy.deepcopy(optimizer.state_dict()), _rng_states())

    def apply() -> None:
        with torch.no_grad():
            for name, param in lora.items():
                param.copy_(shard["lora"][name])
        optimizer.load_state_dict(shard["optimizer"])
        _check_optimizer_state(optimizer)
        _set_rng_states(shard["rng"])

    _, error = _attempt(apply)
    if error is not None:
        with torch.no_grad():
            for name, param in lora.items():
                param.copy_(before[0][name])
        optimizer.load_state_dict(before[1])
        _set_rng_states(before[2])
    _all_agree(None if error is None else f"the state at {path} does not fit: {error}; nothing was changed")
    return int(shard["step"])


def _check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's loaded optimizer state must have the parameter's shape (``load_state_dict`` takes any)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    shapes = f"{list(value.shape)}, its parameter {list(param.shape)}"
                    raise StateError(f"optimizer state {key!r} is {shapes}")
