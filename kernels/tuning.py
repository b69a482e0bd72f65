"""Tuned kernel settings shipped with the project, so that a fresh GPU does not autotune for minutes.

fla's Triton kernels autotune on first use: every candidate setting of every kernel is compiled and timed, once per
tuning key (the kernel's shape arguments and its tensors' dtypes), which took six minutes of a first check of a
Qwen3.5 replica on a fresh H100. Triton keeps each result in its cache (``TRITON_CACHE_DIR``, default
``~/.triton/cache``) as ``<key>/<kernel>.autotune.json``, where the key hashes Triton's version, the GPU target,
the kernel's source and the tuning key: an entry is only ever read for the exact Triton, GPU, kernel and shape it
was tuned for, and a later run of that shape reads it instead of tuning again.

``kernels/tuned/sm<CC>.json`` holds such entries for GPUs of one compute capability (``sm90``: Hopper, the H100 and
H200, which Triton compiles for alike), harvested by ``benchmarks/time_to_verdict.py`` from checks of the reference
configs' replicas on such a GPU. :func:`seed_triton_cache` copies the entries into Triton's cache before
the first kernel runs (never over an entry already there); a shape the file does not hold autotunes as before, and
the result stays in Triton's cache for the next run. ``MODEL_SUPPORT_TUNED_KERNELS=0`` leaves Triton's cache alone.

A run that compares results rather than timing kernels (``parallel_parity``'s layouts: each tensor-parallel split
is a new head count, each a new tuning key for every kernel, in fp32 and in bf16) need not tune at all:
:func:`model_support.core.precision.settled_fla_kernels` hands the same entries to fla's own config cache
(``FLA_CACHE_MODE=fuzzy``), where a kernel takes the setting of a shipped entry whose key differs from its own in
numbers only (head counts, lengths), never in dtypes or flags; :func:`write_fla_configs` writes them as fla reads
them. A check runs every stage so.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

TUNED_DIR = Path(__file__).with_name("tuned")
ENTRY_GLOB = "*/*.autotune.json"


def tuned_file_name(capability: tuple[int, int]) -> str:
    """The shipped file for GPUs of a compute capability (``(9, 0)``: ``sm90.json``)."""
    return f"sm{capability[0]}{capability[1]}.json"


def triton_cache_dir() -> Path:
    """Where Triton caches compiled kernels and autotuning results in this process."""
    from triton import knobs

    return Path(knobs.cache.dir)


def harvest(cache_dir: Path) -> dict[str, Any]:
    """Every autotuning result in the Triton cache ``cache_dir``: relative path -> the entry's JSON."""
    return {str(p.relative_to(cache_dir)): json.loads(p.read_text()) for p in sorted(cache_dir.glob(ENTRY_GLOB))}


def write_entries(entries: dict[str, Any], cache_dir: Path) -> int:
    """Write each entry into ``cache_dir`` where it is not there yet; returns how many were written. Each file is
    written whole before it takes its name (Triton reads any file that has the name)."""
    written = 0
    for relative, content in entries.items():
        target = cache_dir / relative
        if target.parent.parent != cache_dir or target.suffixes[-2:] != [".autotune", ".json"]:
            raise ValueError(f"not an autotuning entry of a Triton cache: {relative}")
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(content))
        partial.replace(target)
        written += 1
    return written


@functools.cache
def seed_triton_cache() -> int:
    """Copy this GPU's shipped autotuning results into Triton's cache, once per process; returns how many entries
    were new there (0 without CUDA or Triton, without a file for this GPU's compute capability, or where
    ``MODEL_SUPPORT_TUNED_KERNELS`` is ``0``)."""
    import torch

    if os.environ.get("MODEL_SUPPORT_TUNED_KERNELS", "1") == "0" or not torch.cuda.is_available():
        return 0
    shipped = TUNED_DIR / tuned_file_name(torch.cuda.get_device_capability())
    if not shipped.exists():
        return 0
    try:
        cache_dir = triton_cache_dir()
    except ImportError:
        return 0
    return write_entries(json.loads(shipped.read_text())["entries"], cache_dir)


def fla_config_files(entries: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """fla's config files (``<kernel>.json`` -> content, the format of ``fla.ops.utils.cache.KernelConfigFile``) for
    Triton cache entries ``entries`` (as :func:`harvest` returns them): each entry's fastest setting under its
    tuning key. fla takes the first entry that matches a key loosely, so each kernel's entries run from the smallest
    shapes up: a setting tuned on small shapes (small tiles) runs on larger ones, where the reverse may not fit."""
    by_kernel: dict[str, list[tuple[list[Any], dict[str, Any]]]] = {}
    for relative, content in entries.items():
        kernel = Path(relative).name.removesuffix(".autotune.json")
        # Triton's timings: (median, 20th, 80th percentile) milliseconds; inf where the setting did not run.
        fastest = min(content["configs_timings"], key=lambda pair: pair[1][0])
        by_kernel.setdefault(kernel, []).append((content["key"], fastest[0]))
    files = {}
    for kernel, found in by_kernel.items():
        found.sort(key=lambda pair: sum(v for v in pair[0] if isinstance(v, int | float) and not isinstance(v, bool)))
        files[f"{kernel}.json"] = {
            "kernel_name": kernel,
            "autotune_entries": {
                str(i): {"autotune_key": key, "config": setting} for i, (key, setting) in enumerate(found)
            },
        }
    return files


def write_fla_configs(config_dir: Path) -> int:
    """Write this GPU's shipped settings into ``config_dir`` as fla's config files (:func:`fla_config_files`); returns
    how many kernels have settings (0, and nothing written, without CUDA, a shipped file, or with
    ``MODEL_SUPPORT_TUNED_KERNELS=0``). fla reads them where ``FLA_CONFIG_DIR`` names the folder
    (:func:`model_support.core.precision.settled_fla_kernels`)."""
    import torch

    if os.environ.get("MODEL_SUPPORT_TUNED_KERNELS", "1") == "0" or not torch.cuda.is_available():
        return 0
    shipped = TUNED_DIR / tuned_file_name(torch.cuda.get_device_capability())
    if not shipped.exists():
        return 0
    files = fla_config_files(json.loads(shipped.read_text())["entries"])
    config_dir.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        partial = config_dir / f".{name}.{os.getpid()}.tmp"  # several ranks may write the same files
        partial.write_text(json.dumps(content))
        partial.replace(config_dir / name)
    return len(files)
