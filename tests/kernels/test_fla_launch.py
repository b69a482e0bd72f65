"""TunedKernel: tune once per key through the autotuner, then launch with the tuned setting."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

REPO = Path(__file__).resolve().parents[2]

KERNEL = """
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


def _run(body: str) -> str:
    script = textwrap.dedent(KERNEL) + textwrap.dedent(body)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_tunes_once_per_key_then_launches_with_the_tuned_setting() -> None:
    out = _run(
        """
        from model_support.kernels._fla_launch import TunedKernel

        autotuner = scale_kernel.fn
        tuned_runs = []
        original = autotuner.run
        autotuner.run = lambda *a, **k: (tuned_runs.append(k["N"]), original(*a, **k))[1]
        kernel = TunedKernel(scale_kernel)
        errors = []
        for n, bias in ((40, True), (40, True), (40, False), (100, True), (40, True)):
            x, b = torch.randn(n), torch.randn(n) if bias else None
            y = torch.empty(n)
            kernel(lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x=x, y=y, b=b, s=2.0, N=n)
            want = x * 2.0 + (b if bias else 0)
            errors.append(float((y - want).abs().max()))
        y = torch.empty(40)
        kernel(lambda meta: (triton.cdiv(40, meta["BLOCK"]),), {"BLOCK": 64, "num_warps": 2}, x=x[:40], y=y, b=None,
               s=3.0, N=40)
        errors.append(float((y - x[:40] * 3.0).abs().max()))
        print(tuned_runs, max(errors))
        """
    )
    runs, error = out.rsplit(" ", 1)
    # N=40 with a bias and without (a tensor's dtype more or less in the key), N=100: one tuning each.
    assert runs == "[40, 40, 100]"
    assert float(error) == 0.0


def test_heuristics_inside_an_autotuner_are_refused() -> None:
    import triton
    import triton.language as tl

    from model_support.kernels._fla_launch import TunedKernel

    @triton.autotune(configs=[triton.Config({}, num_warps=1)], key=["N"])
    @triton.heuristics({"EVEN": lambda args: args["N"] % 2 == 0})
    @triton.jit
    def kernel(x, N, EVEN: tl.constexpr):
        pass

    with pytest.raises(TypeError, match="heuristics inside an autotuner"):
        TunedKernel(kernel)


def test_a_setting_that_does_not_fit_falls_back_to_the_tuned_one() -> None:
    """A fixed setting that needs more shared memory than the GPU has (float32 inputs need twice bfloat16's)
    is refused by Triton before it runs; the launch then goes through the autotuner, and the setting is not
    tried again for that tuning key. (Triton refuses a launch this way only on a GPU: the kernel object here
    plays a JIT function whose launch is refused.)"""
    import torch
    from triton.runtime.errors import OutOfResources

    from model_support.kernels._fla_launch import TunedKernel

    launches: list[str] = []

    class RefusingJit:
        def run(self, grid: tuple[int], warmup: bool, **kwargs: object) -> None:
            if kwargs.get("BV") == 16:
                launches.append(f"fixed BV=16 grid={grid}")
                raise OutOfResources(295944, 232448, "shared memory")
            launches.append(f"tuned setting, K={kwargs['K']}")

        def __getitem__(self, grid: object) -> object:
            return lambda **kwargs: launches.append(f"through the autotuner, K={kwargs['K']}")

    kernel = TunedKernel(RefusingJit())
    for _ in range(2):
        kernel((16,), {"BV": 16, "num_warps": 4, "num_stages": 3}, k=torch.zeros(2), K=128)
    assert launches == ["fixed BV=16 grid=(16,)", "through the autotuner, K=128", "tuned setting, K=128"]
