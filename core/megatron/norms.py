"""The RMSNorms model-support substitutes for megatron-core's local ones (``spec.py`` lays them out; ``gdn.py``'s
output norm is one): fp32, zero-centred gamma, and runnable under sequence parallelism.

Their own module, below both ``spec.py`` and ``gdn.py``, so that neither imports the other for them.
"""

from __future__ import annotations

from typing import Any

import torch


class LocalRMSNorm(torch.nn.Module):
    """RMSNorm computing ``norm(x) * weight`` in fp32; unlike megatron-core's torch-norm wrapper it runs under
    sequence parallelism (its weight is marked ``sequence_parallel``, as megatron-core marks its own norms). Its
    weight is fp32 whatever the model's dtype, as the torch norm megatron-core builds without sequence parallelism
    holds it: every layout holds the same weights."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(self._initial(hidden_size, self._dtype(config)))
        self.weight.sequence_parallel = config.sequence_parallel

    @staticmethod
    def _dtype(config: Any) -> torch.dtype:
        return torch.float32

    @staticmethod
    def _initial(size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.ones(size, dtype=dtype)

    def _gain(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self._gain()).to(x.dtype)


class ZeroCenteredRMSNorm(LocalRMSNorm):
    """RMSNorm computing ``norm(x) * (1 + weight)`` in fp32, its weight in the model's dtype (it is the norm of every
    layout of the families that have it)."""

    @staticmethod
    def _dtype(config: Any) -> torch.dtype:
        return config.params_dtype

    @staticmethod
    def _initial(size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(size, dtype=dtype)

    def _gain(self) -> torch.Tensor:
        return 1.0 + self.weight.float()


def local_norm(config: Any) -> type[LocalRMSNorm] | None:
    """The norm model-support substitutes for the local spec's: zero-centred gamma (which megatron-core's torch norm
    refuses), or RMSNorm under sequence parallelism (likewise); None keeps megatron-core's."""
    if config.layernorm_zero_centered_gamma:
        return ZeroCenteredRMSNorm
    if config.sequence_parallel and config.normalization == "RMSNorm":
        return LocalRMSNorm
    return None
