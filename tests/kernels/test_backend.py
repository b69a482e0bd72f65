"""Backend policy: fla only where known-correct, our own paths otherwise, always with a reason."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from packaging.version import Version

from model_support.kernels import backend as policy
from model_support.kernels import chunk_gated_delta_rule, select_backend


def test_cpu_gets_torch_chunked_with_reason() -> None:
    choice = select_backend("cpu")
    assert choice.name == "torch-chunked"
    assert "cpu" in choice.reason


def test_selection_imports_neither_fla_nor_triton() -> None:
    code = (
        "import sys; from model_support.kernels import select_backend; select_backend('cpu'); "
        "print(sorted(m for m in ('fla', 'triton') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("fla", "triton", "capability", "need_backward", "name", "in_reason"),
    [
        ("0.6.0", "3.6.0", (9, 0), True, "fla-hybrid", "fla 0.6.0 backward is refused on Hopper (sm_90) "
         "with triton 3.6.0 < 3.7.1; using fla's other kernels with our own chunk_bwd_dqkwg"),
        ("0.7.0", "3.6.0", (9, 0), True, "chunked-triton", "fla 0.7.0 backward is refused on Hopper (sm_90) "
         "with triton 3.6.0 < 3.7.1; using our chunked formulation"),
        ("0.6.0", "3.6.0", (9, 0), False, "fla", "forward-only"),
        ("0.6.0", "3.7.1", (9, 0), True, "fla", "forward and backward"),
        ("0.6.0", "3.3.1", (9, 0), True, "fla", "known-correct"),
        ("0.6.0", "3.6.0", (8, 0), True, "fla", "known-correct"),
        (None, "3.6.0", (8, 0), True, "chunked-triton", "not installed"),
        (None, None, (9, 0), True, "torch-chunked", "Triton is missing"),
    ],
)  # fmt: skip
def test_cuda_policy(
    monkeypatch: pytest.MonkeyPatch,
    fla: str | None,
    triton: str | None,
    capability: tuple[int, int],
    need_backward: bool,
    name: str,
    in_reason: str,
) -> None:
    monkeypatch.setattr(policy, "_fla_version", lambda: None if fla is None else Version(fla))
    monkeypatch.setattr(policy, "_triton_version", lambda: None if triton is None else Version(triton))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    choice = select_backend("cuda:0", need_backward=need_backward)
    assert choice.name == name
    assert in_reason in choice.reason


def test_named_backend_that_would_be_wrong_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "_fla_version", lambda: Version("0.6.0"))
    monkeypatch.setattr(policy, "_triton_version", lambda: Version("3.6.0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    with pytest.raises(ValueError, match="refused on Hopper"):
        policy.check_backend("fla", "cuda:0", need_backward=True)
    policy.check_backend("fla", "cuda:0", need_backward=False)
    policy.check_backend("fla-hybrid", "cuda:0", need_backward=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match=r"'fla-hybrid' needs fla >= 0\.6\.0, < 0\.7\.0 on a Hopper GPU"):
        policy.check_backend("fla-hybrid", "cuda:0", need_backward=True)


def test_named_backends_on_cpu() -> None:
    x = torch.randn(1, 4, 1, 8)
    g, beta = torch.zeros(1, 4, 1), torch.ones(1, 4, 1)
    refusals = [
        ("fla", "cannot run correctly"),
        ("fla-hybrid", "Hopper GPU"),
        ("chunked-triton", "CUDA"),
        ("nope", "unknown"),
    ]
    for name, message in refusals:
        with pytest.raises(ValueError, match=message):
            chunk_gated_delta_rule(x, x, x, g, beta, backend=name)
    o, _ = chunk_gated_delta_rule(x, x, x, g, beta, backend=select_backend("cpu"))
    assert o.shape == x.shape
