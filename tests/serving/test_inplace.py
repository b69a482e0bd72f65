"""In-place update of a live vLLM server: buckets applied once after the last, same PID, served name advances."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_support.core.serving.backend import Server, get_backend
from model_support.core.serving.errors import ServerError, ServingError
from model_support.core.serving.export import base_tensors, buckets, export_merged, merged_tensors
from model_support.core.serving.vllm_backend import ServeOptions
from model_support.handlers import BUILTIN_HANDLERS
from tests.serving.adapters import random_adapter

PROMPT = [17, 101, 44, 250, 9, 311, 66, 140, 23, 77]
TARGETS = next(h for h in BUILTIN_HANDLERS if h.name == "qwen3").hf_target_modules
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def qwen3_server(runtime, tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("vllm-inplace") / "vllm.log"
    server = get_backend("vllm").serve(tiny_model_dir("qwen3"), "qwen3@0", ServeOptions(dtype="float32"), log)
    yield server
    server.stop()


def _served(server: Server, model: str | None = None) -> torch.Tensor:
    choice = server.completion(PROMPT, model=model, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return torch.tensor(
        [row[str(t)]["logprob"] for row, t in zip(choice["prompt_logprobs"][1:], PROMPT[1:], strict=True)]
    )


def _reference(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].double(), -1)
    return logprobs[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].float()


@pytest.mark.slow
def test_weights_update_in_place_bucket_by_bucket(qwen3_server, tiny_model_dir, tmp_path):
    server, base = qwen3_server, tiny_model_dir("qwen3")
    pid = server.pid
    previous = _served(server)
    assert (previous - _reference(base)).abs().max().item() < FP32_TOL
    staged: list[Path] = []
    for step in (1, 2):
        adapter = random_adapter(base, TARGETS, tmp_path / f"adapter-{step}", seed=20 + step)
        expected = _reference(export_merged(base, adapter, tmp_path / f"reference-{step}"))
        parts = list(buckets(merged_tensors(base, adapter), max_bytes=150_000))
        assert len(parts) >= 3

        def stream(parts=parts, step=step, previous=previous) -> Iterator[dict[str, torch.Tensor]]:
            for i, part in enumerate(parts):
                if i:  # nothing is applied before the last bucket: same name, same outputs
                    assert server.models() == [f"qwen3@{step - 1}"]
                    assert (_served(server) - previous).abs().max().item() < 1e-6
                yield part

        assert server.update_weights(stream()) == f"qwen3@{step}"
        assert server.models() == [f"qwen3@{step}"]
        assert server.pid == pid and server.process.alive()
        with pytest.raises(ServerError, match=rf"404.*qwen3@{step - 1}.*does not exist"):
            server.completion(PROMPT, model=f"qwen3@{step - 1}", max_tokens=1)
        now = _served(server)
        assert (now - expected).abs().max().item() < FP32_TOL
        assert (now - previous).abs().max().item() > 1e-2
        previous = now
        staged = sorted(server.process.log_path.parent.glob("qwen3-weights/step-*"))
        assert [p.name for p in staged] == [f"step-{step}"]  # the previous step's checkpoint is removed


def test_a_failed_update_changes_nothing(qwen3_server, tiny_model_dir, tmp_path):
    server = qwen3_server
    name, before = server.served_name, _served(server)

    def broken() -> Iterator[dict[str, torch.Tensor]]:
        yield {"model.embed_tokens.weight": torch.zeros(4, 4)}
        raise RuntimeError("trainer died mid-push")

    with pytest.raises(RuntimeError, match="trainer died mid-push"):
        server.update_weights(broken())
    assert server.models() == [name]
    assert (_served(server) - before).abs().max().item() < 1e-6
    assert not list(server.process.log_path.parent.glob("qwen3-weights/.step-*.partial"))


def test_an_update_that_misses_a_tensor_is_refused(qwen3_server, tiny_model_dir):
    server = qwen3_server
    name, before = server.served_name, _served(server)
    partial = [{k: v for k, v in b.items() if k != "model.layers.0.self_attn.q_proj.weight"} for b in
               buckets(base_tensors(tiny_model_dir("qwen3")), max_bytes=1 << 30)]  # fmt: skip
    with pytest.raises(ServingError, match=r"1 tensor\(s\) missing \['model.layers.0.self_attn.q_proj.weight'\]"):
        server.update_weights(partial)
    assert server.models() == [name]
    assert (_served(server) - before).abs().max().item() < 1e-6


@pytest.mark.slow
def test_the_cpu_build_still_cannot_reload_moe_weights_in_place(runtime, tiny_model_dir, tmp_path):
    """The measurement behind session.CPU_MOE_RELOAD_GAP: when it stops holding, remove the gap."""
    if runtime.flavor != "cpu":
        pytest.skip("a gap of the CPU build")
    model = tiny_model_dir("qwen3-moe")
    server = get_backend("vllm").serve(model, "moe@0", ServeOptions(dtype="float32"), tmp_path / "vllm.log")
    try:
        before = _served(server)
        assert server.update_weights(buckets(base_tensors(model), max_bytes=1 << 30)) == "moe@1"
        moved = (_served(server) - before).abs().max().item()
    finally:
        server.stop()
    assert moved > 1e-3, f"reloading the same weights now moves log-probs by only {moved:.2e}: drop the gap"
