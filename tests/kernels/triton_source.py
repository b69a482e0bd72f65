"""Source of a small Triton kernel for tests of the launch machinery (run as a script, or written to a file:
Triton reads a kernel's source from its file)."""

SCALE_KERNEL = """
import torch, triton, triton.language as tl
from triton.runtime.autotuner import Autotuner

@triton.heuristics({"HAS_BIAS": lambda args: args["b"] is not None})
@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1)], key=["N"])
@triton.jit
def scale_kernel(x, y, b, s, N, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    out = tl.load(x + offs, mask=mask) * s
    if HAS_BIAS:
        out += tl.load(b + offs, mask=mask)
    tl.store(y + offs, out, mask=mask)
"""
