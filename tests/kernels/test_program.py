"""Passes declared as data (kernels/_program.py): buffer layout, references, and the fixed launches on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.kernels.triton_source import SCALE_KERNEL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

REPO = Path(__file__).resolve().parents[2]

# A pass of three launches: y = x * s (+ b) into a scratch buffer, rows 1: of it into the output, then the output's
# first 4 entries halved (plus a zeroed buffer). With 7 columns the output's row 1 is 28 bytes in: not 16-byte
# aligned, so that pass is never fixed.
PASS = (
    SCALE_KERNEL
    + """
from model_support.kernels._fla_launch import TunedKernel
from model_support.kernels._program import Buffer, Launch, Layout, Pass, Ref

KERNEL = TunedKernel(scale_kernel)
ROWS = 5

def make_pass(cols):
    n = ROWS * cols
    layout = Layout({
        "scratch": [Buffer("pad", (3,), torch.float16), Buffer("y", (ROWS, cols), torch.float32),
                    Buffer("zeros", (4,), torch.float32, zero=True)],
        "out": [Buffer("out", (ROWS, cols), torch.float32, zero=True)],
    })
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    return Pass(layout, ["scratch", "out"], [
        Launch(KERNEL, grid, dict(x=Ref("x"), y=Ref("y"), b=Ref("b"), s=2.0, N=n)),
        Launch(KERNEL, grid, dict(x=Ref("y", 1), y=Ref("out", 1), b=None, s=1.0, N=n - cols)),
        Launch(KERNEL, grid, dict(x=Ref("out"), y=Ref("out"), b=Ref("zeros"), s=0.5, N=4)),
    ])

def want(x, b):
    y = x * 2.0 + (0 if b is None else b)
    out = torch.zeros_like(x)
    out[1:] = y[1:]
    out.view(-1)[:4] *= 0.5
    return out
"""
)


def test_layout_places_buffers_aligned_zeroed_ones_first_and_views_them() -> None:
    from model_support.kernels._program import ALIGN, Buffer, Layout, Ref

    layout = Layout(
        {
            "w": [Buffer("a", (3, 5), torch.bfloat16), Buffer("z", (7,), torch.float32, zero=True)],
            "solo": [Buffer("s", (2, 4), torch.float64)],
        }
    )
    assert [layout.home(Ref(n)) for n in ("z", "a", "s", "x")] == ["w", "w", "solo", "x"]  # x: an input
    env = {"w": layout.allocate("w", torch.device("cpu")), "solo": layout.allocate("solo", torch.device("cpu"))}
    base = env["w"].data_ptr()
    offsets = [layout.tensor(env, ref).data_ptr() - base for ref in (Ref("z"), Ref("a"), Ref("a", 2))]
    assert offsets == [0, ALIGN, ALIGN + 2 * 5 * 2]
    assert env["w"].dtype == torch.uint8 and env["w"].numel() == 2 * ALIGN
    assert env["solo"].shape == (2, 4) and env["solo"].dtype == torch.float64
    z, a = layout.tensor(env, Ref("z")), layout.tensor(env, Ref("a"))
    assert z.tolist() == [0.0] * 7 and a.shape == (3, 5) and a.dtype == torch.bfloat16
    a.fill_(3.0)
    assert z.tolist() == [0.0] * 7  # no overlap
    assert layout.tensor(env, Ref("a", 1, 2)).shape == (1, 5)
    env["h0"] = None
    assert layout.tensor(env, Ref("h0")) is None


def test_a_pass_runs_through_tuned_kernels_in_the_interpreter() -> None:
    """Under Triton's interpreter a pass runs every launch through TunedKernel and is never fixed."""
    body = """
    results, step = [], make_pass(8)
    for bias in (True, False, True):
        x = torch.randn(ROWS, 8)
        b = torch.randn(ROWS, 8) if bias else None
        env = step({"x": x, "b": b}, x.device)
        results.append(float((env["out"] - want(x, b)).abs().max()))
    print(max(results), step.fixed)
    """
    script = textwrap.dedent(PASS) + textwrap.dedent(body)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.0", "False"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fixed_pass_launches_compiled_kernels_and_falls_back_where_it_must(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU: the first run tunes (no plan), the second plans and fixes the pass, later runs launch the
    compiled kernels without TunedKernel. An unaligned input, an input missing that the fix saw, or a launch
    hook run through TunedKernel instead; every result is exact."""
    from triton import knobs

    from model_support.kernels._fla_launch import TunedKernel

    calls = []
    original = TunedKernel.__call__
    monkeypatch.setattr(TunedKernel, "__call__", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    (tmp_path / "pass_kernel.py").write_text(textwrap.dedent(PASS))  # Triton reads a kernel's source file
    spec = importlib.util.spec_from_file_location("pass_kernel", tmp_path / "pass_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    step, cols = module.make_pass(8), 8
    base = torch.randn(2 * module.ROWS * cols + 1, device="cuda")
    bias = torch.randn(module.ROWS, cols, device="cuda")
    hook_chain = knobs.runtime.launch_enter_hook
    record = []
    for case in ("tune", "plan", "fixed", "fixed", "unaligned", "no bias", "hook", "fixed"):
        offset = 1 if case == "unaligned" else 0
        x = base[offset : offset + module.ROWS * cols].view(module.ROWS, cols)
        b = None if case == "no bias" else bias
        before = len(calls)
        if case == "hook":
            hook_chain.add(print)
        try:
            env = step({"x": x, "b": b}, x.device)
        finally:
            if case == "hook":
                hook_chain.remove(print)
        torch.testing.assert_close(env["out"], module.want(x, b), rtol=0, atol=0)
        record.append((case, len(calls) - before, step.fixed))
    assert record == [
        ("tune", 3, False),
        ("plan", 3, True),
        ("fixed", 0, True),
        ("fixed", 0, True),
        ("unaligned", 3, True),
        ("no bias", 3, True),
        ("hook", 3, True),
        ("fixed", 0, True),
    ]
    odd = module.make_pass(7)  # a launch on the output's row 1, 28 bytes in: never fixed, always right
    for _ in range(3):
        x = torch.randn(module.ROWS, 7, device="cuda")
        torch.testing.assert_close(odd({"x": x, "b": None}, x.device)["out"], module.want(x, None), rtol=0, atol=0)
    assert not odd.fixed
