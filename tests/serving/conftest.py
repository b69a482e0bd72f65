"""Serving fixtures: the installed vLLM runtime (the tests skip without it).

The tiny replicas (``tiny_model_dir``) keep the real models' GDN head size, 128: vLLM's CPU Gated DeltaNet
kernel (``chunk_gated_delta_rule_cpu``) rejects 16 ("expect head_dim to be multiples of 32") and 32
("Unexpected head dim size, 32").
"""

from __future__ import annotations

import pytest

from model_support.core.serving.errors import RuntimeMissingError
from model_support.core.serving.runtime import RuntimeInfo, load_runtime


@pytest.fixture(scope="session")
def runtime() -> RuntimeInfo:
    try:
        return load_runtime()
    except RuntimeMissingError as exc:
        pytest.skip(str(exc))
