"""What a comparison runs under on a GPU: fp32 arithmetic at fp32 precision (fixed fp32 tolerances), eager fp32
arithmetic, fla's kernels on the shipped settings instead of autotuning."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from model_support.core.environment import environment

# Triton's default precision of tl.dot on float32 operands; read when a kernel compiles and part of its cache key.
TRITON_FP32_DEFAULT = "TRITON_F32_DEFAULT"


@contextmanager
def exact_fp32(enabled: bool = True) -> Iterator[None]:
    """Within the block, float32 matmuls, convolutions and Triton dots run at float32 precision, not TF32
    (``enabled=False``: the block runs with the settings as they are).

    On Ampere and later, cuDNN convolutions take TF32 by default and so does Triton's ``tl.dot`` on float32
    operands where a kernel names no precision (fla's Gated DeltaNet kernels): about 1e-3 relative error, ten times
    the 1e-4 an fp32 comparison allows. Kernels compiled inside the block keep full precision (a kernel already
    compiled for the same argument types keeps the precision it was compiled with). On a CPU nothing changes.
    """
    if not enabled:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        with environment(**{TRITON_FP32_DEFAULT: "ieee"}):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@contextmanager
def eager_only(enabled: bool = True) -> Iterator[None]:
    """Within the block, functions wrapped in ``torch.compile`` run eagerly (``enabled=False``: as they are).

    megatron-core compiles some of its layers' arithmetic (its ``jit_fuser``: the Gated DeltaNet layer's input
    preparation, gating and gated output norm). Inductor's kernels for them are generated per call's shapes (a
    parallel layout's shards are other shapes; after its recompile limit a function runs eagerly from then on) and
    round differently from each other and from eager, at about 1e-7 relative; a real-width model carries that to
    its logits at 1e-5 to 1e-4. Comparisons held to fixed fp32 tolerances run every model on the same arithmetic.
    """
    if not enabled:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


@contextmanager
def settled_fla_kernels(config_dir: Path) -> Iterator[int]:
    """While open, fla's kernels in this process (and in the processes it starts) take this GPU's shipped settings
    (``kernels/tuned``) instead of autotuning: fla's config cache in its fuzzy mode gives a kernel the setting of its
    exact tuning key, else of one that differs in numbers only (head counts, lengths), never in dtypes or flags; a
    kernel with no such entry tunes as before. Yields how many kernels have settings (0, and nothing changed, where
    :func:`~model_support.kernels.tuning.write_fla_configs` writes none). For runs whose verdict does not depend on
    which setting a kernel runs (a check); on leaving, fla takes its settings from the environment again."""
    from model_support.kernels.tuning import write_fla_configs

    count = write_fla_configs(config_dir)
    if not count:
        yield 0
        return
    try:
        with environment(FLA_CONFIG_DIR=str(config_dir), FLA_CACHE_MODE="fuzzy"):
            _fla_reads_environment()
            yield count
    finally:
        _fla_reads_environment()


def _fla_reads_environment() -> None:
    """fla reads ``FLA_CACHE_MODE`` once, when it is imported: an imported fla takes the environment's again."""
    cache = sys.modules.get("fla.ops.utils.cache")
    if cache is not None:
        cache.FLA_CACHE_MODE = cache.FlaCacheMode.from_env()
