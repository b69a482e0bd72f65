"""Serving fixtures: the installed vLLM runtime (the tests skip without it).

The tiny replicas (``tiny_model_dir``) keep the real models' GDN head size, 128: vLLM's CPU Gated DeltaNet
kernel (``chunk_gated_delta_rule_cpu``) rejects 16 ("expect head_dim to be multiples of 32") and 32
("Unexpected head dim size, 32").
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model_support.core.serving.backend import Server, get_backend
from model_support.core.serving.errors import RuntimeMissingError
from model_support.core.serving.options import ServeOptions
from model_support.core.serving.runtime import RuntimeInfo, load_runtime


@pytest.fixture(scope="session")
def runtime() -> RuntimeInfo:
    try:
        return load_runtime()
    except RuntimeMissingError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def qwen3_server(runtime, tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    """One server on the tiny Qwen3 replica with LoRA on, shared by the serving tests (a start costs ~35 s): fp32 on
    the CPU build, bf16 on a GPU (vLLM's GPU LoRA kernels take fp16 / bf16 only). Tests that change what it serves
    leave it serving one name and no adapter; read ``served_name``, not ``@0``. On a GPU it takes a fifth of it,
    leaving room for the servers other tests start beside it (the sleep test's takes half)."""
    log = tmp_path_factory.mktemp("vllm-qwen3") / "vllm.log"
    gpu = runtime.flavor == "gpu"
    options = ServeOptions(
        dtype="bfloat16" if gpu else "float32",
        enable_lora=True,
        max_model_len=1024,
        gpu_memory_utilization=0.2 if gpu else None,
    )
    server = get_backend("vllm").serve(tiny_model_dir("qwen3"), "qwen3@0", options, log)
    yield server
    server.stop()
