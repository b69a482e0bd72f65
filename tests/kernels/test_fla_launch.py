"""TunedKernel: tune once per key through the autotuner, then launch with the tuned setting."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.kernels.triton_source import SCALE_KERNEL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

REPO = Path(__file__).resolve().parents[2]


def _run(body: str) -> str:
    script = textwrap.dedent(SCALE_KERNEL) + textwrap.dedent(body)
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


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_cuda(), reason="needs CUDA")
def test_plans_launch_the_compiled_kernel_for_each_specialisation(tmp_path: Path) -> None:
    """On a GPU a second call fingerprinted like an earlier one launches that call's compiled kernel directly.
    A tensor at an address that is not 16-byte aligned, another length or a missing bias is another
    specialisation: a new plan, and every result right."""
    import torch
    import triton

    from model_support.kernels._fla_launch import TunedKernel

    (tmp_path / "plan_kernel.py").write_text(textwrap.dedent(SCALE_KERNEL))  # Triton reads a kernel's source file
    spec = importlib.util.spec_from_file_location("plan_kernel", tmp_path / "plan_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = TunedKernel(module.scale_kernel)
    jit_runs = []
    original = kernel._jit.run
    kernel._jit.run = lambda *a, **k: (jit_runs.append(k["N"]), original(*a, **k))[1]
    base = torch.randn(4100, device="cuda")
    plans = []
    calls = ((0, 40, True), (16, 40, True), (1, 40, True), (1, 40, True), (0, 40, False), (0, 100, True))
    for offset, n, bias in calls:
        x = base[offset : offset + n]
        b = torch.randn(n, device="cuda") if bias else None
        y = torch.empty(n, device="cuda")
        kernel(lambda meta, n=n: (triton.cdiv(n, meta["BLOCK"]),), x=x, y=y, b=b, s=2.0, N=n)
        torch.testing.assert_close(y, x * 2.0 + (b if bias else 0), rtol=0, atol=0)
        plans.append((len(kernel._plans), len(jit_runs)))
    # The first call goes through the autotuner (one config: one run, no plan); aligned again -> a run, plan 1;
    # unaligned -> a run, plan 2; unaligned again -> plan 2, no run; no bias and another length are other
    # tuning keys: the autotuner again.
    assert plans == [(0, 1), (1, 2), (2, 3), (2, 3), (2, 4), (2, 5)]


def test_a_launch_hook_sends_every_launch_through_triton() -> None:
    """A profiler's launch hook (Triton calls it from its own launch path) turns the direct launch off."""
    from triton import knobs

    from model_support.kernels._fla_launch import launch_hooks

    def hook(metadata: object) -> None:
        pass

    assert not launch_hooks()
    chain = knobs.runtime.launch_enter_hook
    try:
        chain.add(hook)
        assert launch_hooks()
    finally:
        chain.remove(hook)
    assert not launch_hooks()


def test_fingerprints_tell_argument_types_apart() -> None:
    """``True``, ``1`` and ``1.0`` hash and compare equal, but Triton compiles a kernel apart for each type."""
    import torch

    from model_support.kernels._fla_launch import _fingerprint

    assert len({_fingerprint(True), _fingerprint(1), _fingerprint(1.0)}) == 3
    x = torch.zeros(8)
    assert _fingerprint(x) == _fingerprint(torch.ones(8))
    assert _fingerprint(x[1:]) != _fingerprint(x)  # 4 bytes in: not 16-byte aligned
    assert _fingerprint(x.double()) != _fingerprint(x)
