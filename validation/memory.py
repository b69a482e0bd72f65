"""Peak GPU and host memory of this process while one validation stage runs."""

from __future__ import annotations

import resource
import sys

from model_support.validation.stage import StageResult

MIB = 1024 * 1024


class MemoryProbe:
    """Context manager measuring this process's peak memory over its ``with`` block (one stage).

    GPU (torch's caching allocator, reset on entry, largest value over the process's devices):
    ``gpu_mib`` is the peak of ``torch.cuda.max_memory_allocated`` (live tensors), ``gpu_reserved_mib``
    that of ``torch.cuda.max_memory_reserved`` (what the allocator holds from the driver). Memory
    allocated around the allocator (the CUDA context, NCCL buffers, other libraries' ``cudaMalloc``)
    is not included. Both are ``None`` where CUDA is not available; the probe never initialises CUDA
    itself, and both are 0.0 while nothing has.

    Host: ``host_mib`` is the peak resident set size (``VmHWM``) of this process during the block,
    counting what was already resident when it started. On Linux the high-water mark is reset on entry
    by writing ``5`` to ``/proc/self/clear_refs``; where that is refused (``OSError``), or on a system
    without it, ``host_mib`` is the peak of the process's whole lifetime so far and ``host_lifetime``
    is True.

    Neither side counts child processes, e.g. a vLLM server a stage starts.
    """

    def __init__(self) -> None:
        self.gpu_mib: float | None = None
        self.gpu_reserved_mib: float | None = None
        self.host_mib: float | None = None
        self.host_lifetime = False

    def __enter__(self) -> MemoryProbe:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for device in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(device)
        self.host_lifetime = not _reset_host_peak()
        return self

    def __exit__(self, *exc_info: object) -> None:
        import torch

        self.host_mib = _vm_hwm_mib()
        if self.host_mib is None:
            self.host_mib, self.host_lifetime = _ru_maxrss_mib(), True
        if torch.cuda.is_available():
            # Stats start at zero when CUDA is initialised, so a block that initialised it is covered too.
            devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else range(0)
            self.gpu_mib = max((torch.cuda.max_memory_allocated(d) / MIB for d in devices), default=0.0)
            self.gpu_reserved_mib = max((torch.cuda.max_memory_reserved(d) / MIB for d in devices), default=0.0)

    def record(self, result: StageResult) -> None:
        """Store the measured peaks on ``result``."""
        result.peak_gpu_mib = self.gpu_mib
        result.peak_gpu_reserved_mib = self.gpu_reserved_mib
        result.peak_host_mib = self.host_mib
        result.peak_host_lifetime = self.host_lifetime


def _reset_host_peak() -> bool:
    """Reset this process's resident-set high-water mark to its current size; False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _vm_hwm_mib() -> float | None:
    """``VmHWM`` of this process (peak resident set since the last reset); None without /proc."""
    try:
        with open("/proc/self/status") as f:
            status = f.read()
    except OSError:
        return None
    kib = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return None if kib is None else int(kib) * 1024 / MIB


def _ru_maxrss_mib() -> float:
    """Peak resident set of this process's whole lifetime (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak * 1024 / MIB
