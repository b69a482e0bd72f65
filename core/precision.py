"""fp32 arithmetic at fp32 precision on a GPU, for comparisons held to fixed fp32 tolerances."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
