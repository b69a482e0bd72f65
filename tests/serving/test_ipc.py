"""The ``ipc`` weight transport (a server on the trainer's own GPU, buckets handed over as CUDA IPC handles): refused
in one line where it cannot work, before anything is sent; on a GPU, a step pushed through IPC serves exactly what
the same step streamed through memory serves, the trainer's buffers are freed, and a refused bucket changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_support.core.serving.backend import get_backend
from model_support.core.serving.errors import ServerError, ServingError
from model_support.core.serving.export import base_tensors, buckets, merged_tensors
from model_support.core.serving.options import ServeOptions
from model_support.core.serving.update import WeightUpdater, ipc_handle, pack
from tests.serving.adapters import TARGETS, random_adapter, served_logprobs

BUCKET_BYTES = 150_000  # the tiny replica's step in several buckets
SAME = 1e-4  # one server, the same weights: only a kernel's run-to-run noise (bf16 weights differ by > 1e-2)


def test_ipc_to_a_server_without_a_gpu_is_refused_before_anything_is_sent(runtime, request, tiny_model_dir):
    if runtime.flavor != "cpu":
        pytest.skip("the refusal of a server without a GPU (the CPU build)")
    server, base = request.getfixturevalue("qwen3_server"), tiny_model_dir("qwen3")
    name, before = server.served_name, served_logprobs(server)
    updater = WeightUpdater(server, base, base, transport="ipc", backend="gloo")
    with pytest.raises(ServingError, match=r"^weight_transfer='ipc' hands buckets over through CUDA IPC: it needs"):
        updater.update(buckets(base_tensors(base), max_bytes=BUCKET_BYTES))
    assert server.models() == [name]
    assert (served_logprobs(server) - before).abs().max().item() == 0.0


def test_an_ipc_push_serves_what_the_stream_serves_and_frees_the_trainers_buffers(
    runtime, tiny_model_dir, tmp_path: Path
):
    if runtime.flavor != "gpu" or not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs the server and the trainer on one GPU")
    base = tiny_model_dir("qwen3")
    options = ServeOptions(dtype="bfloat16", weight_transfer="ipc", gpu_memory_utilization=0.25)
    server = get_backend("vllm").serve(base, "qwen3@0", options, tmp_path / "vllm.log")
    try:
        stream = WeightUpdater(server, tmp_path / "staging", base, transport="stream", backend="nccl")
        adapter = random_adapter(base, TARGETS, tmp_path / "adapter", seed=7)
        merged = dict(merged_tensors(base, adapter))

        def on_gpu(tensors) -> Iterator[dict[str, torch.Tensor]]:  # as a live model's merged weights are
            for bucket in buckets(tensors, max_bytes=BUCKET_BYTES):
                yield {name: tensor.cuda() for name, tensor in bucket.items()}

        start = served_logprobs(server)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        assert server.update_weights(on_gpu(merged.items())) == "qwen3@1"  # the server's own transport: ipc
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - held
        through_ipc = served_logprobs(server)
        step_bytes = sum(t.numel() * t.element_size() for t in merged.values())
        assert left < step_bytes / 2, (left, step_bytes)  # no bucket outlives the push on the trainer's GPU
        assert (through_ipc - start).abs().max().item() > 1e-2  # the step changed what is served

        assert stream.update(buckets(base_tensors(base), max_bytes=BUCKET_BYTES)) == "qwen3@2"
        assert (served_logprobs(server) - start).abs().max().item() < SAME  # back on the base weights
        assert stream.update(buckets(merged.items(), max_bytes=BUCKET_BYTES)) == "qwen3@3"
        # The same step through memory: the same.
        assert (served_logprobs(server) - through_ipc).abs().max().item() < SAME

        # A bucket the worker refuses (not the announced dtype) ends the step there; nothing is applied.
        server.request("/start_weight_update", {})
        server.request("/update_weights", {"update_info": {"params": [["model.norm.weight", "float32", [64]]]}})
        packed, header = pack({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, torch.device("cuda"))
        torch.cuda.synchronize()
        update = {"bucket": header, "nbytes": packed.numel(), "ipc": ipc_handle(packed), "is_last": True}
        with pytest.raises(ServerError, match=r"'model\.norm\.weight' is bfloat16 \[64\], announced float32 \[64\]"):
            server.request("/update_weights", {"update_info": update})
        assert server.models() == ["qwen3@3"]
        assert (served_logprobs(server) - through_ipc).abs().max().item() < SAME
    finally:
        server.stop()
