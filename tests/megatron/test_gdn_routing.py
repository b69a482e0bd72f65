"""megatron-core's GatedDeltaNet calls its recurrence with its own keyword convention; the routed rule that
replaces fla's kernel in it must compute the gated delta rule for that call, packed rows included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.megatron.conftest import require_megatron


def test_routed_rule_takes_megatron_cores_call_and_matches_the_recurrence() -> None:
    require_megatron()
    from model_support.core.megatron.gdn import RoutedGatedDeltaNet
    from model_support.kernels.reference import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    total, heads, dim = 23, 4, 16
    q, k, v = (torch.randn(1, total, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, total, heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, total, heads, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 9, 17, total], dtype=torch.int32)
    layer = SimpleNamespace(kernel="torch-chunked")
    # Exactly how megatron-core 0.19's GatedDeltaNet.forward calls self.gated_delta_rule.
    out, final = RoutedGatedDeltaNet._routed_rule(
        layer,
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    expected, _ = recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True)
    assert final is None
    assert out.shape == (1, total, heads, dim)
    assert (out - expected).abs().max().item() < 1e-10
    # The sequence boundaries matter: the same tokens as one sequence give another result.
    whole, _ = recurrent_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=torch.tensor([0, total], dtype=torch.int32), use_qk_l2norm=True
    )
    assert (whole - expected)[:, 9:].abs().max().item() > 1e-3


def test_routed_rule_refuses_a_kernel_that_cannot_run_here() -> None:
    require_megatron()
    from model_support.core.megatron.gdn import RoutedGatedDeltaNet

    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="fla-hybrid"):
        RoutedGatedDeltaNet._routed_rule(
            SimpleNamespace(kernel="fla-hybrid"), x, x, x, g=-x[..., 0].abs(), beta=x[..., 0].sigmoid()
        )


def test_numerics_on_a_cpu_are_fp32_local_gdn_unless_asked() -> None:
    require_megatron()
    from model_support.core.megatron.builder import choose_numerics

    cpu = torch.device("cpu")
    default = choose_numerics(device_=cpu)
    assert (default.dtype, default.gdn_module, default.gdn_kernel) == (
        torch.float32,
        "LocalGatedDeltaNet",
        "torch-chunked",
    )
    assert "torch-chunked" in default.describe(gdn=True) and "float32 on cpu" in default.describe(gdn=True)
    assert choose_numerics(device_=cpu, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="cannot run correctly here"):
        choose_numerics("fla", device_=cpu)
