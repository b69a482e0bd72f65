"""Serving fixtures: the installed vLLM runtime and tiny replicas the CPU vLLM build can serve.

vLLM's CPU Gated DeltaNet kernel (``chunk_gated_delta_rule_cpu``) rejects the tiny replicas' GDN head size 16
("expect head_dim to be multiples of 32") and 32 ("Unexpected head dim size, 32"); it runs the real models'
128. The Qwen3.5 replicas served here are therefore built by the same ``build_tiny`` with GDN heads of 128.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from model_support.core.serving.errors import RuntimeMissingError
from model_support.core.serving.runtime import RuntimeInfo, load_runtime
from model_support.handlers import BUILTIN_HANDLERS

CPU_GDN_HEAD_DIM = 128


@pytest.fixture(scope="session")
def runtime() -> RuntimeInfo:
    try:
        return load_runtime()
    except RuntimeMissingError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def serving_replica(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``serving_replica("qwen3.5")`` -> a tiny replica (seed 0) that the CPU vLLM build can run."""
    from model_support.core import tiny

    specs = {h.name: h for h in BUILTIN_HANDLERS}
    built: dict[str, Path] = {}

    def build(handler: str) -> Path:
        if handler not in built:
            raw = json.loads(specs[handler].reference_config.read_text())
            out = tmp_path_factory.mktemp(f"serving-{handler}")
            with pytest.MonkeyPatch.context() as mp:
                if specs[handler].linear_attention:
                    mp.setitem(tiny._TEXT_DIMS, "linear_key_head_dim", CPU_GDN_HEAD_DIM)
                    mp.setitem(tiny._TEXT_DIMS, "linear_value_head_dim", CPU_GDN_HEAD_DIM)
                built[handler] = tiny.build_tiny(raw, out, seed=0)
        return built[handler]

    return build
