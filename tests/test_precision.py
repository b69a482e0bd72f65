"""exact_fp32: fp32 comparisons on a GPU run without TF32, and the process's settings come back afterwards;
eager_only: compiled functions run eagerly inside it."""

from __future__ import annotations

import os

import pytest
import torch

from model_support.core.precision import TRITON_FP32_DEFAULT, eager_only, exact_fp32


def test_settings_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    monkeypatch.delenv(TRITON_FP32_DEFAULT, raising=False)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        with exact_fp32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
            assert os.environ[TRITON_FP32_DEFAULT] == "ieee"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert TRITON_FP32_DEFAULT not in os.environ
        monkeypatch.setenv(TRITON_FP32_DEFAULT, "tf32x3")
        with pytest.raises(RuntimeError, match="inside"), exact_fp32():
            raise RuntimeError("inside")
        assert os.environ[TRITON_FP32_DEFAULT] == "tf32x3"
        with exact_fp32(enabled=False):
            assert torch.backends.cuda.matmul.allow_tf32 and os.environ[TRITON_FP32_DEFAULT] == "tf32x3"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_eager_only_runs_compiled_functions_eagerly() -> None:
    """A function wrapped in torch.compile (as megatron-core's jit_fuser wraps its layers' arithmetic) is not
    compiled inside the block, and compiles as before outside it."""
    graphs = []

    def counting_backend(graph: torch.fx.GraphModule, _inputs: list[torch.Tensor]):
        graphs.append(graph)
        return graph.forward

    @torch.compile(backend=counting_backend, dynamic=False)
    def gated(x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)

    x = torch.randn(8)
    with eager_only():
        torch.testing.assert_close(gated(x), x * torch.sigmoid(x), rtol=0, atol=0)
    assert graphs == []
    with eager_only(enabled=False):
        gated(x)
    assert len(graphs) == 1
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (TF32 exists only on a GPU)")
def test_triton_dot_and_convolution_at_fp32() -> None:
    """A Triton dot that names no precision and a cuDNN convolution, inside the block, within fp32 rounding of
    float64 (TF32 would be about 1e-3 off)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a, b, c, n: tl.constexpr) -> None:
        rows = tl.arange(0, n)[:, None] * n + tl.arange(0, n)[None, :]
        tl.store(c + rows, tl.dot(tl.load(a + rows), tl.load(b + rows)))

    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(64, 64, device="cuda", generator=gen) for _ in range(2))
    x, w = torch.randn(1, 64, 512, device="cuda", generator=gen), torch.randn(64, 1, 4, device="cuda", generator=gen)
    with exact_fp32():
        c = torch.empty_like(a)
        dot[(1,)](a, b, c, n=64)
        conv = torch.nn.functional.conv1d(x, w, groups=64)
    exact = a.double() @ b.double()
    assert ((c.double() - exact).norm() / exact.norm()).item() < 1e-6
    exact_conv = torch.nn.functional.conv1d(x.double(), w.double(), groups=64)
    assert ((conv.double() - exact_conv).norm() / exact_conv.norm()).item() < 1e-6
