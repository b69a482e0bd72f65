"""Which Gated DeltaNet implementation runs, and why: a runtime policy, never a silent guess.

Backends (all take the same arguments, see :mod:`model_support.kernels.gdn`):

``fla``
    flash-linear-attention's fused Triton kernels. Chosen on CUDA when fla is installed and
    known to be correct for the installed Triton and GPU. fla 0.6.0 itself refuses its gated
    backward (``chunk_bwd_dqkwg``) on Hopper with Triton in [3.4.0, 3.7.1) because that
    compiler produces wrong results there; forward-only use is unaffected.
``fla-hybrid``
    fla's kernels as fla composes them, with our own ``chunk_bwd_dqkwg`` (the one kernel fla
    refuses on Hopper with Triton in [3.4.0, 3.7.1); see :mod:`._fla_hybrid`), for the fla
    releases whose composition it follows (0.6.x). Chosen for training exactly where fla is
    refused for that kernel alone. Checked against the float64 recurrence (outputs and all
    gradients, shared prefix included) on an H100 with fla 0.6.0 and Triton 3.6.0
    (``benchmarks/gdn_benchmark.py``); its own kernel also in Triton's CPU interpreter.
``chunked-triton``
    Our chunked formulation: the work inside each chunk as batched torch operations
    (``torch.compile``-d on CUDA), the chunk-to-chunk state recurrence (forward and
    hand-written backward) as our own Triton kernels. Chosen on CUDA when fla is absent or
    refused (and fla-hybrid does not apply) and Triton is importable.
``torch-chunked``
    The same formulation with the recurrence as a torch loop (the intra-chunk stage is
    compiled only where Triton is there for inductor). Runs on any device and in float64;
    the CPU default.

Versions are read from package metadata once per process: selecting a backend imports neither
fla nor Triton, and costs nothing per call.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch
from packaging.version import Version

__all__ = ["BACKENDS", "BackendChoice", "select_backend"]

BACKENDS = ("fla", "fla-hybrid", "chunked-triton", "torch-chunked")

# fla 0.6.0 raises in chunk_bwd_dqkwg for Triton >= 3.4.0, < 3.7.1 on sm_90 (fla issue #640).
_HOPPER_BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))
# fla releases whose backward composition kernels/_fla_hybrid.py follows.
_HYBRID_FLA = (Version("0.6.0"), Version("0.7.0"))


@dataclass(frozen=True)
class BackendChoice:
    """The backend that will run and one sentence saying why."""

    name: str
    reason: str


def _dist_version(*names: str) -> Version | None:
    for name in names:
        try:
            return Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _fla_version() -> Version | None:
    if not _importable("fla"):
        return None
    return _dist_version("fla-core", "flash-linear-attention")


@functools.cache
def _triton_version() -> Version | None:
    if not _importable("triton"):
        return None
    return _dist_version("triton", "pytorch-triton")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _hopper_dqkwg_bug(device: torch.device, triton: Version) -> bool:
    """fla #640: Triton in [3.4.0, 3.7.1) miscompiles fla's gated ``chunk_bwd_dqkwg`` on sm_90."""
    low, high = _HOPPER_BAD_TRITON
    return torch.cuda.get_device_capability(device)[0] == 9 and low <= triton < high


def _fla_refusal(device: torch.device, triton: Version | None, need_backward: bool) -> str | None:
    """Why fla must not run here (``None`` when it may)."""
    fla = _fla_version()
    if fla is None:
        return "flash-linear-attention is not installed"
    if device.type != "cuda":
        return f"fla needs a CUDA device, got {device.type}"
    if triton is None:
        return f"fla {fla} needs Triton, which is not installed"
    if need_backward and _hopper_dqkwg_bug(device, triton):
        return f"fla {fla} backward is refused on Hopper (sm_90) with triton {triton} < {_HOPPER_BAD_TRITON[1]}"
    return None


def _hybrid_applies(device: torch.device, triton: Version | None) -> bool:
    """fla is refused only for its ``chunk_bwd_dqkwg``, in a release whose composition fla-hybrid follows."""
    fla = _fla_version()
    if fla is None or triton is None or device.type != "cuda" or not _hopper_dqkwg_bug(device, triton):
        return False
    low, high = _HYBRID_FLA
    return low <= fla < high


def select_backend(device: torch.device | str | None = None, *, need_backward: bool = True) -> BackendChoice:
    """Pick the backend for ``device`` (default: the current CUDA device, else the CPU).

    ``need_backward=False`` (inference) lets fla run forward-only where its backward is
    refused. The choice never trades correctness for speed: fla is taken only where it is
    known to be right, and our own paths are checked against a float64 reference.
    """
    device = _resolve_device(device)
    if device.type != "cuda":
        return BackendChoice(
            "torch-chunked", f"{device.type} device: fla and our Triton recurrence need CUDA, so the torch loop runs"
        )
    triton = _triton_version()
    refusal = _fla_refusal(device, triton, need_backward)
    if refusal is None:
        fla = _fla_version()
        scope = "forward and backward" if need_backward else "forward-only"
        return BackendChoice("fla", f"fla {fla} with triton {triton} is known-correct here ({scope})")
    if _hybrid_applies(device, triton):
        return BackendChoice(
            "fla-hybrid", f"{refusal}; using fla's other kernels with our own chunk_bwd_dqkwg (fla-hybrid)"
        )
    if triton is not None:
        return BackendChoice("chunked-triton", f"{refusal}; using our chunked formulation with the Triton recurrence")
    return BackendChoice("torch-chunked", f"{refusal} and Triton is missing; using the torch chunked formulation")


def check_backend(name: str, device: torch.device | str | None, *, need_backward: bool) -> None:
    """Raise ``ValueError`` if backend ``name`` cannot run correctly on ``device``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown GDN backend {name!r}; choose one of {', '.join(BACKENDS)}")
    device = _resolve_device(device)
    if name == "fla":
        refusal = _fla_refusal(device, _triton_version(), need_backward)
        if refusal is not None:
            raise ValueError(f"GDN backend 'fla' cannot run correctly here: {refusal}")
    elif name == "fla-hybrid" and not _hybrid_applies(device, _triton_version()):
        raise ValueError(
            f"GDN backend 'fla-hybrid' needs fla >= {_HYBRID_FLA[0]}, < {_HYBRID_FLA[1]} on a Hopper GPU with "
            f"triton in [{_HOPPER_BAD_TRITON[0]}, {_HOPPER_BAD_TRITON[1]}); elsewhere use 'fla' or 'chunked-triton'"
        )
    elif name == "chunked-triton" and (device.type != "cuda" or _triton_version() is None):
        raise ValueError("GDN backend 'chunked-triton' needs a CUDA device and Triton")
